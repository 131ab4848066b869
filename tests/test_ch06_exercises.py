"""Chapter 06's exercise checker, beyond the generic grading test (tests/test_exercises.py).

Answers that go wrong on one rank only, at world 2 and 4, on every rank: the ranks agree on the forward's
verdict before the backward (whose f all-reduces need all of them), so a rank with a detached output is
named, and never leaves the others waiting in the backward until the timeout.
"""
import pytest

import course_utils as cu
from tests.wrong_answers.ch06 import block_biases_on_rank_zero, block_detached_off_rank_zero

pytestmark = pytest.mark.ranks
CHECKER = "workers.exercises.ch06"


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("fn,fragment", [(block_detached_off_rank_zero, "not requiring grad"),
                                         (block_biases_on_rank_zero, "each copy must get the full gradient")],
                         ids=["block_detached_off_rank_zero", "block_biases_on_rank_zero"])
def test_a_mistake_on_some_ranks_is_named_on_every_rank_not_a_hang(world_size, fn, fragment):
    res = cu.run(CHECKER, world_size=world_size, exercise="block_forward", answer=fn, timeout=30)
    verdicts = res.gather("verdict")
    assert all(v["status"] == "fail" for v in verdicts), verdicts
    assert all(fragment in v["message"] for v in verdicts), verdicts
    assert "rank 1" in verdicts[0]["message"], verdicts[0]  # rank 0 is right; it says where the mistake was seen
