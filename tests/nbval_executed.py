"""nbval's comparison of a chapter's stored outputs, against a notebook papermill already executed instead of a
kernel of its own: ``pytest -p tests.nbval_executed --nbval --nbval-executed DIR notebooks/*.ipynb``.

CI executes every chapter once per CPU variant (``course_utils.notebooks execute --out DIR``, the run a learner's
``make notebooks`` does) and holds that one execution to the committed outputs, cell by cell, with nbval's own rules:
its per-cell options (``nbval-ignore-output``, ``nbval-raises-exception``; a cell marked ``nbval-skip`` fails, since
every cell is checked), the sanitize patterns of
``--nbval-sanitize-with``, its stream coalescing and its ``compare_outputs`` (the keys it skips, images compared by
presence). Before, nbval executed every chapter a second time beside papermill, and that second execution was
about a third of ``make test``.

What a kernel of nbval's own would have caught is caught here too: a cell that raised (its error output, with the
traceback), a cell that never ran (papermill stopped at an earlier error: no execution count), and a notebook run
from other code than the one compared (its cells' sources differ). Without ``--nbval-executed``, nbval runs as it
always does.
"""
from __future__ import annotations

import functools
from pathlib import Path

import nbformat
import pytest


def pytest_addoption(parser):
    parser.addoption("--nbval-executed", metavar="DIR", default=None,
                     help="compare with the notebooks of the same names in DIR, executed already, instead of "
                          "executing each notebook in a kernel")


def pytest_configure(config):
    folder = config.getoption("--nbval-executed")
    if not folder:
        return
    from nbval import plugin

    folder = Path(folder).resolve()
    if not folder.is_dir():
        raise pytest.UsageError(f"--nbval-executed {folder}: no such folder (run the notebooks into it first)")

    def setup(self):  # no kernel: the sanitize patterns are all a comparison needs
        self.setup_sanitize_files()

    def runtest(self):
        if self.options["skip"]:  # nbval would skip it; here an unchecked cell is an error, not a pass
            self.raise_cell_error("this cell is marked nbval-skip: the course checks every cell (mark varying "
                                  "output nbval-ignore-output instead)")
        executed = executed_code_cells(folder / Path(str(self.parent.fspath)).name)
        if self.cell_num >= len(executed):
            self.raise_cell_error(f"the executed notebook has {len(executed)} code cells; this is cell "
                                  f"{self.cell_num}: it was executed from other code")
        cell = executed[self.cell_num]
        if cell.source != self.cell.source:
            self.raise_cell_error("the executed notebook's cell has other code than this one: execute the chapter "
                                  "again", f"\nexecuted:\n{cell.source}\nhere:\n{self.cell.source}")
        errors = [o for o in cell.outputs if o.output_type == "error"]
        if errors and not self.options["check_exception"]:
            self.raise_cell_error("Cell execution caused an exception", "\n" + "\n".join(errors[0].traceback))
        if cell.execution_count is None and self.cell.execution_count is not None:
            self.raise_cell_error("this cell never ran in the executed notebook (the execution stopped at an "
                                  "earlier cell)")
        self.test_outputs = outs = plugin.coalesce_streams([nbformat.from_dict(dict(o)) for o in cell.outputs])
        unrun = self.cell.execution_count is None
        if unrun and self.cell.outputs:
            self.raise_cell_error("Unrun reference cell has outputs")
        if self.options["check"] and not unrun:
            if not self.compare_outputs(outs, plugin.coalesce_streams(self.cell.outputs)):
                self.raise_cell_error("Cell outputs differ", "\n".join(self.comparison_traceback))

    plugin.IPyNbFile.setup = setup
    plugin.IPyNbCell.runtest = runtest


@functools.lru_cache(maxsize=None)
def executed_code_cells(path: Path) -> list:
    if not path.exists():
        raise FileNotFoundError(f"{path}: the chapter was not executed into this folder")
    return [c for c in nbformat.read(str(path), as_version=4).cells if c.cell_type == "code"]
