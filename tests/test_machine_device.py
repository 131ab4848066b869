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
from course_utils.step_time import _table, pipeline_makespan, schedule_plan

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
    # messages between two of four ranks, the other two busy or idle, and the AdamW step and barriers
    "contended_world": 4, "p2p_busy": [1.5e-3, 8e-10], "p2p_quiet": [1.2e-4, 8e-10],
    "all_reduce_busy": [2e-3, 5e-10], "all_reduce_quiet": [4e-4, 5e-10], "world_all_reduce_busy": [3e-3, 5e-10],
    "barrier": [[2, 2e-4], [4, 1.5e-3]], "adamw_step_s": 3e-4,
    "attention": [["float64", bh, 16, 4, 3e-6 * bh, 1e-5 * bh] for bh in (8, 64, 512)],
    "activation": [["float64", n, 2e-8 * n, 4e-8 * n] for n in (1024, 16384)],
    "adamw_shapes": [[32], [32], [96, 32], [96], [32, 32], [32], [32], [32], [128, 32], [128], [32, 128], [32]],
}


# the same machine with the messaging pattern measured (workers/calibrate.py: measure_messaging)
MESSAGING = {"messaging_world": 4, "cold_start_s": 1.5e-4, "message_main_s": 5e-5, "message_transport_s": 1.2e-4}


# and chapter 13's trainer measured (workers/calibrate.py: measure_trainer)
TRAINER = {"trainer_world": 4, "trainer_step_s": 4.5e-4}


@pytest.fixture(scope="module")
def cal() -> MachineCalibration:
    return MachineCalibration.from_json(json.dumps(SYNTHETIC))


@pytest.fixture(scope="module")
def shared() -> MachineCalibration:
    return MachineCalibration.from_json(json.dumps({**SYNTHETIC, **MESSAGING}))


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
    assert gpu.attention_rows == cal.attention and gpu.activation_rows == cal.activation and cal.attention
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
    assert pred["schedule_s"] >= busiest >= m * (row["forward_ms"] + row["backward_ms"]) / 1e3
    assert pred["schedule_s"] == pipeline_makespan(lay["schedule"], p, m, v, fwd, bwd, pred["message"])
    # a padded action sleeps: its rank holds no core, so the message is the quiet one
    assert pred["message"] == md.group_time("send_recv", 4 * 16 * 4, 2, 1, md.device_from(cal))
    outside = md.outside_schedule(row, cal, md.device_from(cal))
    assert pred["predicted_s"] == pytest.approx(pred["schedule_s"] + sum(outside.values()), rel=1e-12)
    assert sum(pred["terms"].values()) == pytest.approx(pred["predicted_s"], rel=1e-12)


def test_more_ranks_than_cores_price_a_small_groups_messages_at_the_contended_cost(cal):
    quiet = dict(((n, w), (a, b)) for n, w, a, b in md.link_fits(cal))
    assert md.link_fits(cal, 2) == md.link_fits(cal)  # as many ranks as cores: every fit as measured
    assert not md.contended(cal, 2) and md.contended(cal, 4)
    busy = dict(((n, w), (a, b)) for n, w, a, b in md.link_fits(cal, 4))
    assert busy[("send_recv", 2)] == cal.p2p_busy and busy[("all_reduce", 2)] == cal.all_reduce_busy
    excess = cal.p2p_busy[0] - cal.p2p_quiet[0]
    for name in ("all_gather", "reduce_scatter"):  # not measured under contention: one excess per ring message
        assert busy[(name, 2)] == pytest.approx((quiet[(name, 2)][0] + excess, quiet[(name, 2)][1]))
    for key in quiet:  # every rank of the world in the collective, and the raw p2p fits: as measured
        if key[1] == 4 or key[0] == "p2p":
            assert busy[key] == quiet[key]
    assert md.hops("all_reduce", 4) == 6 and md.hops("all_gather", 4) == 3
    older = MachineCalibration.from_json(json.dumps({k: v for k, v in SYNTHETIC.items()
                                                     if k not in ("contended_world", "p2p_busy")}))
    assert md.link_fits(older, 4) == md.link_fits(older)  # a calibration without contended messages


def test_an_unpadded_pipeline_on_more_ranks_than_cores_waits_the_contended_message(cal):
    row = _row("1f1b pp 4 m 8 unpadded")
    pred = md.predict(row, cal)
    assert pred["message"] == pytest.approx(cal.p2p_busy[0] + cal.p2p_busy[1] * 4 * 16 * 4)
    assert pred["schedule_s"] == pipeline_makespan("1f1b", 4, 8, 1, pred["forward"], pred["backward"],
                                                   pred["message"])
    gpt = md.predict(_row("1x1x4x1 zero 0"), cal)  # the tied embedding: a 2-rank all-reduce, others computing
    assert gpt["terms"]["tied embedding"] == pytest.approx(cal.all_reduce_busy[0] + cal.all_reduce_busy[1] * 32 * 32 * 8)


@pytest.mark.parametrize("schedule,p,m,v", [(s, p, m, 2 if s == "interleaved" else 1) for s in
                                             ("gpipe", "1f1b", "interleaved") for p in (2, 4) for m in (4, 8)])
def test_shared_cores_with_a_core_per_rank_and_free_threads_is_the_schedules_replay(schedule, p, m, v):
    # every rank on its own core, messages costing no CPU and no rank starting cold: nothing but the schedule and
    # the wire is left, which is Plan.run's replay (unequal stages, so that a wrong dependency shows)
    plan = schedule_plan(schedule, p, m, v)
    fwd = [1e-4 * (1 + 0.3 * vs) for vs in range(p * v)]
    bwd = [2.1e-4 * (1 + 0.2 * (p * v - vs)) for vs in range(p * v)]
    seconds = plan.seconds(fwd, bwd, 0.0)
    units = [seconds[plan.key[u]] for u in range(len(plan.rank))]
    for wire in (0.0, 3e-5):
        replay = plan.run(fwd, bwd, wire, boxes=False)["makespan"]
        assert md.shared_cores_makespan(plan, units, 1, p, wire=wire) == pytest.approx(replay, rel=1e-12)
        # two pipelines side by side on a core per rank: each runs as if alone
        assert md.shared_cores_makespan(plan, units, 2, 2 * p, wire=wire) == pytest.approx(replay, rel=1e-12)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_one_core_runs_every_second_of_cpu_the_ranks_and_their_messages_need(schedule):
    # with one core and messages that land as soon as their threads have run, the core never idles: the step is the
    # sum of every rank's CPU and every message's, whatever the order the queue serves them in
    p, m, v = 2, 4, 2 if schedule == "interleaved" else 1
    plan = schedule_plan(schedule, p, m, v)
    seconds = plan.seconds([1e-4, 1.3e-4, 0.9e-4, 1.1e-4][: p * v], [2e-4, 2.5e-4, 1.9e-4, 2.2e-4][: p * v], 0.0)
    units = [seconds[plan.key[u]] for u in range(len(plan.rank))]
    messages = sum(1 for d in plan.dep if d >= 0 and d & 1)
    for replicas in (1, 2):
        got = md.shared_cores_makespan(plan, units, replicas, 1, transport=3e-5)
        assert got == pytest.approx(replicas * (sum(units) + messages * 3e-5), rel=1e-9)


def test_a_message_waits_for_its_threads_and_the_wire_and_a_rank_that_waited_starts_cold():
    # GPipe, 2 stages, 1 micro-batch, a core each: F on stage 0 (cold: it left the step's barrier), its message
    # (transport, then wire), F on stage 1 (cold: it waited), B on stage 1 at once (its own F: no wait, not cold),
    # the gradient's message, B on stage 0 (cold)
    plan = schedule_plan("gpipe", 2, 1, 1)
    f, b = [1.0, 1.5], [2.0, 3.0]
    seconds = plan.seconds(f, b, 0.0)
    units = [seconds[plan.key[u]] for u in range(len(plan.rank))]
    got = md.shared_cores_makespan(plan, units, 1, 2, transport=0.1, wire=0.05, cold=0.01)
    assert got == pytest.approx(sum(f) + sum(b) + 3 * 0.01 + 2 * (0.1 + 0.05), rel=1e-12)
    # one core for both stages changes nothing here: only one of them can run at a time anyway
    assert md.shared_cores_makespan(plan, units, 1, 1, transport=0.1, wire=0.05, cold=0.01) == pytest.approx(got)
    # a second pipeline beside it: on two cores each still finds one free (one of its stages runs at a time); on
    # one core the two queue for it, and the step takes at least both pipelines' CPU
    assert md.shared_cores_makespan(plan, units, 2, 2, transport=0.1, wire=0.05, cold=0.01) == pytest.approx(got)
    assert md.shared_cores_makespan(plan, units, 2, 1, transport=0.1, wire=0.05, cold=0.01) >= 2 * (got - 0.1)


def test_a_rank_that_finished_its_schedule_keeps_its_core_for_the_trainers_step_after_it():
    # GPipe, 2 stages, 1 micro-batch, two pipelines side by side, every action 1 s. Without a tail: the first stages'
    # F (0-1), the last stages' F and B (1-3), the first stages' B (3-4). With a tail of 0.5 s on two cores, the last
    # stages keep both cores for theirs (3-3.5), the first stages' B waits for them (3.5-4.5), then their own tails
    # (4.5-5); with a core per rank only each rank's own tail is added after its B (4-4.5)
    plan = schedule_plan("gpipe", 2, 1, 1)
    units = [1.0] * len(plan.rank)
    assert md.shared_cores_makespan(plan, units, 2, 2) == 4.0
    assert md.shared_cores_makespan(plan, units, 2, 2, tail=0.5) == 5.0
    assert md.shared_cores_makespan(plan, units, 2, 4, tail=0.5) == 4.5


def test_the_trainers_measured_step_runs_on_the_cores_after_each_schedule(shared):
    row = _row("gpipe pp 2 m 4 unpadded")
    measured = MachineCalibration.from_json(json.dumps({**SYNTHETIC, **MESSAGING, **TRAINER}))
    pred, counted = md.predict(row, measured), md.predict(row, shared)
    assert md.trainer_tail(row, measured) == TRAINER["trainer_step_s"]
    # without the trainer measured, its step is the counted optimizer and reporting ops alone, at their CPU
    ops = md.step_ops(row)
    assert md.trainer_tail(row, shared) == pytest.approx(
        ops.optimizer * md.optimizer_op_seconds(shared) + ops.reporting * shared.op_s, rel=1e-12)
    assert md.trainer_tail(row, shared) == pytest.approx(sum(md.counted_step_cpu(row, shared)), rel=1e-12)
    for p in (pred, counted):
        assert set(p["terms"]) >= {"trainer", "barrier"} and not {"optimizer", "reporting"} & set(p["terms"])
        assert sum(p["terms"].values()) == pytest.approx(p["predicted_s"], rel=1e-12)
        assert p["terms"]["barrier"] == shared.barrier_seconds(4)
    # the rank that ends the schedule last runs its step after it: the step grows by at least the tail
    assert pred["terms"]["trainer"] >= TRAINER["trainer_step_s"] - 1e-12
    assert pred["schedule_s"] == pytest.approx(counted["schedule_s"], rel=1e-12)  # the schedule itself is the same
    assert pred["predicted_s"] > counted["predicted_s"]
    # a padded run's ranks sleep through their pads: its step outside the schedule stays the counted ops
    assert "optimizer" in md.predict(_row("gpipe pp 2 m 4 timed"), measured)["terms"]


def test_an_unpadded_pipeline_on_more_ranks_than_cores_shares_the_cores_with_its_messages(cal, shared):
    row = _row("1f1b pp 2 m 8 unpadded")
    assert md.shares_cores(row, shared) and not md.shares_cores(row, cal)  # cal never measured the pattern
    assert not md.shares_cores(_row("1f1b pp 2 m 8 timed"), shared)  # padded ranks sleep: they hold no core
    roomy = MachineCalibration.from_json(json.dumps({**SYNTHETIC, **MESSAGING, "cores": 8}))
    assert not md.shares_cores(row, roomy)  # a core for every rank
    pred, old = md.predict(row, shared), md.predict(row, cal)
    slow = md.contention(md.run_cluster(row, cal), row["world"])
    # each action is its own CPU: the replay shares the cores, so no contention factor is left on it
    assert pred["forward"] == pytest.approx([t / slow for t in old["forward"]], rel=1e-12)
    assert pred["backward"] == pytest.approx([t / slow for t in old["backward"]], rel=1e-12)
    assert sum(pred["terms"].values()) == pytest.approx(pred["predicted_s"], rel=1e-12)
    # two pipelines of two ranks on two cores: the step needs at least every rank's CPU and every message's over
    # the cores; the messages' CPU and the cold starts lengthen it over the same replay with free messages
    plan = schedule_plan("1f1b", 2, 8, 1)
    crossings = sum(1 for d in plan.dep if d >= 0 and d & 1)
    cpu = 2 * (sum(pred["busy"]) + crossings * (2 * shared.message_main_s + 2 * shared.message_transport_s))
    assert pred["schedule_s"] >= cpu / shared.cores
    assert pred["terms"]["pp"] > 0 and pred["terms"]["bubble"] >= 0
    quiet = shared.p2p_quiet[0] + shared.p2p_quiet[1] * 4 * 16 * 4
    assert pred["message"] == pytest.approx(max(quiet, 2 * (shared.message_transport_s + shared.message_main_s)))


def test_the_step_outside_the_schedule_is_counted_ops_at_measured_costs(cal):
    for name in ("1x1x1x4 zero 0", "1x1x1x4 zero 1", "2x1x1x1", "1f1b pp 2 m 4 unpadded"):
        row = _row(name)
        cluster = md.device_from(cal, row["world"])
        ops = md.step_ops(row)
        slow = md.contention(cluster, row["world"])
        outside = md.outside_schedule(row, cal, cluster)
        assert outside["optimizer"] == pytest.approx(ops.optimizer * md.optimizer_op_seconds(cal) * slow)
        gathers = sum(md.group_time("all_gather", b, 4, 1, cluster) for b in ops.report_gather_bytes)
        assert outside["reporting"] == pytest.approx(ops.reporting * cal.op_s * slow + gathers)
        assert outside["barrier"] == cal.barrier_seconds(row["world"])
        assert bool(ops.report_gather_bytes) == (name == "1x1x1x4 zero 1")  # ZeRO-1's report gathers its grads
        pred = md.predict(row, cal)
        assert pred["terms"]["reporting"] == outside["reporting"] and pred["terms"]["barrier"] == outside["barrier"]
    # the optimizer's op: the calibration's AdamW step over the ops counted in it (12 tensors, about 10 ops each)
    assert md.adamw_ops(tuple(map(tuple, SYNTHETIC["adamw_shapes"]))) == md.adamw_ops(((1,),) * 12) >= 120
    assert md.optimizer_op_seconds(cal) == pytest.approx(3e-4 / md.adamw_ops(((1,),) * 12))


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
    for kwargs in ({}, {"pp": 4, "micro_batches": 2}, {"cp": 4, "zero": 1}):
        first, second = (md.count_gpt_step_ops.__wrapped__(**kwargs) for _ in range(2))
        assert first == second and first.optimizer > 0 and first.reporting > 0
    # ZeRO-0 steps every tensor (AdamW, about ten ops each); ZeRO-1 one flat shard per bucket, but collects views
    whole, stage = md.count_gpt_step_ops(), md.count_gpt_step_ops(pp=4, micro_batches=2)
    assert whole.optimizer > stage.optimizer and whole.reporting > stage.reporting  # a stage holds fewer tensors
    mlp = md.count_mlp_step_ops.__wrapped__(8, 16, 4, 4, 2, 1)
    assert mlp == md.count_mlp_step_ops.__wrapped__(8, 16, 4, 4, 2, 1) and mlp.optimizer > 0 and mlp.reporting > 0


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
    assert all({"optimizer", "reporting", "barrier"} <= set(c["terms"]) for c in compared)
    assert f"of {len(names)} within" in str(md.comparison_table(compared))


def test_a_run_measured_again_gives_its_medians_their_spread_and_the_band_against_each(cal):
    names = ["1x1x4x1 zero 0", "1f1b pp 4 m 8 unpadded"]
    first = [_row(n, median=0.01) for n in names]
    compared = md.compare_runs(cal, first)
    pred = [c["predicted_s"] for c in compared]
    # measured again: the first run at exactly its prediction, the second at twice its first median
    again = [_row(names[0], median=pred[0]), _row(names[1], median=0.02)]
    out = md.with_repeats(compared, [again])
    assert [r["medians_s"] for r in out] == [[0.01, pred[0]], [0.01, 0.02]]
    assert out[0]["repeat_spread"] == pytest.approx(max(0.01, pred[0]) / min(0.01, pred[0]) - 1)
    assert out[1]["repeat_spread"] == pytest.approx(1.0)
    assert out[0]["within_repeats"]  # the prediction equals the second median
    assert out[1]["within_repeats"] == any(abs(pred[1] / m - 1) <= md.TOLERANCE for m in (0.01, 0.02))
    assert all(r["ratio"] == c["ratio"] for r, c in zip(out, compared))  # the ratio stays the first measurement's
    table = str(md.comparison_table(out))
    assert "measured again ms" in table and "100%" in table
    with pytest.raises(ValueError, match="repeat the same runs in order"):
        md.with_repeats(compared, [list(reversed(again))])


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


def test_several_launches_give_each_run_the_median_of_their_medians_and_each_launch_beside_it(cal):
    names = ["1x1x4x1 zero 0", "1f1b pp 4 m 8 unpadded"]
    launches = [[_row(n, median=m) for n, m in zip(names, medians)]
                for medians in ((0.010, 0.030), (0.014, 0.020), (0.012, 0.050))]
    rows = md.median_of_launches(launches)
    assert [r["measured_median_s"] for r in rows] == [0.012, 0.030]  # the median launch, per run
    assert [r["measured_spread"] for r in rows] == [r["measured_spread"] for r in launches[0]]  # still over steps
    out = md.with_repeats(md.compare_runs(cal, rows), launches)
    assert [r["medians_s"][1:] for r in out] == [[0.010, 0.014, 0.012], [0.030, 0.020, 0.050]]
    assert [r["measured_s"] for r in out] == [0.012, 0.030]
    assert out[1]["repeat_spread"] == pytest.approx(1.5)
    with pytest.raises(ValueError, match="repeat the same runs in order"):
        md.median_of_launches([launches[0], list(reversed(launches[1]))])
    with pytest.raises(ValueError, match="at least once"):
        md.median_of_launches([])


def test_the_launches_measured_on_a_slowed_host_are_left_out_of_the_median_when_quiet_ones_exist(cal):
    names = ["1x1x4x1 zero 0", "1f1b pp 4 m 8 unpadded"]
    slowdowns = ((1.0, 1.9), (1.8, 2.0), (1.1, 1.6))  # per launch, per run
    launches = [[{**_row(n, median=m), "host_slowdown": h} for n, m, h in zip(names, medians, hosts)]
                for medians, hosts in zip(((0.010, 0.030), (0.020, 0.020), (0.012, 0.050)), slowdowns)]
    rows = md.median_of_launches(launches)
    # the first run: launches 1 and 3 were quiet; the second: none was, so all three count
    assert [r["measured_median_s"] for r in rows] == [0.011, 0.030]
    assert [r["launches_used"] for r in rows] == [2, 3] and [r["host_slowdown"] for r in rows] == [1.1, 2.0]
    caption = md.comparison_table(md.compare_runs(cal, rows)).caption
    assert f"of the 1 measured with the host within {cal_mod.SLOW_HOST}x of its quickest" in caption
    assert "of the" not in md.comparison_table(md.compare_runs(cal, [_row(n) for n in names])).caption


def test_every_term_of_a_chapter_15_prediction_falls_in_one_part_of_the_step(cal):
    names = [s.name for s in default_runs(chapters=(15,))]  # the 4-rank layouts, the padded run, the 2-rank layouts
    compared = md.compare_runs(cal, [_row(n) for n in names])
    for c in compared:
        parts = c["predicted_parts_s"]
        assert list(parts) == list(md.STEP_PARTS) and all(v >= 0 for v in parts.values()), (c["name"], parts)
        assert sum(parts.values()) == pytest.approx(c["predicted_s"], rel=1e-12), c["name"]  # no term lost or doubled
        assert parts["sync"] == pytest.approx(c["terms"]["dp"] + c["terms"]["optimizer"], rel=1e-12)
    assert len({t for members in md.STEP_PARTS.values() for t in members}) == \
        sum(len(members) for members in md.STEP_PARTS.values())  # each term in one part only
    with pytest.raises(ValueError, match="'fp8 casts' belongs to no part"):
        md.step_parts({"matmul": 1.0, "fp8 casts": 0.1})
    table = str(md.parts_table(compared))
    assert all(n in table for n in names) and "schedule ms" in table


def test_the_measured_parts_are_per_step_medians_over_ranks_of_what_the_trainer_timed():
    # two ranks, three steps (the first is warm-up): step, schedule, sync and the waits inside the schedule
    ranks = [{"step_s": [9.0, 10.0, 12.0], "schedule_s": [5.0, 6.0, 7.0], "sync_s": [1.0, 2.0, 2.0],
              "comm_s": [{"cp": 0.0, "pp": 1.0}, {"cp": 3.0, "pp": 1.0}, {"cp": 4.0, "pp": 0.5}]},
             {"step_s": [9.0, 12.0, 14.0], "schedule_s": [5.0, 8.0, 9.0], "sync_s": [1.0, 1.0, 1.0],
              "comm_s": [{"cp": 0.0, "pp": 1.0}, {"cp": 1.0, "pp": 2.0}, {"cp": 2.0, "pp": 1.5}]}]
    parts = cal_mod.step_parts_measured(ranks, drop=1)
    # per step the median (here the mean) of the two ranks, then the median (mean) of steps 1 and 2
    assert parts == {"schedule": 7.5, "sync": 1.5, "outside": 3.0, "ring waits": 2.5, "pipeline waits": 1.25}
    no_waits = cal_mod.step_parts_measured([{k: r[k] for k in ("step_s", "schedule_s", "sync_s")} for r in ranks])
    assert set(no_waits) == {"schedule", "sync", "outside"}


def test_several_launches_give_each_part_the_median_of_the_same_launches(cal):
    # every part scales with the step (run_row's parts of made-up ranks); the last launch ran on a slowed host
    launches = [[{**_row("1x1x1x4 zero 0", median=0.01 * scale), "host_slowdown": host}]
                for scale, host in ((1.0, 1.0), (3.0, 1.0), (2.0, 1.0), (9.0, 2.0))]
    assert launches[0][0]["measured_parts_s"]["schedule"] == pytest.approx(0.01)
    (row,) = md.median_of_launches(launches)
    assert row["measured_median_s"] == pytest.approx(0.02)
    assert row["measured_parts_s"] == pytest.approx({k: 2 * v for k, v in launches[0][0]["measured_parts_s"].items()})
    (compared,) = md.compare_runs(cal, [row])
    assert compared["measured_parts_s"] == row["measured_parts_s"]


@pytest.mark.ranks
def test_a_measured_chapter_15_run_reports_where_its_step_went():
    spec = cal_mod.RunSpec(15, "1x1x1x2", cal_mod.CH15_WORKER, 2, cal_mod.ch15_params("1x1x1x2"))
    (row,) = cal_mod.measure_runs([spec], steps=4)
    parts = row["measured_parts_s"]
    assert set(parts) == {"schedule", "sync", "outside", "ring waits", "pipeline waits"}
    assert all(v >= 0 for v in parts.values()) and parts["schedule"] > 0 and parts["sync"] > 0
    assert parts["ring waits"] <= parts["schedule"] and parts["pipeline waits"] == 0.0  # a ring, no pipeline
    assert parts["schedule"] + parts["sync"] <= row["measured_spread"][1] * 1.001  # parts of the slowest step at most


# chapter 15's model timed in one process (calibration.calibrate: machine_device.time_gpt), whole and with its ring
TIMED_GPT = {"gpt": [[1, 4, 6e-3], [2, 8, 1.4e-2]]}


def test_without_timings_of_the_model_every_op_costs_what_the_linear_steps_op_costs(cal):
    assert md.gpt_op_prices(cal) == (md.op_seconds(cal), md.op_seconds(cal))


def test_the_models_and_the_rings_ops_price_their_timed_micro_batches_at_what_was_measured():
    timed = MachineCalibration.from_json(json.dumps({**SYNTHETIC, **TIMED_GPT}))
    model_op, ring_op = md.gpt_op_prices(timed)
    assert model_op > md.op_seconds(timed) and 0 < ring_op < model_op  # these timings: the ring's ops cost less
    for cp, mb, seconds in timed.gpt:
        row = md.gpt_timed_row(cp, mb)
        ops = md.total_ops(md.gpt_ops(row), row["model"]["layers"])
        assert md.work_alone(timed, row) + ops * md.gpt_op_seconds(row, timed) == pytest.approx(seconds, rel=1e-9)
    # a run's kernel overhead is its counted ops at that price, times the cores' contention
    row = _row("1x1x1x4 zero 0")
    pred = md.predict_gpt(row, timed)
    slow = md.contention(md.run_cluster(row, timed), row["world"])
    ops = md.total_ops(md.gpt_ops(row), 4) * row["micro_batches"]
    assert pred["terms"]["kernel overhead"] == pytest.approx(ops * md.gpt_op_seconds(row, timed) * slow, rel=1e-9)


def test_the_ring_is_priced_exchange_by_exchange_each_with_the_cpu_of_its_two_message_ends(cal, shared):
    row = _row("1x1x1x4 zero 0")
    cp, layers, m = 4, 4, row["micro_batches"]
    cluster = md.run_cluster(row, cal)
    one = md.group_time("send_recv", 2 * 8 * 16 / cp * 32 * 8, 2, 1, cluster)  # the rank's K and V, float64
    assert one == pytest.approx(cal.p2p_busy[0] + cal.p2p_busy[1] * 2 * 8 * 4 * 32 * 8)  # 4 ranks on 2 cores
    ring = md.predict_gpt(row, cal)["terms"]["cp"]
    # each layer's backward waits for its cp accumulator exchanges at once; the 2 (cp - 1) exchanges of K and V
    # are posted before the blocks they overlap, and hide behind them at most up to one exchange each
    assert layers * m * (cp + 2) * one <= ring <= layers * m * (3 * cp - 2) * one
    measured = md.predict_gpt(row, shared)["terms"]["kernel overhead"]
    end = shared.message_main_s + shared.message_transport_s
    slow = md.contention(cluster, row["world"])
    assert measured - md.predict_gpt(row, cal)["terms"]["kernel overhead"] == pytest.approx(
        layers * m * (3 * cp - 2) * 2 * end * slow, rel=1e-9)


def test_a_pipeline_stage_pays_the_cpu_of_each_message_it_receives_and_sends(cal, shared):
    row = _row("1x1x4x1 zero 0")
    end = shared.message_main_s + shared.message_transport_s
    slow = md.contention(md.run_cluster(row, cal), row["world"])
    quiet, busy = (md.predict_gpt(row, c)["step_time"] for c in (cal, shared))
    m = row["micro_batches"]
    # the first and last stage receive (send) only on one side, the middle two on both, forward and backward
    assert [b - a for a, b in zip(quiet.stage_busy, busy.stage_busy)] == pytest.approx(
        [m * 2 * ends * end * slow for ends in (1, 2, 2, 1)], rel=1e-9)


@pytest.mark.parametrize("cp", [2, 4])
def test_the_ring_makes_the_exchanges_the_planner_prices(cp, monkeypatch):
    rings = []
    loopback = md._loopback_ring
    monkeypatch.setattr(md, "_loopback_ring", lambda n: rings.append(loopback(n)) or rings[-1])
    with md._gpt_rank(32, 16, 32, 8, 4, 8, cp, "float64") as stage:
        forward, backward = stage(0, 1)
        forward()
        backward()
    assert rings[0].messages == {"forward": 4 * (cp - 1), "backward": 4 * (2 * cp - 1)}  # 4 layers


def test_timing_the_model_in_this_process_gives_a_positive_time_per_micro_batch():
    seconds = md.time_gpt(1, 4, bursts=2, passes=1, warm=1)
    assert seconds > 0 and math.isfinite(seconds)
