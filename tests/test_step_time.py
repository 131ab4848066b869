"""The planner's time model term by term (course_utils/step_time.py): each term does what its docstring says.

These are properties, not fits: the terms add up to the step, the pipeline bubble is chapter 13's simulated schedule
(and the textbook formula when stages are equal), overlap never hides more than the traffic or less than its last
bucket, uneven stages follow Llama 3's rule, FP8 and recomputation move the terms they should.
"""
import random

import pytest

from course_utils.device_rates import GemmRow, GemmTable, gemm_table
from course_utils.hardware import CLUSTERS, GPUS
from course_utils.ledger import pipeline_bubble_fraction
from course_utils.planner import Layout, ModelShape, plan, resolve_layout
from course_utils.step_time import (
    TERMS,
    Practice,
    exposed,
    group_time,
    held_stages,
    memory_bound_bytes,
    pipeline_makespan,
    stage_layers,
    step_time,
)
from workers.pipeline.schedules import all_stages, simulate
from workers.pipeline.validity import peak_stashes, simulate_split
from workers.pipeline.zero_bubble import placement_of, split_stages

H100 = CLUSTERS["h100-ib"]
# a model whose head and embedding are negligible next to a layer (vocab 64), so equal stages are equal in time
NARROW_VOCAB = ModelShape("no-head", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=64)


def _timed(model, layout, n, practice=Practice(), cluster=H100):
    lay = resolve_layout(model, layout, n)
    return lay, step_time(model, lay, n, cluster, practice)


def test_gemm_table_returns_measured_rows_and_interpolates_between_them():
    rows = (GemmRow(1024, 1024, 1024, 100e12), GemmRow(4096, 4096, 4096, 400e12))
    t = GemmTable("test", "bf16", rows)
    assert t.rate(1024, 1024, 1024) == 100e12 and t.rate(4096, 4096, 4096) == 400e12
    middle = t.rate(2048, 2048, 2048)
    assert 100e12 < middle < 400e12 and middle == pytest.approx(200e12, rel=1e-6)  # geometric blend, log2 halfway
    assert t.rate(64, 64, 64) == 100e12 and t.rate(1 << 16, 1 << 16, 1 << 16) == 400e12  # clamped, not extrapolated
    for device in ("a100-sxm-80gb", "h100-sxm"):  # the committed table has every device the clusters name
        table = gemm_table(device)
        assert table.best <= {"a100-sxm-80gb": GPUS["a100"], "h100-sxm": GPUS["h100"]}[device].peak_flops


def test_terms_add_up_to_the_step_and_every_term_is_named():
    lay, st = _timed(NARROW_VOCAB, Layout(tp=4, pp=4, dp=4, zero=1, micro_batches=8, sequence_parallel=True), 64)
    assert set(st.terms) == set(TERMS)
    assert st.total == pytest.approx(sum(st.terms.values()))
    assert all(v >= 0 for v in st.terms.values()) and all(v >= 0 for v in st.hidden.values())
    assert 0 < st.comm_share < 1 and 0 < st.mfu < 1


@pytest.mark.parametrize("schedule, p, m, v", [("1f1b", 4, 8, 1), ("gpipe", 4, 16, 1), ("interleaved", 4, 8, 2)])
def test_bubble_is_chapter_13s_schedule_simulated_and_the_formula_for_equal_stages(schedule, p, m, v):
    # The bubble comes from simulating the very action lists chapter 13's ranks execute; with equal stages and free
    # messages it is the textbook (p-1)/(v m) of the busy time (Narayanan et al. 2021, sec 2.2).
    lay, st = _timed(NARROW_VOCAB, Layout(pp=p, dp=1, micro_batches=m, virtual_stages=v, schedule=schedule), p)
    busy = max(st.stage_busy)
    assert st.terms["bubble"] == pytest.approx(busy * pipeline_bubble_fraction(p, m, v), rel=0.02)
    per_stage_f = busy / m / 3  # B = 2F in the simulator's ideal check below; only the ratio matters
    sim = simulate(all_stages(schedule, p, m, v), per_stage_f, 2 * per_stage_f)
    assert sim["makespan"] / (3 * per_stage_f * m) == pytest.approx(1 + pipeline_bubble_fraction(p, m, v), rel=1e-9)


@pytest.mark.parametrize("schedule, p, v", [("1f1b", 4, 1), ("gpipe", 4, 1), ("interleaved", 4, 2),
                                            ("interleaved", 8, 3), ("1f1b", 8, 1)])
def test_a_long_pipeline_is_its_simulation_extended_along_the_steady_state(schedule, p, v):
    # pipeline_makespan simulates 4p and 8p micro-batches and extends the line; on stages of random, unequal
    # forward and backward times, with and without message latency, it stays within 0.1% of simulating every one
    rng = random.Random(p * 10 + v)
    f = [1 + rng.random() for _ in range(p * v)]
    b = [2 * x + rng.random() for x in f]
    for m in (9 * p * v, 13 * p * v, 20 * p * v):
        for message in (0.0, 0.3):
            full = simulate(all_stages(schedule, p, m, v if schedule == "interleaved" else 1), f, b, message)
            assert pipeline_makespan(schedule, p, m, v, f, b, message) == pytest.approx(full["makespan"], rel=1e-3)


def test_the_makespan_alone_is_the_same_number_as_with_the_timeline():
    # the planner asks simulate for the makespan only (boxes=False: no timeline of a published run's hundreds of
    # thousands of actions); the number is the very float the full simulation gives, deadlocks named the same way
    rng = random.Random(7)
    for schedule, p, m, v in (("1f1b", 4, 12, 1), ("gpipe", 3, 5, 1), ("interleaved", 4, 8, 3)):
        f = [1 + rng.random() for _ in range(p * v)]
        b = [2 * x + rng.random() for x in f]
        for message in (0.0, 0.3):
            rows = all_stages(schedule, p, m, v)
            full, alone = simulate(rows, f, b, message), simulate(rows, f, b, message, boxes=False)
            assert alone == {"timeline": None, "makespan": full["makespan"], "span_idle": None, "deadlock": None}
            assert full["timeline"] and full["deadlock"] is None
    stuck = [[("B", 0), ("F", 0)], [("F", 0), ("B", 0)]]
    assert simulate(stuck, boxes=False)["deadlock"] == simulate(stuck)["deadlock"] is not None


@pytest.mark.parametrize("schedule, p, m", [("zb-h1", 4, 8), ("zb-h2", 4, 8), ("zb-v", 4, 8), ("dualpipev", 4, 8),
                                            ("zb-v", 2, 5)])
def test_zero_bubble_schedules_are_priced_from_the_tables_the_ranks_execute(schedule, p, m):
    # One source of truth: the planner's bubble is chapter 13's own split-backward table replayed with the step's
    # per-stage times and W = Practice.w_share of each backward; ZB-V and DualPipeV place chunks in a V (rank 0
    # holds the first and the last virtual stage, the embedding and the head).
    v = 2 if schedule in ("zb-v", "dualpipev") else 1
    lay, st = _timed(NARROW_VOCAB, Layout(pp=p, dp=1, micro_batches=m, virtual_stages=v, schedule=schedule), p)
    _, one_f = _timed(NARROW_VOCAB, Layout(pp=p, dp=1, micro_batches=m, schedule="1f1b"), p)
    f = [1.0 + 0.1 * vs for vs in range(p * v)]  # unequal stages: each virtual stage its own times
    b = [2 * x for x in f]
    table = split_stages(schedule, p, m)
    replay = simulate_split(table, f, [x / 2 for x in b], [x / 2 for x in b], placement=placement_of(schedule))
    assert pipeline_makespan(schedule, p, m, v, f, b, 0.0) == replay["makespan"]
    assert st.terms["bubble"] < one_f.terms["bubble"] / 2  # W fills most of 1F1B's bubble (T_F = T_B = T_W here)
    busy = max(st.stage_busy)
    if schedule == "zb-h1":  # Qi et al. 2023, sec 2: (p-1)(T_F + T_B - T_W) with T_B = T_W: (p-1) T_F per step
        assert st.terms["bubble"] == pytest.approx((p - 1) * busy / m / 3, rel=0.02)
    assert held_stages(schedule, 0, p, v) == ([0, 2 * p - 1] if v == 2 else [0])
    assert held_stages("interleaved", 1, 4, 2) == [1, 5]
    # memory from the same table: what a rank holds from a forward until its W, in micro-batches' worth
    mem = plan(NARROW_VOCAB, lay, p, cluster_name=H100, timed=False).memory["activations"]
    one = plan(NARROW_VOCAB, resolve_layout(NARROW_VOCAB, Layout(pp=p, dp=1, micro_batches=m, schedule="1f1b"), p),
               p, cluster_name=H100, timed=False).memory["activations"]
    held = max(peak_stashes(row)["held"] for row in table) / v
    assert mem == pytest.approx(one * held / min(p, m)) and mem >= one


def test_uneven_stages_follow_llama_3_and_are_priced():
    # Llama 3, sec 3.3.2: 126 layers on 16 stages, one layer fewer on the first and the last stage.
    assert stage_layers(126, 16) == [7] + [8] * 14 + [7]
    assert stage_layers(128, 16) == [8] * 16
    assert sum(stage_layers(105, 105)) == 105 and stage_layers(10, 4) == [2, 3, 3, 2]
    model = ModelShape("405B-like", layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, vocab=128_256)
    lay, st = _timed(model, Layout(tp=8, pp=16, dp=1, micro_batches=32, virtual_stages=2, schedule="interleaved",
                                   sequence_parallel=True), 128)
    assert st.terms["bubble"] > 0 and st.total > 0  # interleaving 126 layers over 32 chunks is a layout now


def test_overlap_hides_at_most_the_traffic_and_never_the_last_bucket():
    assert exposed(10.0, 4.0, 1.0) == 6.0  # does not fit: what is left after the window
    assert exposed(10.0, 40.0, 1.0) == 1.0  # fits: the last bucket still waits
    assert exposed(0.5, 40.0, 1.0) == 0.5 and exposed(0.0, 1.0, 1.0) == 0.0
    model = NARROW_VOCAB
    lay = Layout(dp=64, zero=1, micro_batches=4)
    on = _timed(model, lay, 64, Practice(grad_overlap=True, param_gather_overlap=True))[1]
    off = _timed(model, lay, 64, Practice(grad_overlap=False, param_gather_overlap=False))[1]
    assert off.hidden["dp"] == pytest.approx(0.0, abs=1e-12)
    assert on.terms["dp"] < off.terms["dp"]
    assert on.terms["dp"] + on.hidden["dp"] == pytest.approx(off.terms["dp"])  # the same traffic, less of it exposed


def test_hierarchical_groups_cross_the_fabric_with_a_share_of_the_bytes():
    # 8 ranks 1 apart fit in a node (NVLink); 16 ranks 8 apart put one per node (the fabric, every byte); 16 ranks
    # 4 apart put two per node: reduce-scatter inside, half the bytes across on two NICs, all-gather inside.
    nbytes = 1e9
    inside = group_time("all_reduce", nbytes, 8, 1, H100)
    across = group_time("all_reduce", nbytes, 16, 8, H100)
    two_per_node = group_time("all_reduce", nbytes, 16, 4, H100)
    assert inside < two_per_node < across


def test_memory_bound_bytes_count_the_passes_the_docstring_names():
    gpt = ModelShape("gpt", layers=1, hidden=1024, heads=16, kv_heads=16, ffn=4096, vocab=1000, mlp="gelu")
    lay = Layout(tp=1, micro_batch=1, seq=2048)
    plain = memory_bound_bytes(gpt, lay, Practice(flash_attention=True))
    tokens, h = 2048, 1024
    assert plain["norms"] == 8 * h * tokens  # two LayerNorms, read + write, 2 bytes
    assert plain["residual"] == 14 * h * tokens  # two bias-dropout-adds
    assert plain["activation"] == 4 * 4096 * tokens and plain["rope"] == 0 and plain["softmax"] == 0
    unfused = memory_bound_bytes(gpt, lay, Practice(flash_attention=False))
    assert unfused["softmax"] == 9 * 16 * 2048 * tokens  # scores read and written, with dropout's mask and pass


def test_recompute_and_fp8_move_the_terms_they_should():
    base = Layout(tp=8, dp=8, zero=1, sequence_parallel=True, micro_batches=2)
    sel = _timed(NARROW_VOCAB, Layout(**{**base.as_dict(), "recompute": "selective"}), 64,
                 Practice(flash_attention=False))[1]
    full = _timed(NARROW_VOCAB, Layout(**{**base.as_dict(), "recompute": "full"}), 64)[1]
    none = _timed(NARROW_VOCAB, Layout(**{**base.as_dict(), "recompute": "none"}), 64)[1]
    assert none.terms["recompute"] == 0 and 0 < sel.terms["recompute"] < full.terms["recompute"]
    # full recomputation reruns the forward and its TP collectives: a third to a half of compute + TP again
    assert 0.25 < full.terms["recompute"] / (none.compute + none.terms["tp"]) < 0.5
    fp8 = _timed(NARROW_VOCAB, Layout(**{**base.as_dict(), "recompute": "none"}), 64, Practice(dtype="fp8"))[1]
    assert fp8.terms["matmul"] < 0.6 * none.terms["matmul"] and fp8.terms["memory-bound"] > none.terms["memory-bound"]


def test_plan_reports_the_breakdown_and_the_communication_share():
    p = plan("70B", Layout(tp=8, pp=4, zero=1, sequence_parallel=True), 256, global_batch=256)
    assert p.step_time_s == pytest.approx(p.time.total)
    assert p.comm_share == pytest.approx(sum(p.comm_time_s.values()) / p.step_time_s)
    text = p.summary()
    assert "matmul" in text and "communication" in text and "hidden behind compute" in text


def test_a_measured_link_prices_a_collective_it_did_not_measure_from_its_nearest_fit():
    # a calibrated machine's link holds (collective, ranks, alpha, beta) fits; one it lacks is scaled from the
    # nearest group size of the same collective, or from any fit when that collective was never measured
    from course_utils.hardware import Link
    from course_utils.step_time import link_time

    link = Link("gloo", 1e9, 1e-5, "test", fitted=(("all_reduce", 2, 1e-4, 1e-9), ("all_gather", 4, 2e-4, 2e-9)))
    assert link_time("all_reduce", 1000, 2, link) == pytest.approx(1e-4 + 1e-6)
    assert link_time("all_reduce", 1000, 4, link) > link_time("all_reduce", 1000, 2, link)
    assert link_time("send_recv", 1000, 2, link) > 0  # never measured: priced from the nearest fit, not a crash


def test_ulysses_loss_parallel_and_overlapped_tp_are_priced():
    # Ulysses (chapter 14): four all-to-alls per layer each way, q, k, v out and back, none hidden; the ring hides its
    # exchange behind the blocks. A Llama-3-8B-like shape at cp 4, tp 1: 32 heads, 8 KV heads
    model = ModelShape("8B-like", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128_256)
    lay = Layout(cp=4, dp=1, micro_batches=1, seq=32_768)
    _, ring = _timed(model, lay, 4)
    _, uly = _timed(model, lay, 4, Practice(cp_attention="ulysses"))
    rows = 1 * 32_768 / 4 * model.head_dim * 2.0  # bf16 rows of one head on one rank
    one_layer = group_time("all_to_all", (32 + 2 * 8) * rows, 4, 1, H100) + group_time("all_to_all", 32 * rows, 4, 1, H100)
    assert uly.terms["cp"] == pytest.approx(2 * one_layer * model.layers)  # forward and backward, every layer
    assert ring.hidden["cp"] > 0 and uly.hidden["cp"] == 0.0
    with pytest.raises(ValueError, match="cp=3 does not divide the 32 query heads"):
        _timed(model, Layout(cp=3, dp=1, micro_batches=1, seq=30_720), 3, Practice(cp_attention="ulysses"))
    # without loss parallelism the last stage all-gathers [s, b, V] over TP and softmaxes all of it
    tp_lay = Layout(tp=8, dp=1, micro_batches=1, seq=8192, sequence_parallel=True)
    _, split = _timed(model, tp_lay, 8)
    _, gathered = _timed(model, tp_lay, 8, Practice(loss_parallel=False))
    logits_gather = group_time("all_gather", 8192 * model.vocab * 2.0, 8, 1, H100)
    assert gathered.terms["tp"] - split.terms["tp"] == pytest.approx(logits_gather)
    assert gathered.terms["memory-bound"] > split.terms["memory-bound"]
    # collective matmul: TP's exposed time falls, by what the GEMMs hide, never below one ring step per collective
    _, overlapped = _timed(model, tp_lay, 8, Practice(tp_overlap=True))
    assert overlapped.terms["tp"] < split.terms["tp"] and overlapped.hidden["tp"] > 0
    assert overlapped.terms["tp"] >= split.terms["tp"] / 8 - 1e-12
    assert overlapped.total < split.total


def test_sequence_parallel_turns_each_tp_all_reduce_into_an_all_gather_and_a_reduce_scatter():
    # Korthikanti et al. 2022 sec 4.2.2: a layer's two all-reduces per pass become two all-gathers and two
    # reduce-scatters (g and g-bar), the same bytes. 4 of each per layer per micro-batch, forward and backward.
    lay, sp = _timed(NARROW_VOCAB, Layout(tp=8, dp=1, micro_batches=1, seq=4096, sequence_parallel=True), 8)
    msg = lay.micro_batch * 4096 * NARROW_VOCAB.hidden * 2.0  # one bf16 [s, b, h] activation
    one_pass = 2 * (group_time("all_gather", msg, 8, 1, H100) + group_time("reduce_scatter", msg, 8, 1, H100))
    assert sp.terms["tp"] == pytest.approx(2 * one_pass * NARROW_VOCAB.layers)
    _, ar = _timed(NARROW_VOCAB, Layout(tp=8, dp=1, micro_batches=1, seq=4096), 8)
    # the same bytes as without SP: within the launch latency of the extra collectives
    assert sp.terms["tp"] == pytest.approx(ar.terms["tp"], rel=0.25)


def test_a_device_that_timed_its_kernels_prices_attention_and_gelu_from_those_times():
    """A calibrated CPU's fused attention is not FlashAttention's share of its matmul rate (a tiny call costs its
    setup per head) and its float64 GELU is not bytes over bandwidth (erf is compute-bound): the times it measured
    replace both, interpolated along batch x heads and elements; a device without them is priced as before."""
    import dataclasses

    from course_utils.step_time import attention_seconds, interpolated, timed_attention

    assert interpolated([(8, 1.0), (64, 8.0)], 8) == 1.0 and interpolated([(8, 1.0), (64, 8.0)], 36) == 4.5
    assert interpolated([(8, 1.0), (64, 8.0)], 128) == 16.0  # past the last point: the last segment extended
    assert interpolated([(8, 1.0), (64, 8.0)], 1) == 0.125 and interpolated([(8, 1.0), (64, 1.0 + 56)], 0) == 0.0
    assert interpolated([(10, 2.0)], 5) == 1.0
    rows = ((8, 16, 4, 30e-6, 110e-6), (64, 16, 4, 220e-6, 620e-6), (16, 128, 32, 2e-3, 7e-3))
    assert timed_attention(rows, 64, 16, 4) == (220e-6, 620e-6)
    assert timed_attention(rows, 36, 16, 4) == pytest.approx((125e-6, 365e-6))
    assert timed_attention(rows, 32, 128, 32) == pytest.approx((4e-3, 14e-3))  # nearest row in work, scaled
    gpt = ModelShape("gpt", layers=4, hidden=32, heads=8, kv_heads=8, ffn=128, vocab=32, mlp="gelu")
    practice = Practice(dtype="float64", activation_bytes=8.0, grad_bytes=8.0, dropout=False)
    gpu = dataclasses.replace(H100.gpu, overhead_serial=True, gemm_rows=(("float64", 8, 32, 32, 5e9),
                                                                          ("float64", 256, 256, 256, 4e10)))
    timed_gpu = dataclasses.replace(gpu, attention_rows=tuple(("float64", *r) for r in rows),
                                    activation_rows=(("float64", 1024, 20e-6, 60e-6), ("float64", 16384, 3e-4, 7e-4)))
    plain, timed = (dataclasses.replace(H100, gpu=g) for g in (gpu, timed_gpu))
    lay = resolve_layout(gpt, Layout(dp=1, micro_batch=8, seq=16), 1)
    table = gemm_table(gpu.gemm, "bf16")  # FlashAttention's share of an H100's bf16 rate, without timed rows
    assert attention_seconds(gpt, lay, table, practice, timed=rows) == pytest.approx((220e-6, 400e-6))
    assert attention_seconds(gpt, lay, table, practice)[0] < 1e-6  # FlashAttention's share of an H100: far less
    a, b = step_time(gpt, lay, 1, plain, practice), step_time(gpt, lay, 1, timed, practice)
    assert b.terms["attention"] == pytest.approx(4 * 620e-6)  # 4 layers, one micro-batch, forward + backward
    # the GELU's bytes leave the memory-bound term and its timed forward + backward (8 x 16 x 128 elements) come in
    act_bytes = memory_bound_bytes(gpt, lay, practice)["activation"]
    bw = gpu.memory_bandwidth * gpu.stream_efficiency
    assert b.terms["memory-bound"] - a.terms["memory-bound"] == pytest.approx(4 * (7e-4 - 3 * act_bytes / bw))
    assert {k: v for k, v in a.terms.items() if k not in ("attention", "memory-bound", "kernel overhead")} == \
        pytest.approx({k: v for k, v in b.terms.items() if k not in ("attention", "memory-bound", "kernel overhead")})
