"""ZeRO stages 0-3 by hand, side by side (issue 16): at the four moments of a step every rank holds exactly the
ledger's bytes for its stage, and sends exactly the ZeRO paper's 2 Psi (n-1)/n (stages 0-2) or 3 Psi (n-1)/n
(stage 3), caught from the collectives torch dispatched, not from the stages' own bookkeeping.

"Exactly": ``course_utils.ch11.stage_expected`` evaluates ``ledger.model_state_bytes`` at the padded count Psi' the
flat buffers hold (every buffer rounded up to N equal shards); the difference from the formula at Psi is that
padding and nothing else (``padded_numel - n_params`` below is a few elements per buffer). Weights against the
single-process reference within chapter 11's ``ADAM_TOL`` (``test_zero1.py``; measured for stages 2 and 3 in
``test_zero2.py`` and ``test_zero3.py``).
"""
import pytest

import course_utils as cu
from course_utils import ch11
from course_utils.planner import zero_collectives_per_step
from course_utils.results import InvalidParameter
from tests.test_zero1 import ADAM_TOL
from tests.test_zero3 import UNEVEN
from tests.numeric import worst

WORKER = "workers.ch11_stages"
pytestmark = pytest.mark.ranks


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_stage_holds_the_ledgers_bytes_at_the_four_moments_and_sends_the_papers(stage, world):
    res = cu.run(WORKER, world, stage=stage, timeout=180)
    for r in res.ranks:
        assert worst(r["max_abs_error"]) <= ADAM_TOL
        assert r["n_params"] <= r["padded_numel"] < r["n_params"] + world * 16  # a few elements per buffer
        if stage == 0:
            assert r["padded_numel"] == r["n_params"]  # nothing is sharded, nothing padded
        assert [(m["step"], m["moment"]) for m in r["moments"]] == \
            [(0, "init")] + [(s, m) for s in (1, 2) for m in ("forward", "backward", "step")]
        for m in r["moments"]:
            assert {k: m[k] for k in ("params", "grads", "optimizer")} == ch11.stage_expected(r, m["step"],
                                                                                              m["moment"]), m
        # one step's traffic, from the dispatched collectives: the paper's passes over Psi', (n-1)/n of each
        sent = sum(c["wire_bytes"] for c in r["comm"].values())
        assert sent == pytest.approx(ch11.stage_wire_bytes(r), rel=1e-12)
        planned = zero_collectives_per_step(stage)
        calls = {k: r["comm"].get(k, {"calls": 0})["calls"] for k in planned}
        if stage == 0:
            assert calls == planned  # one all-reduce of the flat gradient
        else:  # per bucket (stage 2), per unit (stage 3) or per buffer (stage 1): the planner's ratio of calls
            assert calls["all_reduce"] == 0
            assert calls["all_gather"] * planned["reduce_scatter"] == calls["reduce_scatter"] * planned["all_gather"]


def test_stage_three_without_resharding_sends_two_psi_and_the_uneven_model_is_padded_exactly():
    r = cu.run(WORKER, 4, stage=3, reshard_after_forward=False, timeout=180)[0]
    assert sum(c["wire_bytes"] for c in r["comm"].values()) == pytest.approx(2 * 3 / 4 * 4 * r["padded_numel"])
    for stage in (1, 2, 3):
        r = cu.run(WORKER, 4, stage=stage, timeout=180, **UNEVEN)[0]
        assert r["padded_numel"] > r["n_params"]
        assert all({k: m[k] for k in ("params", "grads", "optimizer")} == ch11.stage_expected(r, m["step"], m["moment"])
                   for m in r["moments"])
        assert worst(r["max_abs_error"]) <= ADAM_TOL


def test_a_stage_that_is_not_one_is_refused_before_launch():
    with pytest.raises(InvalidParameter, match=r"stage=4 is not one of 0, 1, 2 or 3 \(ZeRO's stages"):
        cu.run(WORKER, 2, stage=4)
