"""Collective matmul (``workers/parallel/collective_matmul.py``) on real gloo ranks: the sequence-parallel MLP with its
all-gather and reduce-scatter cut into ring steps computes what the blocking collectives compute, and its timeline
shows chunks multiplying while a transfer is in flight.

Start here: every case runs ``workers/ch06_collective_matmul.py``, which gives, per mode (``blocking``, ``decomposed``,
``serialized``), each rank's part of the output, input gradient and every parameter gradient, and the timeline.

Tolerance, float64: the ranks start from the dense MLP's float32 weights and inputs, as the float64 reference does
(``D.reference``), so the only difference is the order of the sums (chunk by chunk, around the ring, against one matmul
and gloo's reduce-scatter). Measured: at most 2.7e-15 from the dense MLP and 1.8e-15 between decomposed and blocking, on
values of size ~10; ``FLOAT64_ATOL`` = 1e-12 leaves a margin of ~400, and an error of any collective misses by order 1.
No speed-up is asserted: on a 2-core machine the ranks' matmuls and gloo's copies share the cores (see the worker).
"""
import math
import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch

import course_utils as cu
from course_utils import tp_check
from course_utils.paths import ROOT
from workers.parallel.collective_matmul import (ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER, all_gather_matmul,
                                                matmul_reduce_scatter, overlapped)

pytestmark = pytest.mark.ranks
WORKER = "workers.ch06_collective_matmul"  # launched by name: a test never imports a torchrun script
MODES = ("blocking", "decomposed", "serialized")  # the worker's MODES
SEQ, BATCH, HIDDEN = 8, 2, 16
FLOAT64_ATOL = 1e-12
RINGS = [(op, pass_) for op in (ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER) for pass_ in ("forward", "backward")]
CASES = {"world2": (2, {}), "world4": (4, {}), "world4_tp2": (4, {"tp": 2}), "swiglu": (2, {"activation": "swiglu"})}
_runs: dict = {}


def run(case: str):
    """One run per case for the whole file: the timeline tests read the same runs as the equality tests."""
    if case not in _runs:
        world, params = CASES[case]
        _runs[case] = cu.run(WORKER, world_size=world, seq=SEQ, batch=BATCH, hidden=HIDDEN, timeout=120, **params)
    return _runs[case]


def mode_records(res, mode):
    return [{**r[mode], "tp_group_ranks": r["tp_group_ranks"]} for r in res.ranks]


def tensors(record) -> dict:
    return {"output": record["output"]["value"], "grad_input": record["grad_input"]["value"],
            **{f"grads.{name}": g["value"] for name, g in record["grads"].items()}}


def test_the_hand_written_backwards_pass_gradcheck_on_one_rank():
    # No process group: a ring of one, so each function is its matmul and its backward the hand-written formulas
    # (the per-block weight gradient, the input gradient block by block), checked against finite differences.
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
               for shape in ((4, 2, 3), (5, 3), (5,)))
    assert torch.autograd.gradcheck(lambda x, w, b: all_gather_matmul(x, w, b), (x, w, b))
    assert torch.autograd.gradcheck(lambda x, w: matmul_reduce_scatter(x, w), (x, w))
    assert torch.equal(all_gather_matmul(x, w, b), torch.nn.functional.linear(x, w, b))


@pytest.mark.parametrize("case", list(CASES))
def test_every_mode_equals_the_dense_mlp_in_float64(case):
    res = run(case)
    cfg = tp_check.config_of(res[0]["config"])
    for mode in MODES:
        report = tp_check.compare(mode_records(res, mode), "mlp", cfg, seq=SEQ, batch=BATCH)
        # output, input gradient and all four parameter gradients, rebuilt from every rank's shard
        assert set(report.errors) == {"output", "grad_input", "grads.fc1.weight", "grads.fc1.bias",
                                      "grads.fc2.weight", "grads.fc2.bias"}, (mode, report)
        assert report.ok and not report.problems, (mode, report)
        worst = max(report.errors.values())
        assert worst <= FLOAT64_ATOL, (mode, report.errors)  # NaN fails this too


@pytest.mark.parametrize("case", list(CASES))
def test_decomposed_equals_blocking_on_every_rank(case):
    # Rank by rank, tensor by tensor: the rings compute the blocking collectives' result, to float64 rounding.
    res = run(case)
    for rank, r in enumerate(res.ranks):
        blocking = tensors(r["blocking"])
        for mode in ("decomposed", "serialized"):
            got = tensors(r[mode])
            assert got.keys() == blocking.keys()
            for name, want in blocking.items():
                assert got[name].dtype == torch.float64 and got[name].shape == want.shape, (rank, mode, name)
                err = (got[name] - want).abs().max().item()
                assert err <= FLOAT64_ATOL, (rank, mode, name, err)
                assert want.abs().max() > 0, (rank, name)  # a gradient that is all zero would prove nothing


@pytest.mark.parametrize("case", ["world2", "world4", "world4_tp2"])
def test_each_ring_visits_every_block_and_moves_the_collectives_bytes(case):
    # tp steps per ring, each multiplying one block; tp - 1 transfers of one [s/tp, b, h] block each, which is what a
    # ring all-gather or reduce-scatter of the [s, b, h] activation sends per rank.
    res = run(case)
    for rank, r in enumerate(res.ranks):
        tp, me = r["tp"], r["tp_group_ranks"].index(rank)
        block_bytes = SEQ // tp * BATCH * HIDDEN * 8
        for op, pass_ in RINGS:
            events = [e for e in r["decomposed"]["timeline"] if e["op"] == op and e["pass"] == pass_]
            chunks = [e["chunk"] for e in events if e["kind"] == "compute"]
            waits = [e for e in events if e["kind"] == "wait"]
            assert sorted(chunks) == list(range(tp)), (op, pass_, chunks)
            assert len(waits) == tp - 1 and all(w["bytes"] == block_bytes for w in waits), (op, pass_, waits)
            gathers = (op, pass_) in ((ALL_GATHER_MATMUL, "forward"), (MATMUL_REDUCE_SCATTER, "backward"))
            # an all-gather ring starts on the rank's own block; a reduce-scatter ring ends on the block it keeps
            assert chunks[0 if gathers else -1] == me, (op, pass_, chunks, me)


@pytest.mark.parametrize("case", ["world2", "world4"])
def test_the_timeline_shows_chunks_computed_while_a_receive_is_outstanding(case):
    # Structural, not a speed-up: in each ring every step but the last multiplies a block between posting the next
    # transfer and waiting for it. The serialized ring (the same decomposition, each transfer waited for at once) and
    # the blocking collectives have none: the check can tell them apart.
    res = run(case)
    for r in res.ranks:
        tp = r["tp"]
        found = overlapped(r["decomposed"]["timeline"])
        for op, pass_ in RINGS:
            assert sum(e["op"] == op and e["pass"] == pass_ for e in found) == tp - 1, (op, pass_, found)
        assert overlapped(r["serialized"]["timeline"]) == []
        assert overlapped(r["blocking"]["timeline"]) == []
        # the blocking collectives are on the timeline too: one wait each, forward and backward
        waits = [(e["op"], e["pass"]) for e in r["blocking"]["timeline"] if e["kind"] == "wait"]
        assert sorted(waits) == sorted(RINGS), waits
        for events in (r[mode]["timeline"] for mode in MODES):
            assert all(0 <= e["start"] <= e["end"] for e in events)


def test_timing_reports_cpu_wall_time_per_mode_without_asserting_a_speed_up():
    # float32 and a few timed steps: the worker's timing protocol. The numbers vary with the load on the shared cores.
    repeats = 2
    res = cu.run(WORKER, world_size=2, seq=16, batch=2, hidden=32, dtype="float32", repeats=repeats, timeout=120)
    for r in res.ranks:
        assert set(r["step_seconds"]) == set(MODES)
        assert all(len(s) == repeats and all(math.isfinite(t) and t > 0 for t in s) for s in r["step_seconds"].values())
        assert r["timing_device"].startswith("CPU wall time, gloo, 2 ranks")
        assert r["provenance"]["device_kind"] == "cpu"
        assert len(overlapped(r["timed_timelines"]["decomposed"])) == 4  # one per ring at tp 2
        got, want = r["decomposed"]["output"]["value"], r["blocking"]["output"]["value"]
        assert got.dtype == torch.float32 and torch.allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("params,message", [
    ({"seq": 10}, "tp=4 does not divide seq=10: choose 1, 2, 5 or 10 (sequence parallelism gives each rank seq/tp rows)"),
    ({"seq": 6, "tp": 4}, "tp=4 does not divide seq=6: choose 1, 2, 3 or 6"),
    ({"tp": 3}, "tp=3 does not divide the 4 ranks: choose 1, 2 or 4"),
    ({"ffn": 18}, "tp=4 does not divide ffn=18: choose 1, 2, 3, 6, 9 or 18"),
    ({"dtype": "float16", "repeats": -1}, "dtype='float16' is not one of 'float32' or 'float64'; repeats=-1 must be at "
                                          "least 0"),
])
def test_unequal_shards_and_bad_parameters_are_refused_before_launching(params, message):
    # Unequal sequence shards would give the ring blocks of different shapes: refused in one sentence by the worker's
    # check_params, which the launcher runs before any rank starts.
    with pytest.raises(cu.InvalidParameter, match=re.escape(message)):
        cu.run(WORKER, world_size=4, **params)


@pytest.mark.once
def test_the_worker_runs_under_plain_torchrun():
    # The learner's command line, unchanged: two ranks, the defaults, results printed per rank.
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), TMPDIR=tmp)
        env.pop("COURSE_RESULTS_ADDR", None)
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                              str(ROOT / "workers" / "ch06_collective_matmul.py"), "--tp", "2"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    for rank in (0, 1):
        assert f"[rank {rank}] tp_group_ranks = [0, 1]" in out.stdout
        assert f"[rank {rank}] decomposed = " in out.stdout
