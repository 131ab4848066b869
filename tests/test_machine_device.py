"""This machine as a device of the planner (``course_utils/machine_device.py``): the device built from a calibration,
the predictions' construction, the op counts, the comparison's shape.

Nothing here asserts how fast anything is or how close a prediction comes: the machine is shared and its timings
vary. The fast tests price a stored synthetic calibration (no ranks); one test calibrates and measures one run on
real ranks and checks only that the comparison is well formed.
"""
from __future__ import annotations

import json
import math

import pytest

from course_utils import calibration as cal_mod
from course_utils import machine_device as md
from course_utils.calibration import MachineCalibration, default_runs, run_row
from course_utils.step_time import _table, pipeline_makespan

MATMUL = [[d, m, n, k, f * (1.0 if d == "float32" else 0.5)] for d in ("float32", "float64")
          for m, n, k, f in ((4, 16, 16, 1.2e9), (8, 32, 32, 8e9), (64, 64, 64, 6e10), (256, 256, 256, 1e11))]
COLLECTIVES = [[name, w, alpha * w / 2, beta] for w in (2, 4)
               for name, alpha, beta in (("all_reduce", 4e-4, 5e-10), ("all_gather", 3e-4, 7e-10),
                                         ("reduce_scatter", 3.5e-4, 1e-9), ("p2p", 6e-5, 8e-10))]
SYNTHETIC = {
    "format": cal_mod.FORMAT, "cpu": "synthetic", "capability": "DEFAULT", "cores": 2, "threads_per_rank": 1,
    "world_sizes": [2, 4], "torch_version": "0", "op_s": 1.2e-6, "op_forward_s": 2e-6, "op_forward_backward_s": 8e-6,
    "backward_call_s": 2e-5, "linear_forward_backward_s": 6e-5, "matmul": MATMUL, "stream_bandwidth": 3e10,
    "contention": [[kind, k, float(k)] for kind in ("matmul", "op", "stream") for k in (1, 2)],
    "collectives": COLLECTIVES, "fit_error": [[n, w, 0.1] for n, w, _, _ in COLLECTIVES],
    "p2p": [6e-5 * 2, 8e-10], "measured_at": "2025-01-01T00:00:00+00:00", "seconds": 1.0, "params": {},
    "raw": {"4": {"collectives": {"p2p": [[8, 6e-5], [4096, 1e-3], [65536, 1.5e-3]]}}},
}


@pytest.fixture(scope="module")
def cal() -> MachineCalibration:
    return MachineCalibration.from_json(json.dumps(SYNTHETIC))


def _spec(name: str):
    return next(s for s in default_runs() if s.name == name)


def _row(name: str, median: float = 0.05) -> dict:
    """A ``measure_runs`` row of the default run ``name``, built by ``run_row`` from made-up rank results (every
    step ``median`` seconds): the rows compare_runs gets, without ranks."""
    spec = _spec(name)
    p, steps = spec.params, 3
    if spec.chapter == 13:
        pp = p["pp"]
        rank = {"step_s": [median] * steps, "pp": pp, "virtual_stages": p.get("virtual_stages", 1),
                "config": {"layers": 8, "hidden": 16, "micro_batch_size": 4},
                "timelines": [[{"end": median}]] * steps}
    else:
        from workers.layout import Layout

        lay = Layout.parse(f"{p['dp']}x{p['tp']}x{p['pp']}x{p['cp']}", zero=p["zero"],
                           micro_batches=p["micro_batches"]).resolve(spec.world)
        rank = {"step_s": [median] * steps, "schedule_s": [median] * steps, "sync_s": [0.0] * steps,
                "layout": lay.as_dict(),
                "config": {"vocab": 32, "seq": 16, "hidden": 32, "heads": 8, "kv_heads": 8, "ffn": 128, "layers": 4,
                           "tied": True, "dtype": "float64", "global_batch": 8}}
    return run_row(spec, [rank] * spec.world, steps=steps)


def test_the_device_prices_matmuls_with_the_calibrations_own_rows(cal):
    cluster = md.device_from(cal)
    gpu = cluster.gpu
    assert gpu.gemm_rows == cal.matmul and gpu.overhead_serial and gpu.cores == cal.cores
    assert gpu.peak_flops == max(r[-1] for r in cal.matmul) and gpu.stream_efficiency == 1.0
    assert gpu.memory_bandwidth == cal.stream_bandwidth
    assert gpu.kernel_overhead_s == pytest.approx(cal.linear_forward_backward_s / md.linear_step_ops())
    for dtype, m, n, k, flops in cal.matmul:  # an exact shape returns its own measured row, in step_time's table too
        assert _table(gpu, dtype).rate(m, n, k) == flops
        assert md.gemm_table(cluster, dtype).rate(m, n, k) == flops
    for link in (cluster.intra_node, cluster.inter_node):
        assert set(cal.link_fits()) <= set(link.fitted)
        aliases = {(n, w, a, b) for n, w, a, b in link.fitted if n == "send_recv"}
        assert aliases == {("send_recv", w, a, b) for n, w, a, b in cal.link_fits() if n == "p2p"}
    assert cluster.gpus_per_node >= 1024  # every group inside the one machine


@pytest.mark.parametrize("name", [f"{s} pp {p} m {m} timed" for s in ("gpipe", "1f1b", "interleaved v 2")
                                  for p in (2, 4) for m in (4, 8)])
def test_a_padded_pipeline_is_the_makespan_of_its_padded_stages(cal, name):
    row = _row(name)
    pred = md.predict(row, cal)
    lay = row["layout"]
    p, v, m = lay["pp"], lay["virtual_stages"], row["micro_batches"]
    fwd, bwd = pred["forward"], pred["backward"]
    assert len(fwd) == len(bwd) == p * v
    assert min(fwd) >= row["forward_ms"] / 1e3 / v and min(bwd) >= row["backward_ms"] / 1e3 / v
    busiest = max(m * sum(fwd[vs] + bwd[vs] for vs in range(r, p * v, p)) for r in range(p))
    assert pred["predicted_s"] >= busiest >= m * (row["forward_ms"] + row["backward_ms"]) / 1e3
    assert pred["predicted_s"] == pipeline_makespan(lay["schedule"], p, m, v, fwd, bwd, pred["message"])
    assert sum(pred["terms"].values()) == pytest.approx(pred["predicted_s"], rel=1e-12)


def test_the_op_counts_are_positive_integers_and_the_same_every_time():
    for kwargs in ({}, {"cp": 4, "micro_batch": 8}):
        first, second = (md.count_gpt_ops.__wrapped__(**kwargs) for _ in range(2))
        assert first == second
        assert all(isinstance(x, int) and x > 0 for x in (first.layer_forward, first.layer_backward, first.extra))
        assert first.layer_backward > first.layer_forward  # backward runs about two ops per forward op
    assert md.count_gpt_ops(cp=4, micro_batch=8).layer_forward > md.count_gpt_ops().layer_forward  # the ring's blocks
    chunks = md.count_mlp_chunk_ops.__wrapped__(8, 16, 4, 4, 8)
    assert chunks == md.count_mlp_chunk_ops.__wrapped__(8, 16, 4, 4, 8) and len(chunks) == 4
    assert all(isinstance(x, int) and x > 0 for pair in chunks for x in pair)
    assert md.linear_step_ops() > 0


def test_compare_runs_gives_one_row_per_run_in_order(cal):
    names = ["1x1x4x1 zero 0", "1x1x1x4 zero 1", "1x1x4x1 m 4 timed", "1f1b pp 4 m 8 unpadded",
             "interleaved v 2 pp 2 m 4 timed"]
    rows = [_row(n, median=0.01 * (i + 1)) for i, n in enumerate(names)]
    compared = md.compare_runs(cal, rows)
    assert [c["name"] for c in compared] == names
    for c, row in zip(compared, rows):
        assert c["measured_s"] == row["measured_median_s"]
        assert c["ratio"] == pytest.approx(c["predicted_s"] / c["measured_s"])
        assert c["within"] == (abs(c["ratio"] - 1) <= md.TOLERANCE)
        assert c["predicted_s"] > 0 and math.isfinite(c["predicted_s"])
        assert sum(c["terms"].values()) == pytest.approx(c["predicted_s"], rel=1e-12)
        assert c["dominant"] in c["terms"]
    assert "padding" in compared[2]["terms"] and "tied embedding" in compared[0]["terms"]
    assert f"of {len(names)} within" in str(md.comparison_table(compared))


@pytest.mark.ranks
def test_a_calibration_and_one_measured_run_compare(tmp_path, monkeypatch):
    monkeypatch.setenv("COURSE_SCRATCH_DIR", str(tmp_path))
    quick = {"shapes": ["8x32x32", "64x64x64"], "dtypes": ["float32", "float64"], "sizes": [8, 4096, 262144],
             "repeats": 3, "target_ms": 0.5, "window_ms": 5.0, "windows": 1, "calls": 5, "max_calls": 9,
             "point_ms": 10.0, "stream_mib": 4}
    cal = cal_mod.calibrate((2,), refresh=True, store=False, **quick)
    spec = cal_mod.RunSpec(13, "1f1b pp 2 m 4", cal_mod.CH13_WORKER, 2, {"schedule": "1f1b", "pp": 2,
                                                                         "micro_batches": 4})
    rows = cal_mod.measure_runs([spec], steps=3)
    (compared,) = md.compare_runs(cal, rows)
    assert compared["name"] == "1f1b pp 2 m 4" and compared["measured_s"] > 0
    assert compared["predicted_s"] > 0 and math.isfinite(compared["ratio"])
