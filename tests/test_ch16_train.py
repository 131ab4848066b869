"""The course's GPT with an MoE FFN in every block, trained on expert-parallel ranks (issue 17, "measured"): the same
trajectory as one process, and what the load-balancing loss does to the load.

Both are chaotic quantities (float32 AdamW training), so every bound comes from
``python -m course_utils.cpu_spread ch16_moe_train --seeds 0-3`` (native AVX-512, AVX2, plain kernels):
- EP 2 and EP 2 x DP 2 against one process, largest loss difference over 30 steps: 2.4e-7 to 6.0e-7 measured; bound
  1e-4 (an unreduced router or doubled expert gradients move the loss by far more within a few steps);
- the busiest expert's load over an even share, mean of the last 50 of 150 steps (worst layer): with the aux loss
  (0.01) 1.48-1.69, without 1.95-2.64: the bound 1.8 (``ch16.BALANCE_BOUND``) sits between them (margins 6% and 8%);
- the share of choices a capacity factor of 1 would drop: 12.8-22.0% of the choices lower with the aux loss; bound 5%
  (``ch16.FEWER_DROPS_PERCENT``);
- both runs learn: last-20 loss 1.35-1.49 against the bound 2.0 (log 32 = 3.47 at the start).
(12 runs: native, avx2, default kernels x seeds 0-3, 2026-12-04, re-measured when the MoE layers moved into the
course's one GPT, whose [s, b, h] layout routes the tokens in another order: before, 1.48-1.63 with the aux loss.)
"""
import statistics

import pytest

import course_utils as cu
from course_utils import ch16
from course_utils.results import InvalidParameter
from tests.numeric import worst

pytestmark = pytest.mark.ranks
TRAIN = "workers.ch16_moe_train"


def test_moe_gpt_on_ranks_follows_one_process():
    one = cu.run(TRAIN, 1, timeout=300, steps=30)[0]
    for world, ep in ((2, 2), (4, 2)):
        res = cu.run(TRAIN, world, timeout=300, ep=ep, steps=30)
        assert all(r["loss"] == res[0]["loss"] for r in res.ranks)  # every rank reports the all-reduced values
        assert worst(abs(a - b) for a, b in zip(one["loss"], res[0]["loss"])) <= 1e-4
        # counts are exact integers; at step 0 every copy of the model routes the same batch with the same weights
        assert res[0]["counts"][0] == one["counts"][0]
        assert sum(res[0]["counts"][0][0]) == 16 * 32 * 2  # every token of the batch, two choices each


def test_aux_loss_balances_the_experts():
    runs = {"aux": ch16.train(0.01), "none": ch16.train(0.0)}
    summary = {s["run"]: s for s in ch16.training_summary(runs)}
    assert summary["aux"]["max load (last 50)"] < ch16.BALANCE_BOUND < summary["none"]["max load (last 50)"]
    assert summary["none"]["% dropped at capacity 1.0"] - summary["aux"]["% dropped at capacity 1.0"] > \
        ch16.FEWER_DROPS_PERCENT  # 5 % of the choices
    assert worst(s["loss (last 20)"] for s in summary.values()) < 2.0
    r = runs["none"][0]
    assert r["dropped"] == [[0.0, 0.0]] * len(r["loss"])  # dropless: nothing dropped, only "would be"
    assert all(len(c) == 2 and all(sum(layer) == 16 * 32 * 2 for layer in c) for c in r["counts"])
    # what would be dropped falls as capacity grows (exact: the same routing cut at larger capacities)
    for step in r["would_drop"]:
        for layer in step:
            assert layer == sorted(layer, reverse=True)
    assert statistics.fmean(max(d[-1] for d in step) for step in r["would_drop"]) < \
        statistics.fmean(max(d[0] for d in step) for step in r["would_drop"])


@pytest.mark.once  # what is refused does not depend on a CPU's kernels
def test_the_training_worker_refuses_before_launch():
    with pytest.raises(InvalidParameter, match="ep=4 does not divide experts=6"):
        cu.run(TRAIN, 4, timeout=60, experts=6)
    with pytest.raises(InvalidParameter, match="global_batch=6 does not split evenly over world_size=4"):
        cu.run(TRAIN, 4, timeout=60, global_batch=6)
