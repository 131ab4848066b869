"""The batch grader, end to end: real notebooks executed headless, real ranks, a real gradebook.

Solutions must score full marks, shipped stubs zero (without the grader failing), and a submission that
hangs or does not even parse must cost only its own points: the grader survives and grades the rest.
"""
import csv
import inspect
from pathlib import Path

import nbformat
import pytest

from course_utils import grade
from course_utils.exercises import exercises
from tests.exercise_sources import solutions
from course_utils.paths import ROOT

pytestmark = pytest.mark.ranks
CHAPTERS = sorted({e.chapter for e in exercises()})
assert CHAPTERS, "no chapter registers exercises"
# The batch pipeline is proven on two chapters, one checked on real ranks and one in the notebook process;
# every exercise of every chapter is checked directly (solution, stub, wrong answers) in test_exercises.py.
ON_RANKS = [c for c in CHAPTERS if any(e.worker for e in exercises(c))][:1]
LOCAL = [c for c in CHAPTERS if all(e.local for e in exercises(c))][:1]
GRADED = ON_RANKS + LOCAL


def shipped(chapter: str) -> nbformat.NotebookNode:
    [path] = (ROOT / "notebooks").glob(f"{chapter}_*.ipynb")
    return nbformat.read(path, as_version=4)


def answer_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code" and "exercise" in c.metadata.get("tags", [])]


def with_answers(chapter: str, replace) -> nbformat.NotebookNode:
    nb = shipped(chapter)
    for ex in exercises(chapter):
        for cell in answer_cells(nb):
            if f"def {ex.function}(" in cell.source:
                cell.source = replace(ex)
    return nb


def write(nb, folder: Path, learner: str, chapter: str) -> None:
    [path] = (ROOT / "notebooks").glob(f"{chapter}_*.ipynb")
    (folder / learner).mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(folder / learner / path.name))


def read_gradebook(out: Path) -> list[dict]:
    with open(out / "gradebook.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.timeout(1500)
def test_solutions_full_marks_stubs_zero(tmp_path):
    assert len(GRADED) == 2, GRADED
    subs = tmp_path / "subs"
    for chapter in GRADED:
        sol = solutions(chapter)
        write(with_answers(chapter, lambda ex: inspect.getsource(getattr(sol, ex.function))), subs, "ada", chapter)
        write(shipped(chapter), subs, "bob", chapter)
    rows = grade.grade_all(subs, tmp_path / "out", cell_timeout=120, total_timeout=400)
    book = read_gradebook(tmp_path / "out")
    assert len(book) == len(rows) == 2 * sum(len(exercises(c)) for c in GRADED)
    for r in book:
        if r["learner"] == "ada":
            assert r["status"] == "pass" and float(r["points"]) == float(r["max_points"]), r
        else:
            assert r["status"] == "todo" and float(r["points"]) == 0, r
    feedback = (tmp_path / "out" / "feedback" / "bob.md").read_text()
    assert "not attempted" in feedback


@pytest.mark.timeout(900)
def test_hanging_and_broken_submissions_cost_only_their_points(tmp_path):
    # A chapter checked in the notebook process, so a short cell limit is fair to every cell but the endless
    # one (cells that cold-start ranks need minutes on a loaded machine; the rank path is graded above).
    chapter = LOCAL[0]
    first, *rest = exercises(chapter)
    sol = solutions(chapter)

    def hang_first(ex):
        return "while True:\n    pass\n" if ex is first else inspect.getsource(getattr(sol, ex.function))

    def broken_first(ex):
        return "def oops(:\n" if ex is first else inspect.getsource(getattr(sol, ex.function))

    subs = tmp_path / "subs"
    write(with_answers(chapter, hang_first), subs, "hangs", chapter)
    write(with_answers(chapter, broken_first), subs, "typo", chapter)
    grade.grade_all(subs, tmp_path / "out", cell_timeout=30, total_timeout=300)
    book = {(r["learner"], r["exercise"]): r for r in read_gradebook(tmp_path / "out")}
    # The hanging cell stops that notebook: its checks did not run and say why.
    assert float(book[("hangs", first.name)]["points"]) == 0
    assert "not graded" in book[("hangs", first.name)]["message"]
    # A syntax error costs that exercise only; the others still run and pass.
    assert book[("typo", first.name)]["status"] in ("todo", "fail")
    for ex in rest:
        assert book[("typo", ex.name)]["status"] == "pass", book[("typo", ex.name)]
