"""This machine as a planner device (``course_utils/calibration.py``, ``workers/calibrate.py``): the fits, the
calibration's fields and its JSON, and the measured side (``measure_runs``).

No assertion here is on how fast anything is: the machine is shared and its timings vary. The fit checks are exact
properties of least squares (a law it can represent is recovered to rounding; the fit is never worse than either of
its one-term special cases, on any data), or bounds every timing satisfies (positive, finite, min <= median <= max).
"""
from __future__ import annotations

import math
import os
import statistics

import pytest
import torch

from course_utils import calibration as cal_mod
from course_utils import machine_device as md
from course_utils.calibration import MachineCalibration, RunSpec, ch15_params, default_runs, fit_alpha_beta
from course_utils.validate import check_params

# A calibration small enough for a test (about 2 s on 2 warm ranks): two shapes, three sizes, short windows.
QUICK = {"shapes": ["8x32x32", "64x64x64"], "dtypes": ["float32"], "sizes": [8, 4096, 262144], "repeats": 3,
         "target_ms": 0.5, "window_ms": 5.0, "windows": 1, "calls": 5, "max_calls": 9, "point_ms": 10.0,
         "stream_mib": 4}
SIZES = [8, 64, 512, 4096, 32768, 262144, 1048576, 4194304]


def rms(values) -> float:
    return math.sqrt(sum(v * v for v in values) / len(values))


def relative_errors(alpha, beta, sizes, seconds):
    return [(alpha + beta * s - t) / t for s, t in zip(sizes, seconds)]


def best_one_term_rms(sizes, seconds) -> float:
    """The least relative RMS error of t = alpha alone and of t = beta * S alone (closed forms)."""
    a = sum(1 / t for t in seconds) / sum(1 / t**2 for t in seconds)
    b = sum(s / t for s, t in zip(sizes, seconds)) / sum((s / t) ** 2 for s, t in zip(sizes, seconds))
    return min(rms(relative_errors(a, 0.0, sizes, seconds)), rms(relative_errors(0.0, b, sizes, seconds)))


# -- the fit, without ranks ---------------------------------------------------------------------------------------------

def test_the_fit_recovers_an_alpha_beta_law_exactly():
    # gloo-like: 60 us latency, 1.5 GB/s; the points are the law itself, so only float64 rounding separates them
    seconds = [60e-6 + s / 1.5e9 for s in SIZES]
    alpha, beta, worst = fit_alpha_beta(SIZES, seconds)
    assert abs(alpha / 60e-6 - 1) < 1e-9 and abs(beta * 1.5e9 - 1) < 1e-9
    assert worst < 1e-9


@pytest.mark.parametrize("shape", ["flat", "noisy", "bandwidth only", "falling"])
def test_the_fit_stays_positive_and_is_never_worse_than_either_term_alone(shape):
    # The two one-term laws are special cases of alpha + beta S, so the least-squares fit's relative RMS error is at
    # most theirs (exact, whatever the data). When the best fit would need a negative term (a flat or falling curve),
    # that term is held at a floor that moves no point by more than 1e-6 of its time: still no worse than the better
    # one-term law, up to that.
    wobble = [1.0, 1.3, 0.8, 1.2, 0.9, 1.25, 0.85, 1.1]  # a fixed +-30% pattern: deterministic "noise"
    seconds = {"flat": [300e-6] * 8, "noisy": [(80e-6 + s / 1e9) * w for s, w in zip(SIZES, wobble)],
               "bandwidth only": [s / 2e9 for s in SIZES], "falling": [1e-3 / (i + 1) for i in range(8)]}[shape]
    alpha, beta, worst = fit_alpha_beta(SIZES, seconds)
    assert alpha > 0 and beta > 0
    errors = relative_errors(alpha, beta, SIZES, seconds)
    assert rms(errors) <= best_one_term_rms(SIZES, seconds) + 2e-6
    assert worst == pytest.approx(max(abs(e) for e in errors))


def test_the_fit_refuses_what_it_cannot_fit():
    with pytest.raises(ValueError, match="at least two"):
        fit_alpha_beta([8], [1e-4])
    with pytest.raises(ValueError, match="positive finite"):
        fit_alpha_beta([8, 64], [1e-4, float("nan")])


def test_alpha_at_a_given_beta_recovers_the_law_and_stays_positive():
    sizes = [8, 4096, 65536]
    assert cal_mod.alpha_at(1e-9, sizes, [1.2e-3 + 1e-9 * s for s in sizes]) == pytest.approx(1.2e-3, rel=1e-12)
    assert cal_mod.alpha_at(1e-6, sizes, [1e-4] * 3) > 0  # the bytes alone would overshoot: held at its floor


def _rank(world: int, rank: int, per_call: dict) -> dict:
    """A rank's contended result as workers/calibrate.py returns it: per kind, size and busy, its calls."""
    rows = {kind: [{"bytes": b, "busy": busy, "seconds": per_call.get((kind, b, busy, rank), [])}
                   for b in (8, 65536) for busy in ((world - 2,) if kind == "world_all_reduce" else (0, world - 2))
                   if not (kind == "world_all_reduce" and b > 8)]
            for kind in ("p2p", "all_reduce", "world_all_reduce")}
    return {"contended": rows, "barrier": [1e-3, 2e-3, 3e-3]}


def test_contended_rows_and_fits_from_synthetic_ranks():
    # rank 0 times a ping-pong (its one way); an all-reduce counts per call the least of its ranks' times
    calls = {("p2p", b, busy, 0): [(1e-4 if busy == 0 else 1.5e-3) + 1e-9 * b] * 5 for b in (8, 65536)
             for busy in (0, 2)}
    calls.update({("all_reduce", b, busy, r): [(3e-4 if busy == 0 else 2e-3) + 2e-9 * b + r * 1e-3] * 4
                  for b in (8, 65536) for busy in (0, 2) for r in (0, 1)})
    calls.update({("world_all_reduce", 8, 2, r): [5e-3 + r * 1e-4] * 3 for r in range(4)})
    ranks = [_rank(4, r, calls) for r in range(4)]
    rows = cal_mod.contended_rows(ranks)
    mean = cal_mod.CONTENDED_COLUMNS.index("mean")
    p2p = {(r[0], r[1]): r for r in rows["p2p"]}
    assert p2p[(8, 2)][2] == pytest.approx(1.5e-3 + 8e-9) and p2p[(8, 2)][7] == 5
    assert p2p[(8, 2)][mean] == pytest.approx(p2p[(8, 2)][2])
    ar = {(r[0], r[1]): r for r in rows["all_reduce"]}
    assert ar[(65536, 0)][2] == pytest.approx(3e-4 + 2e-9 * 65536)  # rank 0's, the smaller
    assert rows["world_all_reduce"][0][2] == pytest.approx(5e-3)
    raw = {2: {"contended": {}}, 4: {"contended": rows}}
    fits = cal_mod._contended_fits(raw, {("p2p", 4): (6e-5, 1e-9), ("all_reduce", 2): (3e-4, 2e-9),
                                         ("all_reduce", 4): (1e-3, 3e-9)})
    assert fits["contended_world"] == 4
    assert fits["p2p_busy"] == pytest.approx((1.5e-3, 1e-9)) and fits["p2p_quiet"] == pytest.approx((1e-4, 1e-9))
    assert fits["all_reduce_busy"] == pytest.approx((2e-3, 2e-9))
    assert fits["all_reduce_quiet"] == pytest.approx((3e-4, 2e-9))
    assert fits["world_all_reduce_busy"][1] == 3e-9 and fits["world_all_reduce_busy"][0] == pytest.approx(5e-3 - 24e-9)
    assert cal_mod._contended_fits({2: {"contended": {}}}, {}) == {}  # two ranks: nothing measured


def test_the_messaging_pattern_gives_the_cold_start_and_the_cpu_per_message_end():
    # every rank took part: the median over the ranks; the burst alone is rank 0's (the others slept meanwhile)
    ranks = [{"messaging": {"alone_s": 4e-4 if r == 0 else None, "burst_s": 5e-4 + r * 1e-5,
                            "main_per_end_s": 6e-5 + r * 1e-6, "transport_per_end_s": 1.2e-4 + r * 1e-6,
                            "bursts": 160, "burst_steps": 4}} for r in range(4)]
    got = cal_mod.messaging_medians(ranks)
    assert got == pytest.approx({"alone_s": 4e-4, "burst_s": 5.15e-4, "main_per_end_s": 6.15e-5,
                                 "transport_per_end_s": 1.215e-4})
    fields = cal_mod._messaging({2: {"messaging": {}}, 4: {"messaging": got}})
    assert fields == pytest.approx({"messaging_world": 4, "cold_start_s": 1.15e-4, "message_main_s": 6.15e-5,
                                    "message_transport_s": 1.215e-4})
    # a burst no slower after a wait than back to back starts no colder than that (noise cannot make it negative)
    assert cal_mod._messaging({4: {"messaging": {**got, "burst_s": 3e-4}}})["cold_start_s"] == 0.0
    assert cal_mod.messaging_medians([{"messaging": None}] * 2) == {} and cal_mod._messaging({2: {}}) == {}


def test_the_new_fields_round_trip_and_an_older_file_still_loads():
    old = {"format": cal_mod.FORMAT, "cpu": "x", "capability": "DEFAULT", "cores": 2, "threads_per_rank": 1,
           "world_sizes": [2], "torch_version": "0", "op_s": 1e-6, "op_forward_s": 2e-6,
           "op_forward_backward_s": 8e-6, "backward_call_s": 2e-5, "linear_forward_backward_s": 6e-5,
           "matmul": [["float32", 8, 8, 8, 1e9]], "stream_bandwidth": 1e10, "contention": [["op", 1, 1.0]],
           "collectives": [["p2p", 2, 6e-5, 1e-9]], "fit_error": [["p2p", 2, 0.1]], "p2p": [6e-5, 1e-9],
           "measured_at": "", "seconds": 1.0, "params": {}, "raw": {}}
    import json

    cal = MachineCalibration.from_json(json.dumps(old))  # written before the contended fields existed
    assert cal.contended_world == 0 and cal.p2p_busy == (0.0, 0.0) and cal.barrier == () and cal.adamw_step_s == 0
    assert cal.messaging_world == 0 and cal.cold_start_s == 0.0 and cal.trainer_world == 0
    assert cal.attention == () and cal.activation == ()
    assert cal.barrier_seconds(4) == 0.0
    new = {**old, "contended_world": 4, "p2p_busy": [1.5e-3, 1e-9], "p2p_quiet": [1e-4, 1e-9],
           "all_reduce_busy": [2e-3, 2e-9], "all_reduce_quiet": [3e-4, 2e-9], "world_all_reduce_busy": [5e-3, 3e-9],
           "barrier": [[2, 2e-4], [4, 1e-3]], "adamw_step_s": 3e-4, "adamw_shapes": [[32], [32, 32]],
           "attention": [["float64", 8, 16, 4, 3e-5, 1e-4]], "activation": [["float64", 1024, 2e-5, 6e-5]],
           "messaging_world": 4, "cold_start_s": 1.5e-4, "message_main_s": 6e-5, "message_transport_s": 1.2e-4,
           "trainer_world": 4, "trainer_step_s": 4.5e-4}
    cal = MachineCalibration.from_json(json.dumps(new))
    assert cal.trainer_world == 4 and cal.trainer_step_s == 4.5e-4
    assert "chapter 13's trainer, 4 ranks" in str(cal.summary())
    assert cal.messaging_world == 4 and cal.cold_start_s == 1.5e-4 and cal.message_transport_s == 1.2e-4
    assert cal.p2p_busy == (1.5e-3, 1e-9) and cal.adamw_shapes == ((32,), (32, 32))
    assert cal.attention == (("float64", 8, 16, 4, 3e-5, 1e-4),) and cal.activation == (("float64", 1024, 2e-5, 6e-5),)
    assert cal.barrier_seconds(4) == 1e-3 and cal.barrier_seconds(3) == 1e-3 and cal.barrier_seconds(1) == 0.0
    assert MachineCalibration.from_json(cal.to_json()) == cal
    assert "others busy" in str(cal.summary()) and "barrier, 4 ranks" in str(cal.summary())
    assert "causal SDPA float64" in str(cal.summary()) and "GELU float64" in str(cal.summary())
    assert "starts after a wait" in str(cal.summary()) and "CPU per message end" in str(cal.summary())


def test_the_worker_refuses_contended_settings_it_cannot_run():
    from course_utils.validate import InvalidParameter

    for bad in ({"contended_sizes": [2]}, {"contended_rounds": 0}, {"contended_work_ms": -1.0},
                {"contended_ms": 0.0}, {"contended_calls": 1}, {"messaging_steps": -1}, {"messaging_messages": 0},
                {"messaging_burst_steps": 0}, {"trainer_steps": 3}, {"trainer_steps": -1}):
        with pytest.raises(InvalidParameter):
            check_params(cal_mod.WORKER, 4, {**QUICK, **bad})
    check_params(cal_mod.WORKER, 4, {**QUICK, "contended_sizes": []})  # none: the phase is skipped
    check_params(cal_mod.WORKER, 4, {**QUICK, "messaging_steps": 0})  # none: the messaging phase is skipped
    check_params(cal_mod.WORKER, 4, {**QUICK, "trainer_steps": 0})  # none: the trainer phase is skipped


def test_the_default_runs_are_the_chapters_runs_and_every_one_passes_its_workers_check():
    runs = default_runs()
    names = [(r.chapter, r.name) for r in runs]
    assert len(names) == len(set(names))
    ch13 = [r for r in runs if r.chapter == 13]
    # 3 schedules x pp 2 and 4 x m 4 and 8 x padded to chapter 13's TIMED waits and not
    assert len(ch13) == 24 and sum(cal_mod.padded(r) for r in ch13) == 12
    assert {(r.params["schedule"], r.params["virtual_stages"]) for r in ch13} == {("gpipe", 1), ("1f1b", 1),
                                                                                  ("interleaved", 2)}
    ch15 = {r.name: r for r in runs if r.chapter == 15}
    assert ch15["1x1x4x1 m 4 timed"].params["micro_batches"] == 4
    assert ch15["1x1x4x1 zero 0"].params["micro_batches"] == 2  # the chapter's layout_for: m = 2 with a pipeline
    assert ch15["1x1x1x4 zero 1"].params["micro_batches"] == 1 and ch15["1x1x1x4 zero 1"].params["zero"] == 1
    for r in runs:
        check_params(r.worker, r.world, {**r.params, "steps": 3})  # raises InvalidParameter if the worker refuses


def test_chapter_15_parameters_match_the_chapters_own():
    from course_utils import ch15

    for name in ch15.LAYOUTS_4:
        for options in ({}, {"zero": 1}, {"micro_batches": 4, "forward_ms": 20.0, "backward_ms": 40.0}):
            layout = ch15.layout_for(name, **options)
            extra = {k: v for k, v in options.items() if k not in ch15.LAYOUT_OPTIONS}
            assert ch15_params(name, **options) == {**ch15.worker_params(layout), **extra}


def test_one_ranks_timings_run_in_the_test_process_without_ranks():
    # workers/timing/cpu.py holds what one rank times alone (the calibration's ops and kernels): importable and
    # runnable here, with no process group. Bounds every timing satisfies. (Not forward < forward + backward: with a
    # whole make test running beside it, even the least of three repeats of a 0.2 ms loop was a 4 ms scheduler slice,
    # and the order failed 4 times in 7 under ATEN_CPU_CAPABILITY=default.)
    from workers.timing import cpu

    got = cpu.timed(lambda: None, repeats=3, target_s=1e-4)
    assert got["samples"] == 3 and got["inner"] >= 1 and 0 <= got["min"] <= got["median"] <= got["max"]
    ops = cpu.measure_ops(repeats=3, target_s=2e-4)
    for name in ("op_s", "backward_call_s", "linear_forward_backward_s", "adamw_step_s"):
        assert math.isfinite(ops[name]) and ops[name] > 0, name
    assert ops["chain"] == list(cpu.CHAIN) and len(ops["chain_forward_backward_s"]) == len(cpu.CHAIN)
    kernels = cpu.measure_kernels(["float32"], repeats=3, target_s=2e-4)
    rows = kernels["attention"] + kernels["activation"]
    assert len(rows) == len(cpu.ATTENTION_SHAPES) + len(cpu.ACTIVATION_SIZES)
    assert all(math.isfinite(r[t]) and r[t] > 0 for r in rows for t in ("forward_s", "forward_backward_s"))


def test_a_stored_calibration_is_tied_to_the_timing_code_as_well_as_the_rank_script(tmp_path, monkeypatch):
    # The cache key hashes workers/calibrate.py, workers/timing/cpu.py, chapter 13's trainer and chapter 15's model,
    # which the calibration runs: a change to any of them measures anew.
    names = ("calibrate.py", "timing/cpu.py", *cal_mod.TRAINER_CODE, *cal_mod.GPT_CODE)
    for name in names:
        (tmp_path / "workers" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "workers" / name).write_bytes((cal_mod.ROOT / "workers" / name).read_bytes())
    monkeypatch.setattr(cal_mod, "ROOT", tmp_path)
    for name in names[1:]:
        before = cal_mod._worker_digest()
        (tmp_path / "workers" / name).write_text(f"# changed {name}\n", encoding="utf-8")
        assert cal_mod._worker_digest() != before, name


# -- on ranks ---------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def calibration(tmp_path_factory):
    before = os.environ.get("COURSE_SCRATCH_DIR")
    os.environ["COURSE_SCRATCH_DIR"] = str(tmp_path_factory.mktemp("scratch"))  # the JSON file goes there
    try:
        yield cal_mod.calibrate((2,), refresh=True, **QUICK)
    finally:
        if before is None:
            os.environ.pop("COURSE_SCRATCH_DIR", None)
        else:
            os.environ["COURSE_SCRATCH_DIR"] = before


@pytest.mark.ranks
def test_the_calibration_describes_this_machine(calibration):
    c = calibration
    assert c.capability == torch.backends.cpu.get_cpu_capability()
    assert c.cores == cal_mod.cores() and c.threads_per_rank == 1 and c.world_sizes == (2,)
    for name in ("op_s", "op_forward_s", "op_forward_backward_s", "backward_call_s", "linear_forward_backward_s",
                 "stream_bandwidth"):
        value = getattr(c, name)
        assert math.isfinite(value) and value > 0, name
    assert [(d, m, n, k) for d, m, n, k, _ in c.matmul] == [("float32", 8, 32, 32), ("float32", 64, 64, 64)]
    assert all(math.isfinite(f) and f > 0 for *_, f in c.matmul)
    assert {(kind, k) for kind, k, _ in c.contention} == {(kind, k) for kind in ("matmul", "op", "stream")
                                                         for k in (1, 2)}
    assert all(s == 1.0 for _, k, s in c.contention if k == 1)
    assert c.adamw_step_s > 0 and len(c.adamw_shapes) == 12
    # the kernels, in each dtype calibrated: every attention shape and activation size, forward within forward + backward
    shapes = [(8, 16, 4), (64, 16, 4), (512, 16, 4), (16, 128, 32)]  # (batch x heads, seq, head_dim): chapter 15's
    assert [r[:4] for r in c.attention] == [("float32", *shape) for shape in shapes]
    assert [r[:2] for r in c.activation] == [("float32", n) for n in (1024, 16384, 262144)]
    assert all(0 < r[-2] < r[-1] for r in c.attention + c.activation)
    assert [w for w, _ in c.barrier] == [2] and c.barrier[0][1] > 0
    assert c.contended_world == 0 and c.p2p_busy == (0.0, 0.0)  # two ranks: no other rank to be busy
    # chapter 15's model timed in this process: whole, and with its ring (which runs more ops per token)
    assert [(cp, mb) for cp, mb, _ in c.gpt] == list(md.GPT_TIMED)
    assert all(math.isfinite(t) and t > 0 for *_, t in c.gpt)


@pytest.mark.ranks
def test_contended_messages_are_measured_with_the_other_ranks_busy_and_idle():
    short = {**QUICK, "collectives": ["broadcast"], "contended_ms": 3.0, "contended_rounds": 1,
             "contended_work_ms": 0.2, "trainer_steps": 0}
    ranks = cal_mod.run_worker(cal_mod.WORKER, world_size=3, **short).ranks
    raw = cal_mod.aggregate(ranks)
    assert all(r["messaging"] is None for r in ranks) and raw["messaging"] == {}  # an odd world has no pairs
    rows = raw["contended"]
    assert {(r[0], r[1]) for r in rows["p2p"]} == {(b, busy) for b in (8, 65536) for busy in (0, 1)}
    assert {(r[0], r[1]) for r in rows["world_all_reduce"]} == {(8, 1)}
    for kind, kind_rows in rows.items():
        for _, _, median, q1, q3, lo, hi, calls, mean in kind_rows:
            assert calls >= 1 and 0 <= lo <= q1 <= median <= q3 <= hi and lo <= mean <= hi, kind
    fits = cal_mod._contended_fits({3: raw}, {("p2p", 3): (6e-5, 1e-9), ("all_reduce", 2): (3e-4, 1e-9),
                                              ("all_reduce", 3): (1e-3, 1e-9)})
    assert fits["contended_world"] == 3
    assert all(fits[k][0] > 0 for k in cal_mod.CONTENDED_FITS)
    assert len(raw["barrier"]) == 7 and raw["barrier"][0] > 0


@pytest.mark.ranks
def test_the_messaging_pattern_is_measured_on_every_rank_of_an_even_world():
    short = {**QUICK, "collectives": ["broadcast"], "contended_sizes": [], "messaging_steps": 3,
             "messaging_messages": 4, "messaging_burst_steps": 1, "trainer_steps": 0}
    ranks = cal_mod.run_worker(cal_mod.WORKER, world_size=4, **short).ranks
    for r in ranks:
        got = r["messaging"]
        assert got["bursts"] == 12 and got["burst_steps"] == 1
        # CPU clocks: a burst takes some, a message end some on this thread; the other threads' share is >= 0
        assert got["burst_s"] > 0 and got["main_per_end_s"] > 0 and got["transport_per_end_s"] >= 0
    assert ranks[0]["messaging"]["alone_s"] > 0 and all(r["messaging"]["alone_s"] is None for r in ranks[1:])
    raw = cal_mod.aggregate(ranks)
    assert set(raw["messaging"]) == {"alone_s", "burst_s", "main_per_end_s", "transport_per_end_s"}
    assert cal_mod._messaging({4: raw})["messaging_world"] == 4


@pytest.mark.ranks
def test_chapter_13s_trainer_is_measured_on_every_rank_at_once_without_sending_its_losses():
    short = {**QUICK, "collectives": ["broadcast"], "contended_sizes": [], "messaging_steps": 0, "trainer_steps": 20}
    res = cal_mod.run_worker(cal_mod.WORKER, world_size=3, **short)
    for r in res.ranks:
        got = r["trainer"]
        # CPU clocks: two more micro-batches' forward and backward take some (about 1 ms a step here); the step
        # besides them is a fit's intercept on a machine whose speed can swing by 1.7x for seconds (a shared
        # host: 0.15-0.95 ms over 15 ranks' fits here at world 3), so only its being a number is asserted
        assert got["steps"] == 20 and got["micro_batch_s"] > 0 and got["barrier_cpu_s"] >= 0
        assert math.isfinite(got["step_s"])
    # the trainer's losses are not the calibration's progress: one metric per phase, none from the trainer runs
    assert all(len(m) == len(res.ranks[0]["phases"]) for m in res.metrics), res.metrics
    raw = cal_mod.aggregate(res.ranks)
    assert raw["trainer"] == pytest.approx(statistics.median(r["trainer"]["step_s"] for r in res.ranks))
    cal = cal_mod.build({3: res.ranks})
    assert cal.trainer_world == 3 and cal.trainer_step_s == pytest.approx(max(0.0, raw["trainer"]))


@pytest.mark.ranks
def test_every_collective_gets_a_sane_alpha_beta_fit(calibration):
    c = calibration
    names = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p")
    assert set(c.collectives) == {(n, 2) for n in names} and c.p2p == c.collectives[("p2p", 2)]
    assert {(n, w) for n, w, _, _ in c.link_fits()} == set(c.collectives)
    for (name, world), (alpha, beta) in c.collectives.items():
        points = c.raw[world]["collectives"][name]
        sizes, seconds = [s for s, _ in points], [t for _, t in points]
        assert sizes == [8, 4096, 262144]  # float32, a whole number of elements per rank: the sizes asked for
        assert all(t > 0 for t in seconds)
        assert alpha > 0 and beta > 0, name
        errors = relative_errors(alpha, beta, sizes, seconds)
        # least squares on the relative error: never worse than the better of latency alone and bandwidth alone
        # (exact, on any measurement), and the worst error it reports is its own
        assert rms(errors) <= best_one_term_rms(sizes, seconds) + 2e-6, name
        assert c.fit_error[(name, world)] == pytest.approx(max(abs(e) for e in errors))


@pytest.mark.ranks
def test_the_calibration_round_trips_through_json_and_is_cached(calibration, monkeypatch):
    c = calibration
    again = MachineCalibration.from_json(c.to_json())
    assert again == c
    assert cal_mod.calibrate((2,), **QUICK) is c  # the session's cache: no ranks run
    # the file under the scratch folder serves a new session while the machine, torch and the worker are the same
    path = cal_mod.cache_file((2,), **QUICK)
    assert path.is_file() and str(path).startswith(os.environ["COURSE_SCRATCH_DIR"])
    monkeypatch.setattr(cal_mod, "_CACHE", {})
    monkeypatch.setattr(cal_mod, "run_worker", lambda *a, **k: pytest.fail("a stored calibration was measured again"))
    assert cal_mod.calibrate((2,), **QUICK) == c
    assert "one eager op" in str(c.summary()) and "all_reduce" in str(c.collective_table())
    assert "chapter 15's GPT" in str(c.summary())


@pytest.mark.ranks
def test_measure_runs_gives_one_row_per_run_with_its_shapes():
    runs = [RunSpec(15, "1x1x2x1", cal_mod.CH15_WORKER, 2, ch15_params("1x1x2x1")),
            RunSpec(13, "1f1b pp 2 m 4", cal_mod.CH13_WORKER, 2, {"schedule": "1f1b", "pp": 2, "micro_batches": 4})]
    rows = cal_mod.measure_runs(runs, steps=3)
    assert [(r["chapter"], r["name"]) for r in rows] == [(15, "1x1x2x1"), (13, "1f1b pp 2 m 4")]
    for r in rows:
        lo, hi = r["measured_spread"]
        assert r["steps"] == 2 and len(r["step_s"]) == 2  # the first of 3 steps is warm-up
        assert 0 < lo <= r["measured_median_s"] <= hi
        assert r["layout"]["pp"] == 2 and r["micro_batches"] in (2, 4) and r["forward_ms"] == 0.0
    gpt, mlp = rows[0], rows[1]
    assert {k: gpt["model"][k] for k in ("vocab", "seq", "hidden", "heads", "layers", "dtype")} == {
        "vocab": 32, "seq": 16, "hidden": 32, "heads": 8, "layers": 4, "dtype": "float64"}
    assert gpt["global_batch"] == 8 and gpt["micro_batch_size"] == 4 and gpt["train_median_s"] > 0
    assert mlp["model"] == {"kind": "mlp", "layers": 8, "hidden": 16, "dtype": "float32", "optimizer": "sgd"}
    assert mlp["global_batch"] == 16 and mlp["micro_batch_size"] == 4 and mlp["schedule_median_s"] > 0


# -- the host's speed around a measurement --------------------------------------------------------------------------

def test_a_probe_times_a_tiny_op_and_the_slowdown_is_against_the_quietest_probe(monkeypatch):
    monkeypatch.setattr(cal_mod, "_QUIETEST", [math.inf])
    probe = cal_mod.probe_host(ops=200, bursts=3)
    assert 1e-9 < probe < 1e-3 and cal_mod._QUIETEST == [probe]
    assert cal_mod.host_slowdown([probe]) == 1.0
    assert cal_mod.host_slowdown([probe, 2 * probe]) == 2.0  # the slowest of the probes counts
    assert cal_mod.host_slowdown([probe / 2]) == 1.0  # a probe quicker than any taken is the new quietest
    assert math.isnan(cal_mod.host_slowdown([]))


def _scripted_probes(monkeypatch, probes):
    """``probe_host`` reads ``probes`` in turn (seconds per op), through the same bookkeeping of the quietest."""
    left = iter(probes)
    monkeypatch.setattr(cal_mod, "_QUIETEST", [math.inf])
    monkeypatch.setattr(cal_mod, "_tiny_op_seconds", lambda ops, bursts: next(left))
    return left


@pytest.mark.ranks
def test_a_run_measured_while_the_host_slowed_down_is_measured_again_and_the_quietest_kept(monkeypatch):
    spec = RunSpec(13, "1f1b pp 2 m 4", cal_mod.CH13_WORKER, 2, {"schedule": "1f1b", "pp": 2, "micro_batches": 4})
    # around the first try the host ran twice as slow after the run; the second try's probes are both quiet
    left = _scripted_probes(monkeypatch, [1e-6, 2e-6, 1e-6, 1.1e-6])
    row, = cal_mod.measure_runs([spec], steps=3)
    assert row["tries"] == 2 and row["host_probe_s"] == (1e-6, 1.1e-6)
    assert row["host_slowdown"] == pytest.approx(1.1) and next(left, None) is None
    # slow around every try: HOST_TRIES tries, the least slowed of them kept and said
    left = _scripted_probes(monkeypatch, [1e-6, 3e-6, 2.5e-6, 2.5e-6])
    row, = cal_mod.measure_runs([spec], steps=3)
    assert cal_mod.HOST_TRIES == 2 and row["tries"] == 2 and row["host_probe_s"] == (2.5e-6, 2.5e-6)
    assert row["host_slowdown"] == pytest.approx(2.5) and next(left, None) is None
    assert "2.50x" in str(cal_mod.runs_table([row]))


@pytest.mark.ranks
def test_a_calibration_taken_while_the_host_slowed_down_is_taken_again(monkeypatch):
    _scripted_probes(monkeypatch, [1e-6, 1.5e-6, 1e-6, 1e-6])
    cal = cal_mod.calibrate((2,), refresh=True, store=False, **QUICK)
    assert cal.host_probe_s == (1e-6, 1e-6) and cal.host_slowdown == 1.0
    assert "1.00 / 1.00 us (1.00x)" in str(cal.summary())
    assert MachineCalibration.from_json(cal.to_json()) == cal
