"""Chapter 03's experiments on real ranks: gradcheck through the collectives, the scaling trap, row parallel.

Each assertion is a claim the notebook makes; each would fail if the property it names were missing
(a wrong backward passing gradcheck, a trap that does not scale with n, a row-parallel layer whose
gradients need a collective the derivation says they do not).
"""
import pytest
import torch

import course_utils as cu
from course_utils import ch03
from workers.parallel.circuits import CIRCUITS, VARIANTS
from workers.parallel.problems import row_parallel_problem as row_problem
from workers.parallel.problems import scaling_trap_problem as trap_problem

pytestmark = pytest.mark.ranks

# which circuits use the mapping each wrong variant replaces
USES = {
    "f_backward_identity": ("f -> ",),
    "g_backward_all_reduce": ("f -> ",),
    "gather_backward_sums": ("scatter -> ",),
    "scatter_wrong_chunk": ("scatter -> ",),
}


@pytest.mark.parametrize("world_size", [2, 4])
def test_gradcheck_passes_through_every_correct_mapping(world_size):
    res = cu.run("workers.ch03_gradcheck", world_size=world_size, timeout=120)
    for rank, verdicts in enumerate(res.gather("gradcheck")):
        assert list(verdicts) == list(CIRCUITS)
        for circuit, v in verdicts.items():
            assert v["passed"], (rank, circuit, v["message"])
            assert v["grad_ratio"] == pytest.approx(1.0, abs=1e-6), (rank, circuit)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "correct"])
def test_gradcheck_fails_exactly_where_a_wrong_mapping_is_used(variant):
    # world 4 as two groups of 2, each running its own gradcheck: the ratios are for n = 2
    res = cu.run("workers.ch03_gradcheck", world_size=4, tp=2, variant=variant, timeout=120)
    assert res.gather("group_ranks") == [[0, 1], [0, 1], [2, 3], [2, 3]]
    for verdicts in res.gather("gradcheck"):
        for circuit, v in verdicts.items():
            uses = circuit.startswith(USES[variant])
            assert v["passed"] != uses, (variant, circuit, v)
            if variant in ("g_backward_all_reduce", "gather_backward_sums") and uses:
                assert v["grad_ratio"] == pytest.approx(2.0, rel=1e-6)  # summed over n = 2 ranks once too often


def test_the_scaling_trap_grows_with_n_and_g_does_not():
    runs = {tp: cu.run("workers.ch03_scaling_trap", world_size=4, tp=tp, timeout=60) for tp in (1, 2, 4)}
    x, w = trap_problem(0, 4, 8, 4)
    rows = ch03.scaling_rows(runs, x, w)
    assert {r["backward"] for r in rows} >= {"megatron_g", "all_reduce_backward"}
    for r in rows:
        assert r["loss_equal"], r  # the forward is the same whatever the backward: only gradients differ
        if r["backward"] == "megatron_g":
            assert r["weight_matches"] and r["grad_weight_ratio"] == pytest.approx(1.0, rel=1e-12), r
            assert r["grad_input_ratio"] == pytest.approx(1.0, rel=1e-12), r
        else:  # the all-reduce in backward sums n identical gradients
            assert r["weight_matches_n_times"], r
            assert r["grad_weight_ratio"] == pytest.approx(r["n"], rel=1e-12), r
            assert r["grad_input_ratio"] == pytest.approx(r["n"], rel=1e-12), r


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("mode,input_is_parallel", [("row", False), ("row", True), ("mlp", False)])
def test_row_parallel_equals_the_single_process_layer(world_size, mode, input_is_parallel):
    res = cu.run("workers.ch03_row_parallel", world_size=world_size, mode=mode, input_is_parallel=input_is_parallel,
                 timeout=60)
    rows = ch03.row_parallel_rows(res, row_problem(mode, 0, 4, 8, 6, 16), mode, input_is_parallel)
    assert all(r["within_1e-12"] for r in rows), rows
    assert len(rows) == (5 if mode == "row" else 6)  # output, every gradient, and replication of the output
    comm = ch03.count_collectives(res[0]["communication"])
    # forward: exactly one all-reduce (g). backward: nothing for the row-parallel part itself; an all-gather
    # only when the input was replicated (scatter's backward); one all-reduce for f's backward in the MLP.
    assert comm["forward"] == ["all_reduce (reduce_from (g))"]
    want_backward = {("row", True): [], ("row", False): ["all_gather (scatter_to (last dim))"],
                     ("mlp", False): ["all_reduce (copy_to (f))"]}[(mode, input_is_parallel)]
    assert comm["backward"] == want_backward


def test_row_parallel_weight_gradients_are_complete_on_each_rank_without_communication():
    # The derivation's claim, measured: dW_r = X_r^T dY uses only rank-local tensors, so each rank's
    # gradient is already the corresponding block of the single-process dW, with no collective in backward.
    res = cu.run("workers.ch03_row_parallel", world_size=2, mode="row", input_is_parallel=True, timeout=60)
    p = row_problem("row", 0, 4, 8, 6, 16)
    dw = (p["x"].T @ p["grad_output"])  # [h, o], single process
    for rank in range(2):
        lo, hi = res[rank]["block"]
        assert torch.allclose(res[rank]["grad_weight"], dw[lo:hi], atol=1e-12, rtol=1e-12)
    assert [e for e in res[0]["communication"] if e["pass"] == "backward"] == []


def test_invalid_parameters_are_refused_before_launch():
    with pytest.raises(cu.InvalidParameter, match="variant='nope' is not one of 'correct'"):
        cu.run("workers.ch03_gradcheck", world_size=2, variant="nope")
    with pytest.raises(cu.InvalidParameter, match="rows=6 must be a positive multiple of tp=4"):
        cu.run("workers.ch03_gradcheck", world_size=4, rows=6)
    with pytest.raises(cu.InvalidParameter, match="tp=4 does not divide hidden=6: choose 1, 2, 3 or 6"):
        cu.run("workers.ch03_row_parallel", world_size=4, mode="row", hidden=6)
    with pytest.raises(cu.InvalidParameter, match="tp=4 does not divide hidden=6"):
        cu.run("workers.ch03_scaling_trap", world_size=4, hidden=6)
    with pytest.raises(cu.InvalidParameter, match="tp=3 does not divide the 4 ranks: choose 1, 2 or 4"):
        cu.run("workers.ch03_scaling_trap", world_size=4, tp=3)
