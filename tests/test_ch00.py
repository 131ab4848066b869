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

from course_utils import ch00  # noqa: E402
from course_utils.ledger import GB, pipeline_bubble_fraction, tp_comm_bytes_per_layer  # noqa: E402
from course_utils.planner import Layout, LayoutError, model_shape, plan  # noqa: E402
from course_utils.published_configs import PUBLISHED_CONFIGS  # noqa: E402


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
    # 1 x 4096 x 8192 x 2 / 8 = 8 MiB; EP's all_to_all carries top-2 copies of those tokens: 128 MiB.
    pp_row = next(r for r in table.rows if r[0] == "PP")
    ep_row = next(r for r in table.rows if r[0].startswith("EP"))
    assert pp_row[4].startswith("8 MiB") and ep_row[4] == "128 MiB", (pp_row[4], ep_row[4])
    text, html = str(table), table._repr_html_()
    assert "all_reduce of activations" in text and "<table>" in html and "all_to_all" in html


def test_memory_bars_are_as_tall_as_the_plans_bytes_with_the_gpu_line():
    plans = [plan("70B", Layout(tp=8, pp=4, zero_stage=1), 256), plan("70B", Layout(tp=1, zero_stage=0), 256)]
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
    plt.close("all")


def test_bubble_figure_draws_the_formula_for_both_denominators():
    fig = ch00.bubble_figure(ps=(4,), vs=(1,), max_m=16)
    ideal, total = (ax.get_lines()[0] for ax in fig.axes)
    for m, y in zip(ideal.get_xdata(), ideal.get_ydata()):
        assert y == pytest.approx(pipeline_bubble_fraction(4, int(m)))  # (p-1)/m
    for m, y in zip(total.get_xdata(), total.get_ydata()):
        assert y == pytest.approx(3 / (m + 3))  # (p-1)/(m+p-1)
    plt.close(fig)


def test_tp_costs_less_than_its_matmuls_on_nvlink_and_more_across_nodes():
    # The notebook's claim in section 7, for Llama 3 70B at tp=8, one 4096-token micro-batch.
    t = ch00.tp_layer_times("70B", tp=8)
    assert t["comm_s"]["nvlink4"] < 0.5 * t["compute_s"]
    assert t["comm_s"]["ib-ndr400"] > t["compute_s"]
    assert t["all_reduces"] == 4 and t["message_bytes"] == 4096 * 8192 * 2


def test_bandwidth_figure_reads_the_published_h200_sweep():
    rows = ch00.published_allreduce()
    assert rows, "data/reference/allreduce_8xH200_published.csv (or ../shared/reference) is missing"
    assert max(r["busbw_GBps"] for r in rows) == pytest.approx(482.26)
    fig = ch00.bandwidth_figure()
    assert len(fig.axes) == 2
    plt.close(fig)


def test_planner_widget_controls_are_the_planner_views_parameters():
    box = ch00.planner_widget()
    assert set(box.controls) == set(inspect.signature(ch00.planner_view).parameters)
    values = {name: c.value for name, c in box.controls.items()}
    p = ch00.planner_view(**values)
    assert p.fits and p.layout.dp == 256 // (8 * 4)
    with pytest.raises(LayoutError, match="key/value heads"):
        ch00.planner_view(**{**values, "tp": 16})
    slow = ch00.planner_view(**{**values, "inter_node": "ethernet100"})
    assert slow.comm_time_s["dp"] > p.comm_time_s["dp"]  # the network control reaches the plan
    plt.close("all")


def test_every_published_row_obeys_the_product_rule_the_notebook_prints():
    for c in PUBLISHED_CONFIGS:
        c.check_product()


def test_notebook_claims_about_the_70b_layouts():
    # Section 5's prose: DDP needs over a terabyte, FSDP alone does not fit, TP8 PP4 does, full recomputation
    # is about a third slower, no recomputation holds about 65 GB of activations.
    ddp = plan("70B", Layout(tp=1, pp=1, zero_stage=0), 256)
    fsdp = plan("70B", Layout(tp=1, pp=1, zero_stage=3), 256)
    base = plan("70B", Layout(tp=8, pp=4, zero_stage=1), 256)
    none = plan("70B", Layout(tp=8, pp=4, zero_stage=1, recompute="none"), 256)
    full = plan("70B", Layout(tp=8, pp=4, zero_stage=1, recompute="full"), 256)
    assert ddp.total_memory_bytes > 1e12 and not ddp.fits
    assert not fsdp.fits and fsdp.memory["activations"] > fsdp.memory["optimizer"]
    assert base.fits and none.fits and full.fits
    assert 1.2 < full.step_time_s / base.step_time_s < 1.45
    assert 60e9 < none.memory["activations"] < 70e9


def test_notebook_claims_about_the_typical_configurations():
    # Section 7's prose: with the planner's default m = 4 pp micro-batches per replica (1 without PP), the
    # three typical layouts train on 8, 32 and 512 sequences per step, fewer than the 1024-GPU table's 2048.
    typical = [plan("7B", Layout(zero_stage=1), 8), plan("70B", Layout(tp=8, pp=4, zero_stage=1), 64),
               plan("405B", Layout(tp=8, pp=16, zero_stage=1), 1024)]
    assert [p.tokens_per_step // p.layout.seq for p in typical] == [8, 32, 512]
