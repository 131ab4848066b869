"""Chapter 06's exercises on real ranks: solutions pass, wrong answers are caught with their message."""
import pytest

from course_utils.exercises import FAIL, PASS, check, exercises
from tests.exercise_sources import solutions, wrong_answers

pytestmark = pytest.mark.ranks
CHAPTER = "06"


@pytest.mark.parametrize("ex", exercises(CHAPTER), ids=lambda e: e.name)
def test_solution_passes(ex):
    verdict = check(ex.name, getattr(solutions(CHAPTER), ex.function))
    assert verdict.status == PASS, verdict.message


@pytest.mark.parametrize("name,fn,fragment", wrong_answers(CHAPTER), ids=lambda v: getattr(v, "__name__", str(v)))
def test_wrong_answer_is_caught(name, fn, fragment):
    verdict = check(name, fn)
    assert verdict.status == FAIL and fragment in verdict.message, verdict.message
