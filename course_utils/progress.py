"""Progress lines for cells that take a while: a learner never watches a silent cell for a minute.

Two sources, one format (a line that starts with ``[progress]``, printed as the cell goes):

* ``launcher.run`` says so before it waits for new ranks ("[progress] workers.ch02_ddp: starting 4 ranks (a cold
  start: about 10 s to start them and run workers.ch02_ddp for the first time, measured here on its last cold
  start; ...)"), so a cell or an exercise check that starts ranks cold names the wait and its length: the whole wait
  until the answer, the worker's first run on the new ranks included (``launcher.expected_cold_s``);
* ``each(items, what)`` wraps a cell's loop over runs and says which item it is on and the seconds so far.

They are printed only in a notebook's kernel (JupyterLab, papermill): tests and command-line tools stay quiet.
The seconds vary by machine, so nbval leaves these lines out of its comparison (``tests/nbval_sanitize.cfg``).
"""
from __future__ import annotations

import sys
import time
from typing import Callable, Iterable, Iterator, TypeVar

PREFIX = "[progress] "
T = TypeVar("T")


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel (where a cell's output is what the learner watches)."""
    if "IPython" not in sys.modules:
        return False
    from IPython import get_ipython

    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def say(line: str) -> None:
    """Print one progress line now (only in a notebook's kernel)."""
    if in_notebook():
        print(PREFIX + line, flush=True)


def each(items: Iterable[T], what: str, label: Callable[[T], str] = str) -> Iterator[T]:
    """Yield ``items``, saying before each which one of how many is next and how long the loop has run."""
    items = list(items)
    start = time.perf_counter()
    for i, item in enumerate(items, 1):
        so_far = time.perf_counter() - start
        say(f"{what} {i} of {len(items)}: {label(item)}" + (f" ({so_far:.0f} s so far)" if i > 1 else ""))
        yield item
    if len(items) > 1:
        say(f"{what}: all {len(items)} done in {time.perf_counter() - start:.0f} s")


__all__ = ["PREFIX", "in_notebook", "say", "each"]
