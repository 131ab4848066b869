"""The batch grader, end to end: real notebooks executed headless, real ranks, a real gradebook.

Solutions must score full marks, shipped stubs zero (without the grader failing), and a submission that
hangs or does not even parse must cost only its own points: the grader survives and grades the rest.
"""
import csv
import inspect
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from course_utils import grade
from course_utils.exercises import exercises
from tests.exercise_sources import solutions, wrong_answers
from course_utils.paths import ROOT

pytestmark = [pytest.mark.ranks, pytest.mark.once]  # the batch pipeline: the same on every CPU
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
    # The hanging cell stops that notebook: its checks did not run and say why (the answer's own cell, so it
    # is not graded again as a machine problem would be).
    assert float(book[("hangs", first.name)]["points"]) == 0
    assert "the check did not run: an exercise cell ran past the 30 s limit" in book[("hangs", first.name)]["message"]
    # A syntax error costs that exercise only; the others still run and pass.
    assert book[("typo", first.name)]["status"] in ("todo", "fail")
    for ex in rest:
        assert book[("typo", ex.name)]["status"] == "pass", book[("typo", ex.name)]


def _burn(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@pytest.mark.load
@pytest.mark.timeout(1800)
def test_parallel_graders_on_a_loaded_machine_give_the_gradebook_of_one_grader(tmp_path):
    """Grades must not depend on load. Two graders at once, with twice as many busy processes as cores, on a chapter
    checked on real ranks, with a cell limit of 10 s: starting ranks under that load takes longer than that, and it
    happens in the grader's own start-up cell, not in an answer's. The gradebooks equal one grader's alone.
    (Measured on 2 cores: with the start-up cell removed, this test fails: the full-marks answer scores 0 even
    after the grader's one regrade; with it, it passed every run, about 60 s each.)"""
    chapter = ON_RANKS[0]
    sol = solutions(chapter)
    wrong = {name: fn for name, fn, _ in wrong_answers(chapter)}
    first = exercises(chapter)[0]
    subs = tmp_path / "subs"
    write(with_answers(chapter, lambda ex: inspect.getsource(getattr(sol, ex.function))), subs, "ada", chapter)

    def one_wrong(ex):
        if ex is first:  # a plausible mistake, renamed to the function the notebook defines
            src = inspect.getsource(wrong[first.name])
            return src.replace(f"def {wrong[first.name].__name__}(", f"def {ex.function}(", 1)
        return inspect.getsource(getattr(sol, ex.function))

    write(with_answers(chapter, one_wrong), subs, "cy", chapter)

    def book(out):
        return sorted((r["learner"], r["exercise"], r["status"], r["points"]) for r in read_gradebook(out))

    grade.grade_all(subs, tmp_path / "alone", cell_timeout=120, total_timeout=900)
    alone = book(tmp_path / "alone")
    assert [(l, s) for l, _, s, _ in alone].count(("ada", "pass")) == len(exercises(chapter))
    assert ("cy", first.name, "fail", "0") in alone

    burners = [multiprocessing.Process(target=_burn, args=(900,), daemon=True) for _ in range(2 * (os.cpu_count() or 2))]
    for b in burners:
        b.start()
    try:
        graders = [subprocess.Popen([sys.executable, "-m", "course_utils.grade", str(subs), "--out", str(tmp_path / f"g{i}"),
                                     "--cell-timeout", "10", "--total-timeout", "1200"], cwd=ROOT,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                   for i in range(2)]
        outputs = [g.communicate(timeout=1500)[0] for g in graders]
    finally:
        for b in burners:
            b.kill()
    for i, out in enumerate(outputs):
        assert graders[i].returncode == 0, out
        assert book(tmp_path / f"g{i}") == alone, out


def test_ranks_that_never_start_are_retried_and_never_blamed_on_the_answer(monkeypatch):
    """A start-up failure (torchrun, import torch, rendezvous) happens before the answer runs: the check starts
    fresh ranks once more, and if they fail again the verdict says the answer was not graded."""
    from course_utils import exercises as ex_mod
    from course_utils import launcher
    from course_utils.results import WorkerFailed

    ex = next(e for e in exercises() if e.worker)
    calls = []

    def never_starts(worker, world_size, **kw):
        calls.append(world_size)
        raise WorkerFailed("ranks [1] did not start within 300 s; load average 9.0 on 2 cores", startup=True)

    monkeypatch.setattr(launcher, "run", never_starts)
    verdict = ex_mod.check(ex.name, lambda *a: None)
    assert len(calls) == 2 and verdict.points == 0
    assert verdict.message.startswith(f"{grade.NOT_GRADED}: the ranks for world size {ex.world_sizes[0]} did not start, twice")
    assert "says nothing about your answer" in verdict.message

    calls.clear()

    def starts_the_second_time(worker, world_size, **kw):
        calls.append(world_size)
        if len(calls) == 1:
            raise WorkerFailed("ranks [0] never connected", startup=True)
        raise WorkerFailed("rank 0 raised ValueError", rank=0, error_type="ValueError", rank_traceback="ValueError: x")

    monkeypatch.setattr(launcher, "run", starts_the_second_time)
    verdict = ex_mod.check(ex.name, lambda *a: None)
    assert calls == [ex.world_sizes[0]] * 2  # retried once, then the answer's own error is reported
    assert "rank 0 raised ValueError" in verdict.message
