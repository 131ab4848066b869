"""Progress lines (course_utils/progress.py): a cell that starts ranks cold, or loops over runs, says so as it goes,
in a real Jupyter kernel and only there; nbval leaves the lines (their seconds vary) out of its comparison."""
from __future__ import annotations

import re
import subprocess
import sys

import nbformat
import pytest
from nbclient import NotebookClient
from nbval.plugin import get_sanitize_patterns

from course_utils import progress
from course_utils.paths import ROOT

CELLS = [
    "import course_utils as cu\nres = cu.run('workers.hello', world_size=2)\nprint('ranks answered:', res.launch)",
    "res = cu.run('workers.hello', world_size=2)\nprint('ranks answered:', res.launch)",
    "for x in cu.each(['a', 'b', 'c'], 'setting', lambda s: s.upper()):\n    pass",
    "cu.shutdown_pools()",
]


def stdout(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.get("name") == "stdout")


@pytest.mark.ranks
@pytest.mark.once  # what a kernel prints: the same on every CPU
def test_a_cell_says_before_it_waits_for_new_ranks_and_a_loop_says_where_it_is(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    NotebookClient(nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    cold, warm, loop, _ = (stdout(c) for c in nb.cells)
    # The cold start is announced before the run's own output, with the time to expect.
    first, second = cold.splitlines()
    assert re.fullmatch(r"\[progress\] workers\.hello: starting 2 ranks \(a cold start: about \d+ s to start them and "
                        r"run workers\.hello for the first time, .*\)", first), cold
    assert second == "ranks answered: cold"
    assert warm == "ranks answered: warm\n", "a warm run has nothing to announce"
    assert loop.splitlines()[0] == "[progress] setting 1 of 3: A"
    assert re.fullmatch(r"\[progress\] setting 2 of 3: B \(\d+ s so far\)", loop.splitlines()[1]), loop
    assert re.fullmatch(r"\[progress\] setting: all 3 done in \d+ s", loop.splitlines()[-1]), loop


def test_outside_a_notebook_nothing_is_printed():
    out = subprocess.run([sys.executable, "-c", "from course_utils import progress\n"
                          "import IPython\nprogress.say('x')\nprint(list(progress.each([1, 2], 'n')))"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "[1, 2]\n"


def test_nbval_leaves_progress_lines_out_of_the_comparison():
    patterns = get_sanitize_patterns((ROOT / "tests" / "nbval_sanitize.cfg").read_text())
    stored = (f"{progress.PREFIX}workers.ch02_ddp: starting 4 ranks (a cold start: about 10 s to start them and run "
              f"workers.ch02_ddp for the first time, measured here on its last cold start; longer while the machine is "
              f"busy)\nworkers.ch02_ddp: world 4\n{progress.PREFIX}layout 2 of 6: "
              "2x2x2x1, ZeRO-1 (4 s so far)\n")
    rerun = "workers.ch02_ddp: world 4\n"
    for regex, replace in patterns:
        stored, rerun = re.sub(regex, replace, stored), re.sub(regex, replace, rerun)
    assert stored == rerun == "workers.ch02_ddp: world 4\n"
