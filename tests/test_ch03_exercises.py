"""Chapter 03's exercise checker, beyond the generic grading test (tests/test_exercises.py).

The generic test stops at the first world size that fails (2). Here every wrong answer is also run at
world 4, where the checker's hints must still name the mistake with the right factor, and every rank
must report the same verdict (the checker shares verdicts between ranks, so a rank that finds a mistake
does not leave the others waiting in the next collective).
"""
import pytest

import course_utils as cu
from solutions import ch03 as solutions
from tests.wrong_answers.ch03 import WRONG

pytestmark = pytest.mark.ranks
CHECKER = "workers.exercises.ch03"


@pytest.mark.parametrize("exercise,fn,fragment", WRONG, ids=[w[1].__name__ for w in WRONG])
def test_wrong_answers_are_named_at_world_4_on_every_rank(exercise, fn, fragment):
    res = cu.run(CHECKER, world_size=4, exercise=exercise, answer=fn, timeout=60)
    verdicts = res.gather("verdict")
    assert all(v["status"] == "fail" for v in verdicts), verdicts
    assert all(fragment in v["message"] for v in verdicts), verdicts
    if fn.__name__ in ("g_backward_all_reduces", "gather_backward_all_reduces"):
        assert "4 times too large" in verdicts[0]["message"]  # the factor is the world size, measured


@pytest.mark.parametrize("exercise", ["f_and_g", "split_and_gather"])
def test_solutions_pass_on_a_single_rank_too(exercise):
    # a learner alone on a laptop still runs the whole check (groups of one rank, no communication)
    res = cu.run(CHECKER, world_size=1, exercise=exercise, answer=getattr(solutions, exercise), timeout=60)
    assert res[0]["verdict"]["status"] == "pass", res[0]["verdict"]
