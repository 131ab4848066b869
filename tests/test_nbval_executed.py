"""``tests/nbval_executed.py``: nbval's comparison against a notebook executed already (CI's one execution per
chapter) fails where nbval executing the cell itself would, and passes where nbval would.

Each case is a two-cell notebook whose stored outputs are compared with an "executed" copy that differs in one way;
pytest runs on it in a subprocess with the plugin, as the Makefile runs it.
"""
from __future__ import annotations

import subprocess
import sys

import nbformat
import pytest

from tests.lab_server import ROOT

pytestmark = pytest.mark.once  # a comparison of stored text: the same on every CPU

STORED = [("print('loss 2.5')", [nbformat.v4.new_output("stream", name="stdout", text="loss 2.5\n")]),
          ("x = 1\nx", [nbformat.v4.new_output("execute_result", data={"text/plain": "1"}, execution_count=2)])]


def notebook(cells, tags=()) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    for n, (source, outputs) in enumerate(cells, start=1):
        cell = nbformat.v4.new_code_cell(source, outputs=outputs, execution_count=n)
        if tags:
            cell.metadata["tags"] = list(tags)
        nb.cells.append(cell)
    return nb


def compare(tmp_path, executed_cells, *, stored_cells=STORED, tags=(), sanitize: str | None = None):
    (tmp_path / "executed").mkdir(parents=True)
    nbformat.write(notebook(stored_cells, tags), tmp_path / "chapter.ipynb")
    nbformat.write(executed_cells if isinstance(executed_cells, nbformat.NotebookNode) else notebook(executed_cells),
                   tmp_path / "executed" / "chapter.ipynb")
    extra = []
    if sanitize:
        (tmp_path / "sanitize.cfg").write_text(sanitize)
        extra = ["--nbval-sanitize-with", str(tmp_path / "sanitize.cfg")]
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.nbval_executed",
                           "--nbval", "--nbval-executed", str(tmp_path / "executed"), *extra,
                           str(tmp_path / "chapter.ipynb")], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_equal_outputs_pass(tmp_path):
    run = compare(tmp_path, STORED)
    assert run.returncode == 0 and "2 passed" in run.stdout, run.stdout


@pytest.mark.parametrize("executed, message", [
    ([("print('loss 2.5')", [nbformat.v4.new_output("stream", name="stdout", text="loss 2.6\n")]), STORED[1]],
     "Cell outputs differ"),
    ([STORED[0], ("x = 1\nx", [nbformat.v4.new_output(
        "error", ename="NameError", evalue="name 'x' is not defined", traceback=["NameError: x"])])],
     "Cell execution caused an exception"),
    ([STORED[0], ("x = 2\nx", STORED[1][1])], "other code than this one"),
    ([STORED[0]], "it was executed from other code"),
])
def test_a_difference_nbval_would_catch_fails(tmp_path, executed, message):
    run = compare(tmp_path, executed)
    assert run.returncode == 1 and "1 failed" in run.stdout and message in run.stdout, run.stdout


def test_a_cell_the_execution_never_reached_fails(tmp_path):
    nb = notebook(STORED)
    nb.cells[1].outputs, nb.cells[1].execution_count = [], None  # papermill stopped before it
    run = compare(tmp_path, nb)
    assert run.returncode == 1 and "never ran in the executed notebook" in run.stdout, run.stdout


def test_ignore_output_and_sanitize_patterns_hold_as_in_nbval(tmp_path):
    changed = [("print('loss 2.5')", [nbformat.v4.new_output("stream", name="stdout", text="loss 9.9\n")]), STORED[1]]
    assert compare(tmp_path / "a", changed, tags=["nbval-ignore-output"]).returncode == 0
    pid = [("print('pid=12')", [nbformat.v4.new_output("stream", name="stdout", text="pid=12\n")])]
    pid_other = [("print('pid=12')", [nbformat.v4.new_output("stream", name="stdout", text="pid=345\n")])]
    rule = "[pids]\nregex: pid=\\d+\nreplace: pid=PID\n"
    assert compare(tmp_path / "b", pid_other, stored_cells=pid, sanitize=rule).returncode == 0
    assert compare(tmp_path / "c", pid_other, stored_cells=pid).returncode == 1  # no rule: a real difference
