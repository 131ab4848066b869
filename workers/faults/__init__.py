"""The course's one mechanism for injected faults: a fault replaces one function or method for a run.

``patched(target, name, value)`` swaps ``target.name`` for the duration of a ``with`` and puts the original back;
``injected(fault, patches)`` picks one fault's patch from a table. Each library keeps its own table next to the code it
breaks (``workers/parallel/faults.py`` for tensor parallelism, ``workers/composed/faults.py`` for chapter 15's
compositions, ``workers/moe/faults.py`` for chapter 16's MoE layer), so no model or trainer branches on a fault's name.
"""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def patched(target, name, value):
    """``target.name = value`` for the duration of the ``with``, then the original back."""
    saved = getattr(target, name)
    setattr(target, name, value)
    try:
        yield
    finally:
        setattr(target, name, saved)


@contextlib.contextmanager
def injected(fault: str, patches):
    """Run the body with ``fault``'s one patch from ``patches()``, a table ``{fault: (target, attribute, value)}``
    ("none" or "": no fault): how chapters 15 and 16 inject theirs (``workers/composed/faults.py``,
    ``workers/moe/faults.py``)."""
    if not fault or fault == "none":
        yield
        return
    table = patches()
    if fault not in table:
        raise ValueError(f"no fault named {fault!r}: choose one of {', '.join(table)}")
    with patched(*table[fault]):
        yield
