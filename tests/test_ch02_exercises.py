"""Chapter 02's exercises, graded on real ranks: the solutions pass, the notebook's stubs score zero as
"not attempted", and every plausible wrong answer fails with a message that names the mistake.
(``tests/test_exercises.py`` does the same for every chapter; this file runs chapter 02 alone.)"""
import pytest

from course_utils.exercises import FAIL, PASS, TODO, check, exercises
from tests.exercise_sources import solutions, stubs
from tests.wrong_answers.ch02 import WRONG

pytestmark = pytest.mark.ranks
MINE = exercises("02")


def test_chapter_has_the_three_exercises():
    assert {e.name for e in MINE} == {"ddp_by_hand", "bucketed_average", "shard_indices"}
    assert {name for name, _, _ in WRONG} == {e.name for e in MINE}


@pytest.mark.parametrize("ex", MINE, ids=lambda e: e.name)
def test_solution_passes_at_world_2_and_4(ex):
    verdict = check(ex.name, getattr(solutions("02"), ex.function))
    assert verdict.status == PASS, verdict.message
    assert "2, 4" in verdict.message


@pytest.mark.parametrize("ex", MINE, ids=lambda e: e.name)
def test_stub_scores_zero(ex):
    verdict = check(ex.name, stubs("02")[ex.function])
    assert verdict.status == TODO and verdict.points == 0, verdict


@pytest.mark.parametrize("name, fn, fragment", WRONG, ids=[fn.__name__ for _, fn, _ in WRONG])
def test_wrong_answer_is_caught(name, fn, fragment):
    verdict = check(name, fn)
    assert verdict.status == FAIL, verdict
    assert fragment in verdict.message, verdict.message
