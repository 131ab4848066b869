"""ZeRO-3 by hand (issue 16; FSDP's algorithm) on real ranks: equal to one process, the ZeRO paper's bytes kept and
sent, and memory over one step with and without prefetch and reshard_after_forward.

Ground truth: ``workers/zero/model.train_reference``, the same tied GPT, data and AdamW in one process. The ranks
add the gradient's rows in another order (each rank its B/n rows, then a reduce-scatter of gradients pre-scaled by
1/n), as ZeRO-2 does, so the bound is chapter 11's ``ADAM_TOL`` = 2e-4 (``test_zero1.py``). Measured for ZeRO-3
over seeds 0-2 at world 2 and 4 (and the uneven model at 4), prefetch and resharding on and off: at most 3.5e-5
(native AVX-512), 2.1e-5 (AVX2), 2.6e-5 (plain kernels); a shard stepped wrong, or a unit gathered stale, moves
weights by ~lr = 1e-2.

Every byte count here is exact: the units, their padding and the order of the hooks are fixed by the model.
"""
import pytest

import course_utils as cu
from course_utils.ledger import model_state_bytes
from course_utils.planner import zero_collectives_per_step
from course_utils.results import InvalidParameter
from tests.test_zero1 import ADAM_TOL
from tests.numeric import worst

WORKER = "workers.ch11_zero3"
UNEVEN = {"vocab": 61, "hidden": 21, "heads": 3}  # 12h^2 + 10h and (V + s) h + 2h not multiples of 4: padding
pytestmark = pytest.mark.ranks


def _check_state(r, world, rank):
    padded = sum(u["shard_size"] * world for u in r["units"])
    assert sum(u["numel"] for u in r["units"]) == r["n_params"]
    assert padded - r["n_params"] < world * len(r["units"])
    # kept between steps: 1/n of the parameters, of the gradient and of AdamW's two moments (fp32) and nothing
    # whole: the ledger's stage 3 (ZeRO paper, sec 5.3) exactly, plus this rank's share of the padding
    ledger = model_state_bytes(r["n_params"], dp=world, zero_stage=3, weight_bytes=4, grad_bytes=4,
                               optimizer_bytes_per_param=8)
    pad = (padded - r["n_params"]) / world
    assert r["shard_bytes"] == pytest.approx(ledger.params + 4 * pad)
    assert r["grad_shard_bytes"] == pytest.approx(ledger.grads + 4 * pad)
    # AdamW steps each parameter's sharded view, so it keeps moments for this rank's real elements only, not for
    # the padding (as FSDP2): over the ranks, the ledger's optimizer bytes exactly
    owned = sum(min(u["shard_size"], max(0, u["numel"] - rank * u["shard_size"])) for u in r["units"])
    assert r["state_bytes"] == 8 * owned
    assert r["params_after_step"] == 0
    return padded


@pytest.mark.parametrize("world, model", [(1, {}), (2, {}), (4, {}), (4, UNEVEN)], ids=["1", "2", "4", "4-uneven"])
def test_zero3_equals_one_process_and_keeps_one_nth_of_everything(world, model):
    res = cu.run(WORKER, world, timeout=180, **model)
    for rank, r in enumerate(res.ranks):
        assert r["max_abs_error"][0] == 0.0, "ranks started from their own seeds: the broadcast must equalise them"
        assert worst(r["max_abs_error"]) <= ADAM_TOL, (rank, r["max_abs_error"])
        assert r["equal_to_rank0"]
        padded = _check_state(r, world, rank)
        if model:
            assert padded > r["n_params"]  # the uneven model is padded, and the bytes above still hold
    assert sum(r["state_bytes"] for r in res.ranks) == 8 * res[0]["n_params"]  # no moments for the padding


@pytest.mark.parametrize("prefetch, reshard", [(False, True), (True, True), (False, False), (True, False)])
def test_zero3_sends_three_psi_or_two_without_resharding(prefetch, reshard):
    world = 4
    res = cu.run(WORKER, world, timeout=180, prefetch=prefetch, reshard_after_forward=reshard)
    for r in res.ranks:
        assert worst(r["max_abs_error"]) <= ADAM_TOL  # prefetch and resharding change when, never what
        units, steps, padded = len(r["units"]), r["steps"], 4 * sum(u["shard_size"] * world for u in r["units"])
        # a call per unit: all-gathers for forward and again for backward, one reduce-scatter; the planner's counts
        planned = zero_collectives_per_step(3)
        gathers = planned["all_gather"] if reshard else 1
        assert r["calls"] == {"all_gather": gathers * units * steps, "reduce_scatter": planned["reduce_scatter"]
                              * units * steps}
        # 3 Psi (n-1)/n per step (ZeRO sec 7.2.2), Psi the padded model; 2 Psi (n-1)/n kept whole from forward on
        sent = r["comm_bytes"]["all_gather"] + r["comm_bytes"]["reduce_scatter"]
        assert sent == pytest.approx(steps * (3 if reshard else 2) * (world - 1) / world * padded, rel=1e-12)


def test_memory_over_a_step_follows_the_units_and_the_switches():
    layers, world = 4, 2
    runs = {(pf, rs): cu.run(WORKER, world, timeout=180, layers=layers, steps=1, prefetch=pf,
                             reshard_after_forward=rs).ranks[0] for pf in (False, True) for rs in (True, False)}
    r = runs[False, True]
    size = {u["name"]: u["bytes"] for u in r["units"]}
    root, block = size["root"], size["unit0"]
    whole = sum(size.values())
    assert len(set(size.values()) - {root}) == 1  # every block the same size
    # FSDP's default: the root plus one block whole at a time, in forward and in backward
    assert r["peak_params"] == root + block
    gathers = [e["unit"] for e in r["timeline"] if e["kind"] == "gather"]
    blocks = [f"unit{k}" for k in range(layers)]
    assert gathers == ["root"] + blocks + ["root"] + blocks[::-1]  # forward in order, backward in reverse
    frees = [e["unit"] for e in r["timeline"] if e["kind"] == "free"]
    assert frees == blocks + ["root"] + blocks[::-1] + ["root"]  # after each forward, and after each reduce-scatter
    # prefetch: the next block travels while this one computes, so two blocks are whole at the peak
    assert runs[True, True]["peak_params"] == root + 2 * block
    # every block is prefetched once each way (forward: by the unit before it; backward: by the one after)
    assert sum(e["kind"] == "prefetch" for e in runs[True, True]["timeline"]) == 2 * layers
    # without resharding after forward every unit is whole when forward ends: ZeRO-2's parameters, for a while
    for pf in (False, True):
        keep = runs[pf, False]
        assert keep["peak_params"] == whole
        assert [e["unit"] for e in keep["timeline"] if e["kind"] == "free"] == blocks[::-1] + ["root"]
    # whole gradients: a unit's .grad is dropped when it is reduce-scattered, so never the whole model's at once
    for run in runs.values():
        assert run["peak_grads"] < whole
        assert run["params_after_step"] == 0


def test_bad_settings_are_refused_before_launch():
    with pytest.raises(InvalidParameter, match="global_batch=6 does not split evenly over world_size=4"):
        cu.run(WORKER, 4, global_batch=6)
    with pytest.raises(InvalidParameter, match="heads=4 does not divide hidden=30"):
        cu.run(WORKER, 2, hidden=30)
