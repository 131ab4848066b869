"""Chapter 00's helpers draw and tabulate exactly what the ledger and planner compute.

The formulas themselves are tested against their papers in test_ledger.py and test_planner.py; here we check
that the chapter shows those numbers (bars as tall as the plan's bytes, bubble curves equal to the formula, the
partition table's message sizes equal to the ledger's), that the widget is wired to the planner, and that the
claims the notebook's prose makes still hold for the numbers it prints.
"""
import inspect

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from course_utils import ch00, reference_data  # noqa: E402
from dataclasses import replace  # noqa: E402

from course_utils.ledger import GB, pipeline_bubble_fraction, tp_comm_bytes_per_layer  # noqa: E402
from course_utils.planner import (CLUSTERS, Practice, Layout, LayoutError, all_to_all_bytes,  # noqa: E402
                                  ep_rank_parameters, model_shape, plan, zero_collectives_per_step)
from course_utils.published_configs import DEEPSEEK_V3, MIXTRAL_8X7B, PUBLISHED_CONFIGS  # noqa: E402


def test_partition_table_covers_every_parallelism_with_the_ledgers_message_sizes():
    table = ch00.partition_table("70B", tp=8, cp=2, pp=4, seq=8192)
    names = [r[0] for r in table.rows]
    for expected in ("DP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "TP", "SP", "CP", "PP", "EP"):
        assert any(n.startswith(expected) for n in names), expected
    tp_row = next(r for r in table.rows if r[0] == "TP")
    # TP all-reduces one [b, s/cp, h] bf16 activation: 1 x 4096 x 8192 x 2 bytes = 64 MiB.
    message = tp_comm_bytes_per_layer(1, 8192 // 2, 8192, 8).message_bytes
    assert tp_row[4] == f"{message / 2**20:,.0f} MiB" == "64 MiB"
    dp_row = next(r for r in table.rows if r[0].startswith("DP"))
    # DDP all-reduces the bf16 gradients of the model slice a GPU holds: 2 bytes x n_params / (tp x pp).
    assert dp_row[4] == f"{2 * model_shape('70B').n_params / 32 / 2**20:,.0f} MiB"
    # PP sends one micro-batch's activation, the CP rank's s/cp tokens, 1/tp of it with scatter/gather:
    # 1 x 4096 x 8192 x 2 / 8 = 8 MiB; EP's all_to_all carries top-2 copies of those tokens: 128 MiB, of which
    # 7/8 leave the rank at ep=8 under uniform routing (planner.all_to_all_bytes): 112 MiB.
    pp_row = next(r for r in table.rows if r[0] == "PP")
    ep_row = next(r for r in table.rows if r[0].startswith("EP"))
    assert all_to_all_bytes(1 * 8192 // 2, 8192, 2, 8, 2) == 112 * 2**20
    assert pp_row[4].startswith("8 MiB"), pp_row[4]
    assert ep_row[4] == "128 MiB (112 MiB leave the rank at ep=8)", ep_row[4]
    text, html = str(table), table._repr_html_()
    assert "all_reduce of activations" in text and "<table>" in html and "all_to_all" in html


def test_partition_table_counts_zero_collectives_as_the_planner_does():
    # One convention in both places (planner.zero_collectives_per_step): DDP and ZeRO-1 keep full gradients and
    # reduce once per step; ZeRO-2 and ZeRO-3 keep a shard and reduce-scatter after every micro-batch; ZeRO-3
    # also gathers each layer for its forward and its backward. The table once said "3 per layer per micro-batch"
    # while the planner reduced once per step; now the how-often column is read off the planner's counts.
    rows = {r[0]: r[5] for r in ch00.partition_table("70B").rows}
    assert rows["DP (DDP)"] == "1 all_reduce per step"
    assert rows["ZeRO-1"] == "1 reduce_scatter per step, 1 all_gather per step"
    assert rows["ZeRO-2"] == "1 reduce_scatter per micro-batch, 1 all_gather per step"
    assert rows["ZeRO-3 / FSDP"] == "2 all_gather per layer per micro-batch, 1 reduce_scatter per layer per micro-batch"
    assert zero_collectives_per_step(3, 4) == {"all_reduce": 0, "reduce_scatter": 4, "all_gather": 8}


def test_memory_bars_are_as_tall_as_the_plans_bytes_with_the_gpu_line():
    plans = [plan("70B", Layout(tp=8, pp=4, zero=1, sequence_parallel=True), 256), plan("70B", Layout(tp=1, zero=0, sequence_parallel=True), 256)]
    ax = ch00.memory_bars(plans, ["fits", "does not"])
    tops = [0.0, 0.0]
    for patch in ax.patches:  # stacked: the highest edge of each bar is the sum of the four states
        i = round(patch.get_x() + patch.get_width() / 2)
        tops[i] = max(tops[i], patch.get_y() + patch.get_height())
    assert tops == pytest.approx([p.total_memory_bytes / GB for p in plans])
    gpu_lines = [c.get_segments()[0] for c in ax.collections]  # one dashed hline per plan: its GPU memory
    assert [seg[0][1] for seg in gpu_lines] == pytest.approx([p.gpu_memory_bytes / GB for p in plans])
    texts = [t.get_text() for t in ax.texts]
    assert texts == ["fits", "does NOT fit"]
    assert ax.get_yscale() == "linear"  # stacked shares are only read right on a linear axis
    plt.close("all")


def test_zoomed_memory_bars_stay_linear_and_draw_every_bar_whole():
    # The 70B figure zooms to 130 GB so that DDP's 1.2 TB bar does not flatten the others against the 80 GB
    # line; a full-scale linear panel above shows every bar whole, so no segment's share is distorted (a log
    # axis, which the figure once used, made DDP's 69% of optimizer states look like a thin band).
    ddp, fsdp, base = (plan("70B", lay, 256) for lay in (Layout(zero=0), Layout(zero=3),
                                                          Layout(tp=8, pp=4, zero=1, sequence_parallel=True)))
    totals = [p.total_memory_bytes / GB for p in (ddp, fsdp, base)]
    ax = ch00.memory_bars([ddp, fsdp, base], ["ddp", "fsdp", "tp8 pp4"], zoom_gb=130)
    for panel in (ax, ax.upper):
        tops = [0.0] * 3
        for patch in panel.patches:
            i = round(patch.get_x() + patch.get_width() / 2)
            tops[i] = max(tops[i], patch.get_y() + patch.get_height())
        assert tops == pytest.approx(totals)  # bars are never clipped, only the view is
        assert panel.get_yscale() == "linear" and panel.get_ylim()[0] == 0
    assert ax.get_ylim()[1] == 130 and ax.upper.get_ylim()[1] > totals[0]
    optimizer = [p for p in ax.upper.patches if p.get_facecolor()[:3] == matplotlib.colors.to_rgb("#55A868")][0]
    assert optimizer.get_height() / totals[0] == pytest.approx(ddp.memory["optimizer"] / ddp.total_memory_bytes)
    assert [t.get_text() for t in ax.upper.texts if "fit" in t.get_text()] == ["does NOT fit"]  # DDP's verdict
    assert [t.get_text() for t in ax.texts if "fit" in t.get_text()] == ["does NOT fit", "fits"]
    plt.close("all")


def test_time_bars_sum_to_the_step_and_print_batch_throughput_and_mfu():
    plans = [plan("70B", Layout(tp=8, zero=1, sequence_parallel=True), 256), plan("70B", Layout(tp=8, pp=4, zero=1, sequence_parallel=True), 256)]
    ax = ch00.time_bars(plans, ["tp8", "tp8 pp4"])
    ends = [0.0, 0.0]
    for patch in ax.patches:
        i = round(patch.get_y() + patch.get_height() / 2)
        ends[i] = max(ends[i], patch.get_x() + patch.get_width())
    assert ends == pytest.approx([p.step_time_s for p in plans])
    texts = [t.get_text() for t in ax.texts]
    for p, text in zip(plans, texts):
        assert f"{p.sequences_per_step} seq" in text and f"MFU {100 * p.mfu:.0f}%" in text
    plt.close("all")


def test_bubble_figure_draws_the_formula_for_both_denominators():
    fig = ch00.bubble_figure(ps=(4,), vs=(1,), max_m=16)
    ideal, total = (ax.get_lines()[0] for ax in fig.axes)
    for m, y in zip(ideal.get_xdata(), ideal.get_ydata()):
        assert y == pytest.approx(pipeline_bubble_fraction(4, int(m)))  # (p-1)/m
    for m, y in zip(total.get_xdata(), total.get_ydata()):
        assert y == pytest.approx(3 / (m + 3))  # (p-1)/(m+p-1)
    plt.close(fig)


def test_tp_layer_times_are_the_step_models_layer():
    # The section 7 comparison prices one layer as the planner does: PaLM's 6N + 12 L H Q T per token for one layer
    # (Megatron's 3 x (2 P b s + 4 b s^2 h), split over tp) at a rate between a third of the H100's peak and its peak
    m, b, s, tp = model_shape("70B"), 1, 4096, 8
    by_hand = 3 * (2 * m.params_per_layer * b * s + 4 * b * s * s * m.hidden) / tp
    t = ch00.tp_layer_times("70B", tp=tp)
    rate = by_hand / t["compute_s"]
    assert CLUSTERS["h100-ib"].gpu.peak_flops / 3 < rate < CLUSTERS["h100-ib"].gpu.peak_flops


def test_tp_costs_less_than_its_matmuls_on_nvlink_and_more_across_nodes():
    # The notebook's claim in section 7, for Llama 3 70B at tp=8, one 4096-token micro-batch.
    t = ch00.tp_layer_times("70B", tp=8)
    assert t["comm_s"]["nvlink4"] < 0.5 * t["compute_s"]
    assert t["comm_s"]["ib-ndr400"] > t["compute_s"]
    assert t["all_reduces"] == 4 and t["message_bytes"] == 4096 * 8192 * 2


def test_bandwidth_figure_reads_the_published_h200_sweep():
    rows, _ = reference_data.published_allreduce()
    assert max(r["busbw"] for r in rows) == pytest.approx(482.26e9)
    fig = ch00.bandwidth_figure()
    assert len(fig.axes) == 2
    plt.close(fig)


def test_planner_widget_controls_are_the_planner_views_parameters():
    box = ch00.planner_widget()
    assert set(box.controls) == set(inspect.signature(ch00.planner_view).parameters)
    values = {name: c.value for name, c in box.controls.items()}
    p = ch00.planner_view(**values)
    assert p.fits and p.layout.dp == 256 // (8 * 4)
    copies = ch00.planner_view(**{**values, "tp": 16, "pp": 2})  # valid: each of the 8 KV heads on 2 ranks
    assert any("copied onto 2 ranks" in n for n in copies.notes) and any("more than one" in n for n in copies.notes)
    with pytest.raises(LayoutError, match="tp=3 does not divide heads=64"):
        ch00.planner_view(**{**values, "tp": 3, "pp": 1, "n_gpus": 3 * 64})
    slow = ch00.planner_view(**{**values, "inter_node": "ethernet100"})
    assert slow.comm_time_s["dp"] > p.comm_time_s["dp"]  # the network control reaches the plan
    plt.close("all")


def test_published_table_checks_only_what_was_printed():
    # The product column says "ok" or "MISMATCH" where all four degrees are as printed; for the two rows whose
    # DP was derived from the rule (OPT prints none; Llama 3's 128K row was picked between printed 8 and 4), it
    # cannot fail, and it says so instead of printing an "ok" that checked nothing.
    table = ch00.published_table()
    cells = {row[0]: row[-1] for row in table.rows}
    derived = {c.name for c in PUBLISHED_CONFIGS if c.derived}
    assert derived == {"OPT-175B", "Llama 3 405B, 16K GPUs, 128K context"}
    for c in PUBLISHED_CONFIGS:
        assert cells[c.name] == (f"{c.product}, not a check: {c.derived}" if c.derived else f"{c.product} ok")
    assert "sec 6.3" in table.caption  # the source of the 2240-GPU row
    wrong = replace(PUBLISHED_CONFIGS[4], dp=4)  # a typo in a printed degree shows up
    assert ch00.product_check(wrong) == "1120 MISMATCH"


def test_notebook_claims_about_the_70b_layouts():
    # Section 5's prose, every layout on the same 256-sequence global batch: DDP needs over a terabyte (69%
    # optimizer states), FSDP alone does not fit, the TP layouts do and are within a few percent (TP8's exposed
    # gradient reduction about as long as TP8 PP4's bubble); no recomputation takes the same time and memory
    # (FlashAttention never stores the scores); storing them, as 2022's kernels did, holds about 65 GB of
    # activations, 78 GB in all; full recomputation is about a third slower.
    def at(layout):
        return plan("70B", layout, 256, global_batch=256)

    ddp, fsdp = at(Layout(zero=0)), at(Layout(zero=3))
    tp8, base = at(Layout(tp=8, zero=1, sequence_parallel=True)), at(Layout(tp=8, pp=4, zero=1, sequence_parallel=True))
    none = at(Layout(tp=8, pp=4, zero=1, recompute="none", sequence_parallel=True))
    full = at(Layout(tp=8, pp=4, zero=1, recompute="full", sequence_parallel=True))
    every = (ddp, fsdp, tp8, base, none, full)
    assert {p.sequences_per_step for p in every} == {256}
    assert ddp.total_memory_bytes > 1e12 and not ddp.fits and round(ddp.memory["optimizer"] / ddp.total_memory_bytes, 2) == 0.69
    assert not fsdp.fits and fsdp.memory["activations"] > fsdp.memory["optimizer"]
    assert tp8.fits and base.fits and none.fits and full.fits
    assert 0.94 < base.tokens_per_second / tp8.tokens_per_second < 1.06
    assert 0.5 < tp8.comm_time_s["dp"] / base.bubble_time_s < 2  # "about half a second", "about as long"
    assert 0.35 < tp8.comm_time_s["dp"] < 0.7 and 4 * base.hidden_comm_s["dp"] > 0
    assert none.tokens_per_second == pytest.approx(base.tokens_per_second)
    assert none.total_memory_bytes == pytest.approx(base.total_memory_bytes)
    stored = plan("70B", Layout(tp=8, pp=4, zero=1, recompute="none", sequence_parallel=True), 256, global_batch=256,
                  practice=Practice(flash_attention=False))
    assert 60e9 < stored.memory["activations"] < 70e9 and round(stored.total_memory_bytes / GB) == 78
    assert 1.2 < full.step_time_s / base.step_time_s < 1.45
    names = {"TP8 + ZeRO-1": tp8, "TP8 PP4 + ZeRO-1": base, "DDP": ddp}
    assert ch00.fastest_fitting(names) in ("TP8 + ZeRO-1", "TP8 PP4 + ZeRO-1")


def test_the_per_step_trap_the_notebook_shows():
    # With the planner's default m, TP8 + ZeRO-1 (32 sequences) takes under half the seconds per step of TP8 PP4
    # (128 sequences) but delivers about a third fewer tokens per second: step times of different batches are no race.
    tp8, base = plan("70B", Layout(tp=8, zero=1, sequence_parallel=True), 256), plan("70B", Layout(tp=8, pp=4, zero=1, sequence_parallel=True), 256)
    assert (tp8.sequences_per_step, base.sequences_per_step) == (32, 128)
    assert tp8.step_time_s < 0.45 * base.step_time_s
    assert 0.55 < tp8.tokens_per_second / base.tokens_per_second < 0.75 and tp8.mfu < 0.75 * base.mfu


def test_notebook_claims_about_the_typical_configurations():
    # Section 7's prose: with the planner's default m = 4 pp micro-batches per replica (1 without PP), the
    # three typical layouts train on 8, 32 and 512 sequences per step, fewer than the 1024-GPU table's 2048.
    typical = [plan("7B", Layout(zero=1), 8), plan("70B", Layout(tp=8, pp=4, zero=1, sequence_parallel=True), 64),
               plan("405B", Layout(tp=8, pp=16, zero=1, sequence_parallel=True), 1024)]
    assert [p.tokens_per_step // p.layout.seq for p in typical] == [8, 32, 512]


# -- section 11: pricing expert parallelism ------------------------------------------------------------------------

def test_moe_count_table_prints_the_planners_counts_next_to_the_published_ones():
    rows = {r[0]: r for r in ch00.moe_count_table().rows}
    assert rows["Mixtral 8x7B"][1:] == ["46,702,792,704", "46.7B", "12,879,925,248", "12,748,853,248", "12.9B"]
    assert rows["DeepSeek-V3"][1:] == ["671,026,419,200", "671B", "37,552,297,472", "36,625,618,432", "37B"]


def test_ep_table_reads_the_planner_for_every_model_and_degree():
    table = ch00.ep_table(tokens_per_rank=4096, bytes_per_element=2)
    assert [(r[0], r[1]) for r in table.rows] == [("Mixtral 8x7B", "1"), ("Mixtral 8x7B", "8"), ("DeepSeek-V3", "1"),
                                                  ("DeepSeek-V3", "8"), ("DeepSeek-V3", "64")]
    ds64 = table.rows[-1]
    # 256 / 64 = 4 routed experts; 27,334,972,928 parameters = 54.7 GB of bf16 weights; one dispatch
    # 4096 x 7168 x 2 x 8 x 63/64 = 462,422,016 B = 441 MiB; four per layer; 58 MoE layers: 107.3 GB.
    assert ds64[2:] == ["4", "27.33B", "54.7 GB", "441 MiB", "1,764 MiB", "107.3 GB (58 layers)"]
    assert ds64[3] == f"{ep_rank_parameters(DEEPSEEK_V3, 64) / 1e9:,.2f}B"
    assert table.rows[1][2:6] == ["1", "7.24B", "14.5 GB", "56 MiB"]  # Mixtral, EP 8: one expert per rank
    assert table.rows[0][5:7] == ["0", "0"]  # EP 1 sends nothing
    assert "uniform routing" in table.caption


def test_ep_comm_vs_compute_by_hand_and_the_notebooks_claim():
    r = ch00.ep_comm_vs_compute(DEEPSEEK_V3, tokens_per_rank=4096, ep=64)
    # 4 all-to-alls x 462,422,016 B x 58 layers, of which 56 of the 63 other ranks are on other nodes
    assert r["comm_bytes"] == 4 * 462_422_016 * 58 * 56 / 63 == 95_361_695_744
    assert r["comm_s"] == pytest.approx(95_361_695_744 / 50e9, rel=1e-12)
    # 6 x 36,625,618,432 active parameters (no input embedding) x 4096 tokens, at 60% of 989.5 TFLOP/s
    assert r["compute_flops"] == 6 * 36_625_618_432 * 4096
    assert r["compute_s"] == pytest.approx(6 * 36_625_618_432 * 4096 / (0.6 * 989.5e12), rel=1e-12)
    fp8 = ch00.ep_comm_vs_compute(DEEPSEEK_V3, tokens_per_rank=4096, ep=64, dispatch_bytes=1)
    assert fp8["comm_bytes"] == 0.75 * r["comm_bytes"]  # two of the four all-to-alls at half the width
    # The notebook's claims: the same order as the compute, and about 1:1 with FP8 dispatch (report sec 3.2.1).
    assert 1 < r["comm_s"] / r["compute_s"] < 1.5 and 0.9 < fp8["comm_s"] / fp8["compute_s"] < 1.1
    with pytest.raises(ValueError, match="ep=8 fits in one 8-GPU node"):
        ch00.ep_comm_vs_compute(MIXTRAL_8X7B, ep=8)
