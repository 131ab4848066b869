"""Chapter 04's exercise checker, beyond the generic grading test (tests/test_exercises.py).

The generic test stops at the first world size that fails (4). Here the answers that go wrong on *one
rank only* also run at world 2, on every rank: the checker must agree on the verdict before each step that
communicates (the backward, the parallel MLP's all-reduce), so every rank names the mistake. Before it
did, these answers left the other ranks waiting in an all-reduce until the run's timeout, and the learner
was told that their code hung.
"""
import pytest

import course_utils as cu
from tests.exercise_sources import define
from tests.wrong_answers.ch04 import row_bias_on_rank_zero, swiglu_up_off_by_one

pytestmark = pytest.mark.ranks
CHECKER = "workers.exercises.ch04"

# Contrived on purpose: right on every rank but the last, whose output leaves the graph, so only the other
# ranks would enter the backward (and f's all-reduce).
DETACHED_ON_LAST_RANK = define('''
def column_detached_on_last_rank(x, weight, bias, group):
    import torch.distributed as dist
    import torch.nn.functional as F

    from workers.parallel.mappings import copy_to_tensor_model_parallel_region

    y = F.linear(copy_to_tensor_model_parallel_region(x, group), weight, bias)
    return y.detach() if dist.get_rank(group) == dist.get_world_size(group) - 1 else y
''', "<test_ch04_exercises>")["column_detached_on_last_rank"]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("exercise,fn,fragment", [
    ("swiglu_shard", swiglu_up_off_by_one, "silently cut short"),
    ("column_parallel_forward", DETACHED_ON_LAST_RANK, "does not require grad"),
    ("row_parallel_forward", row_bias_on_rank_zero, "copy of the bias gets no gradient"),
], ids=["swiglu_up_off_by_one", "column_detached_on_last_rank", "row_bias_on_rank_zero"])
def test_a_mistake_on_one_rank_is_named_on_every_rank_not_a_hang(world_size, exercise, fn, fragment):
    # a JobTimeout here (the run's limit is well below the 40 s the hang took) is the bug this guards against
    res = cu.run(CHECKER, world_size=world_size, exercise=exercise, answer=fn, timeout=20)
    verdicts = res.gather("verdict")
    assert all(v["status"] == "fail" for v in verdicts), verdicts
    assert all(fragment in v["message"] for v in verdicts), verdicts
    wrong_rank = world_size - 1 if fn is not row_bias_on_rank_zero else 1
    # every rank's verdict says which rank saw it (the notebook's sentence names it: "at world size 4, rank 3: ...")
    assert all(v["rank"] == wrong_rank for v in verdicts), verdicts
