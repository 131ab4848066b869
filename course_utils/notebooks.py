"""Build and execute the course notebooks: ``python -m course_utils.notebooks sync|check|execute|map``.

Each chapter is written as a percent-format script, ``notebooks/src/NN_name.py`` (easy to review and
diff), and shipped as ``notebooks/NN_name.ipynb`` with its outputs and figures (what learners open and
what readers see on GitHub). ``sync`` rebuilds the .ipynb files whose source changed; ``check`` fails
if any .ipynb is out of step with its source; ``execute`` runs notebooks headless with papermill on a
fresh kernel, in place (``make notebooks``) or into another folder (CI), and prints each runtime; ``--jobs 2``
runs two chapters at once, each in a process of its own, the longest first (``make test``: one chapter's kernel and
ranks leave about a third of two cores idle, waiting on starts and messages). ``map`` writes ``docs/CHAPTERS.md``,
which files make each chapter (``course_utils/chapter_map.py``).
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jupytext
import nbformat

from course_utils.paths import COMMITTED_FIGURES, ROOT

NB_DIR = ROOT / "notebooks"
SRC_DIR = NB_DIR / "src"


def sources() -> list[Path]:
    return sorted(SRC_DIR.glob("[0-9][0-9]_*.py"))


def notebook_for(src: Path) -> Path:
    return NB_DIR / (src.stem + ".ipynb")


def _cells(nb) -> list[tuple[str, str, tuple]]:
    return [(c.cell_type, c.source.strip(), tuple(c.get("metadata", {}).get("tags", []))) for c in nb.cells]


def build(src: Path) -> nbformat.NotebookNode:
    nb = jupytext.read(src)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (course)", "language": "python"}
    nb.metadata.pop("jupytext", None)
    return nb


def in_sync(src: Path) -> bool:
    target = notebook_for(src)
    return target.exists() and _cells(build(src)) == _cells(nbformat.read(target, as_version=4))


def _carry_outputs(nb, old_path: Path) -> None:
    """Keep what the stored notebook has for cells whose source did not change: outputs of code cells (a
    markdown fix needs no rerun), and every cell's id and metadata (so the diff shows only the real change)."""
    if not old_path.exists():
        return
    stored = nbformat.read(old_path, as_version=4)
    old = {}
    for cell in stored.cells:
        old.setdefault((cell.cell_type, cell.source.strip()), cell)
    for cell in nb.cells:
        prev = old.get((cell.cell_type, cell.source.strip()))
        if prev is None:
            continue
        if "id" in prev:
            cell.id = prev.id
        tags = cell.metadata.get("tags")  # the source decides the tags; the stored cell, the rest
        cell.metadata = nbformat.from_dict(dict(prev.metadata))
        cell.metadata.pop("tags", None)
        if tags:
            cell.metadata["tags"] = tags
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = prev.outputs, prev.execution_count
    for key in ("papermill", "widgets"):
        if key in stored.metadata:
            nb.metadata[key] = stored.metadata[key]


def sync(names: list[str] | None = None) -> list[Path]:
    changed = []
    for src in sources():
        if names and src.stem not in names:
            continue
        if not in_sync(src):
            nb = build(src)
            _carry_outputs(nb, notebook_for(src))
            nbformat.write(nb, notebook_for(src))
            changed.append(notebook_for(src))
    return changed


POLL_SLICE_S = 0.5


def poll_in_slices(channel_class=None, slice_s: float = POLL_SLICE_S) -> None:
    """Make the executor's kernel channels wait for a message in slices of ``slice_s`` seconds up to their timeout.

    nbclient waits for a cell's reply with one poll as long as the cell's whole timeout, and a reply that arrives
    after a widget's comm messages can sit unseen until that poll ends (jupyter/nbclient#312; here chapter 10's
    widget cell once took 600 s, the cell timeout, in CI's second execution, and 0.1 s in the first). A new poll
    looks at the socket's pending messages first, so a missed one is found within a slice."""
    from queue import Empty

    if channel_class is None:
        from jupyter_client.channels import AsyncZMQSocketChannel as channel_class
    original = channel_class.get_msg
    if getattr(original, "sliced", False):
        return

    async def get_msg(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = slice_s if deadline is None else max(0.0, min(slice_s, deadline - time.monotonic()))
            try:
                return await original(self, timeout=left)
            except Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    get_msg.sliced = True
    channel_class.get_msg = get_msg


def execute(path: Path, output: Path, *, timeout: float = 900) -> float:
    import papermill

    poll_in_slices()
    start = time.perf_counter()
    papermill.execute_notebook(str(path), str(output), kernel_name="python3", cwd=str(NB_DIR),
                               execution_timeout=timeout, progress_bar=False, log_output=False)
    _relative_paths(output)
    return time.perf_counter() - start


# What a stored widget output says before its cell has run in the learner's kernel: JupyterLab shows an output's
# text/plain when the widget's model does not exist yet, and ipywidgets' own is the widget tree's repr
# ("VBox(children=(HBox(children=(Dropdown(...").
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_NOT_RUN = "(an interactive widget: it appears when this cell runs, e.g. after Run > Run All Cells)"


def placeholder_widgets(nb) -> int:
    """Give every stored widget output the sentence above as its text/plain; how many outputs changed."""
    changed = 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if WIDGET_VIEW in data and data.get("text/plain") != WIDGET_NOT_RUN:
                data["text/plain"] = WIDGET_NOT_RUN
                changed += 1
    return changed


def _relative_paths(path: Path) -> None:
    """Papermill records where it read and wrote the notebook; a committed notebook must not carry this machine's
    folders, so the paths are stored relative to the repository. Its widget outputs get ``WIDGET_NOT_RUN``."""
    nb = nbformat.read(str(path), as_version=4)
    meta = nb.metadata.get("papermill", {})
    for key in ("input_path", "output_path"):
        if meta.get(key):
            meta[key] = os.path.relpath(Path(meta[key]).resolve(), ROOT)
    placeholder_widgets(nb)
    nbformat.write(nb, str(path))


def recorded_seconds(nb: Path) -> float:
    """How long the chapter's committed execution took (papermill's ``duration``), 0 when it has none."""
    try:
        return float(nbformat.read(str(nb), as_version=4).metadata.get("papermill", {}).get("duration") or 0.0)
    except (OSError, ValueError, TypeError):
        return 0.0


def execute_in_parallel(names: list[str], out: Path | None, timeout: float, jobs: int) -> int:
    """Each of ``names`` executed by ``python -m course_utils.notebooks execute NAME`` in a process of its own,
    ``jobs`` at a time, the longest (by its committed run) first so that the last to start are the short ones. Each
    child's report is printed as it ends; returns how many failed."""
    names = sorted(names, key=lambda n: -recorded_seconds(NB_DIR / f"{n}.ipynb"))
    base = [sys.executable, "-m", "course_utils.notebooks", "--timeout", str(timeout)]
    if out:
        base += ["--out", str(out.resolve())]
    running: list[tuple[str, subprocess.Popen, object]] = []  # (name, its process, the file its output goes to)
    failed = 0
    try:
        while names or running:
            while names and len(running) < jobs:
                name = names.pop(0)
                log = tempfile.TemporaryFile(mode="w+")  # not a pipe: a child must never block on a full one
                running.append((name, subprocess.Popen([*base, "execute", name], cwd=ROOT, stdout=log,
                                                       stderr=subprocess.STDOUT, text=True), log))
            time.sleep(0.5)
            for entry in [r for r in running if r[1].poll() is not None]:
                running.remove(entry)
                name, proc, log = entry
                log.seek(0)
                print(log.read().rstrip(), flush=True)
                log.close()
                if proc.returncode:
                    failed += 1
                    print(f"{name}: its execution exited with {proc.returncode}", flush=True)
    finally:  # interrupted: each child gets the Ctrl-C it would have got alone (papermill then stops its kernel)
        for _, proc, _ in running:
            proc.send_signal(signal.SIGINT)
        for _, proc, _ in running:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["sync", "check", "execute", "map"])
    p.add_argument("names", nargs="*", help="notebook stems (default: all)")
    p.add_argument("--out", type=Path, help="execute into this folder instead of in place")
    p.add_argument("--timeout", type=float, default=900, help="per-cell execution timeout (s)")
    p.add_argument("--jobs", type=int, default=1, help="chapters executed at once, each in its own process")
    a = p.parse_args(argv)
    if a.command == "sync":
        for path in sync(a.names):
            print(f"rebuilt {path.relative_to(ROOT)}")
        return 0
    if a.command == "map":
        from course_utils.chapter_map import write

        print(f"wrote {write().relative_to(ROOT)}")
        return 0
    if a.command == "check":
        stale = [s for s in sources() if not in_sync(s)]
        for s in stale:
            print(f"{notebook_for(s).relative_to(ROOT)} is out of step with {s.relative_to(ROOT)}: run `make notebooks`")
        return 1 if stale else 0
    sync(a.names)
    COMMITTED_FIGURES.mkdir(exist_ok=True)
    # Regenerating the chapters in place regenerates their committed figures; a run that does not write the
    # notebook back must not rewrite them either. The kernels papermill starts inherit this environment.
    os.environ["COURSE_FIGURES_DIR"] = str((a.out / "figures").resolve() if a.out else COMMITTED_FIGURES)
    if a.out:  # its own checkpoints and traces: nbval may be executing the same chapters at the same time
        os.environ["COURSE_SCRATCH_DIR"] = str((a.out / "scratch").resolve())
    chosen = [src for src in sources() if not a.names or src.stem in a.names]
    if a.jobs > 1 and len(chosen) > 1:
        return 1 if execute_in_parallel([src.stem for src in chosen], a.out, a.timeout, a.jobs) else 0
    failed = 0
    for src in chosen:
        nb = notebook_for(src)
        out = (a.out / nb.name) if a.out else nb
        if a.out:
            a.out.mkdir(parents=True, exist_ok=True)
        try:
            seconds = execute(nb, out, timeout=a.timeout)
            print(f"{nb.name}: executed headless in {seconds:.1f} s (CPU)", flush=True)
        except Exception as exc:  # noqa: BLE001 - report every notebook, then fail
            failed += 1
            lines = str(exc).strip().splitlines() or [repr(exc)]
            # the failing cell's traceback (papermill's message carries it): CI shows it without the notebook
            print(f"{nb.name}: FAILED: {lines[-1]}\n" + "\n".join("    " + line for line in lines[-40:]), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
