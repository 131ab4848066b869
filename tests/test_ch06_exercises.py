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


def block_with_hand_written_f_and_g(x, parts, group):
    # Right mathematics, but f and g written by hand: the check counts communication through the course's regions.
    import torch
    import torch.distributed as dist

    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.clone()
            dist.all_reduce(grad, group=group)
            return grad

    class G(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            t = t.clone()
            dist.all_reduce(t, group=group)
            return t

        @staticmethod
        def backward(ctx, grad):
            return grad

    h = x + G.apply(parts.attention_partial(F.apply(parts.ln1(x)))) + parts.attention_bias
    return h + G.apply(parts.mlp_partial(F.apply(parts.ln2(h)))) + parts.mlp_bias


def test_a_right_block_with_a_hand_written_f_and_g_is_told_to_use_the_regions():
    res = cu.run(CHECKER, world_size=2, exercise="block_forward", answer=block_with_hand_written_f_and_g, timeout=30)
    verdicts = res.gather("verdict")
    assert all(v["status"] == "fail" for v in verdicts), verdicts
    assert "no all-reduce went through the course's regions" in verdicts[0]["message"], verdicts[0]
