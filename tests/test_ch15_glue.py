"""Chapter 15's notebook glue (course_utils/ch15.py): what a layout predicts each rank holds and which groups it
is in, the refusal, the ragged micro-batch weights, the tables and figures, and the widget's world size and
refusal, all without ranks; then one small run whose ranks' own reports must agree with the prediction.

Every assertion here is exact: counts, rank lists, integer token counts (``make_batch`` draws integers) and
fractions of them, strings, and booleans of float64 verdicts whose margin is the equivalence check's own.
"""
from fractions import Fraction

import matplotlib
import matplotlib.pyplot as plt
import pytest

from course_utils import ch15
from workers.layout import Layout
from workers.composed.faults import FAULTS
from workers.layout.grid import DIMS

matplotlib.use("Agg")


def test_the_chapter_layouts_and_the_fault_cases_fit_the_model_and_show():
    from workers.composed.faults import fault_problem

    for name in ch15.LAYOUTS_8 + ch15.LAYOUTS_4:
        layout = ch15.layout_for(name)
        assert ch15.layout_problem(layout) is None, name
        assert layout.micro_batches == (2 if layout.pp > 1 else 1)
    assert [Layout.parse(n).world for n in ch15.LAYOUTS_8] == [8] * 6
    assert [Layout.parse(n).world for n in ch15.LAYOUTS_4] == [4] * 2
    assert set(ch15.FAULT_CASES) == set(FAULTS) - {"none"}
    for fault, (name, options) in ch15.FAULT_CASES.items():
        layout = ch15.layout_for(name, **options)
        assert ch15.layout_problem(layout) is None, fault
        assert fault_problem(fault, layout, options.get("dropout", 0.0)) is None, fault
    # world 8 first in the dict's order, so the notebook's loops keep cold starts to one per world size
    worlds = [Layout.parse(n).world for n, _ in ch15.FAULT_CASES.values()]
    assert worlds == sorted(worlds, reverse=True)


def test_layout_for_keeps_the_options_and_the_worker_params_name_every_degree():
    layout = ch15.layout_for("2x2x1x2", zero=1, sequence_parallel=True, dropout=0.1, fault="dropout_shared")
    assert (layout.dp, layout.tp, layout.pp, layout.cp, layout.zero, layout.sequence_parallel) == (2, 2, 1, 2, 1, True)
    assert layout.micro_batches == 1
    assert ch15.layout_for("1x1x4x1", micro_batches=4).micro_batches == 4
    params = ch15.worker_params(layout)
    assert params == {"dp": 2, "tp": 2, "pp": 1, "cp": 2, "zero": 1, "sequence_parallel": True, "micro_batches": 1,
                      "schedule": "1f1b", "virtual_stages": 1, "split": "zigzag"}


def test_a_layout_that_does_not_fit_is_refused_in_one_sentence():
    assert ch15.layout_problem(Layout.parse("2x3x1x1"), world=8) == (
        "dp x tp x pp x cp = 2x3x1x1 makes 6 ranks, not the world's 8; tp=3 does not divide heads=8: choose 1, 2, 4 "
        "or 8; tp=3 does not divide ffn=128; tp=3 does not divide vocab=32: choose 1, 2, 4, 8, 16 or 32")
    assert "pp=3 does not divide layers=4" in ch15.layout_problem(Layout.parse("1x1x3x1"))
    assert "does not divide global_batch=8" in ch15.layout_problem(Layout.parse("8x1x1x1", micro_batches=2))


def test_the_groups_are_slices_of_the_grid_plus_dp_cp_and_the_embedding_ends():
    rows = ch15.group_rows(Layout.parse("2x2x2x1"))
    assert [r["coords"] for r in rows[:3]] == [{"dp": 0, "pp": 0, "cp": 0, "tp": 0}, {"dp": 0, "pp": 0, "cp": 0, "tp": 1},
                                               {"dp": 0, "pp": 1, "cp": 0, "tp": 0}]
    r5 = rows[5]["groups"]  # dp 1, pp 0, tp 1
    assert r5 == {"tp": [4, 5], "cp": [5], "pp": [5, 7], "dp": [1, 5], "dp_cp": [1, 5], "embedding": [5, 7]}
    # with a ring, dp_cp joins the data-parallel and context-parallel copies
    rows = ch15.group_rows(Layout.parse("2x1x2x2"))
    assert rows[0]["groups"]["dp_cp"] == [0, 1, 4, 5] and rows[0]["groups"]["cp"] == [0, 1]
    # one stage holds both ends: no embedding group
    assert all(r["groups"]["embedding"] == [] for r in ch15.group_rows(Layout.parse("2x2x1x2")))
    # a middle stage of a deep pipeline is in no embedding group; the two ends are in one
    deep = ch15.group_rows(Layout.parse("1x1x4x1"))
    assert [r["groups"]["embedding"] for r in deep] == [[0, 3], [], [], [0, 3]]


def test_the_tables_print_every_rank_and_every_group_once():
    table = str(ch15.grid_table(Layout.parse("2x2x2x1")))
    lines = table.splitlines()
    assert lines[0].split()[:2] == ["rank", "(dp,"] and len(lines) == 2 + 8
    assert lines[2 + 7].split()[:5] == ["7", "(1,", "1,", "0,", "1)"]
    groups = str(ch15.group_table(Layout.parse("2x2x1x2")))
    assert "dp_cp      [0, 2, 4, 6] [1, 3, 5, 7]" in groups and "(none: one stage holds both ends)" in groups


def test_holdings_cover_every_layer_head_token_and_sample_once_per_replica():
    cfg = ch15.CONFIG
    for name in ch15.LAYOUTS_8 + ch15.LAYOUTS_4 + ["1x2x2x2"]:
        layout = ch15.layout_for(name)
        held = ch15.holdings(layout)
        assert len(held) == layout.world
        # every (layer, head) is held by exactly dp x cp ranks (one per data/context replica)
        count = {}
        for h in held:
            for chunk in h["layers"]:
                for layer in chunk:
                    for head in h["heads"]:
                        count[layer, head] = count.get((layer, head), 0) + 1
        assert count == {(l, h): layout.dp * layout.cp for l in range(cfg.layers) for h in range(cfg.heads)}, name
        # a TP group shares tokens and samples; a CP ring covers the sequence; DP ranks cover the batch
        for h in held:
            c = h["coords"]
            ring = [o for o in held if all(o["coords"][d] == c[d] for d in ("dp", "pp", "tp"))]
            assert sorted(t for o in ring for t in o["tokens"]) == list(range(cfg.seq)), name
            replicas = [o for o in held if all(o["coords"][d] == c[d] for d in ("pp", "cp", "tp"))]
            assert sorted(s for o in replicas for s in o["samples"]) == list(range(ch15.GLOBAL_BATCH)), name
        # the ends: the embedding on the first stage, the head on the last (a copy when they differ)
        assert all(h["embed"] == (h["stage"] == 0) for h in held)
        last = layout.pp - 1
        want = "embed.weight" if layout.pp == 1 else "head.weight"
        assert all(h["head"] == (want if h["stage"] == last else None) for h in held), name


def test_holdings_of_an_interleaved_pipeline_and_of_sequence_parallelism():
    held = ch15.holdings(Layout(dp=1, pp=2, virtual_stages=2, schedule="interleaved", micro_batches=2))
    assert [h["layers"] for h in held] == [[[0], [2]], [[1], [3]]]  # chunk c of stage s is virtual stage c p + s
    assert held[0]["embed"] and held[1]["head"] == "head.weight"  # the last virtual stage is chunk 1 of stage 1
    sp = ch15.holdings(Layout(tp=2, cp=2, sequence_parallel=True))
    assert [h["tokens"] for h in sp[:3:2]] == [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]  # zigzag
    assert all(h["rows"] == 4 for h in sp)  # seq 16 / cp 2 / tp 2
    assert sp[1]["heads"] == [4, 5, 6, 7] and sp[1]["ffn"] == (64, 128)
    assert sp[0]["sharded"][:2] == ["blocks.0.attention.proj.weight", "blocks.0.attention.qkv.bias"]
    assert len(sp[0]["sharded"]) == 6 * 4 + 1  # 6 per layer, and the embedding, split by vocabulary


def test_the_mesh_figure_draws_one_box_per_rank_with_what_it_holds():
    layout = Layout.parse("1x2x2x2")
    fig = ch15.mesh_figure(layout)
    texts = [t.get_text() for t in fig.axes[0].texts]
    boxes = [t for t in texts if t.startswith("rank ")]
    assert len(boxes) == 8
    assert "heads 4-7" in boxes[1] and "tokens 0-3,12-15" in boxes[0] and "embed + pos" in boxes[0]
    assert "ln_f + head (tied copy)" in boxes[4] and "layers 2-3" in boxes[4]
    plt.close(fig)
    fig = ch15.mesh_figure(Layout.parse("8x1x1x1"))
    assert sum(t.get_text().startswith("rank ") for t in fig.axes[0].texts) == 8
    assert "head = embed" in fig.axes[0].texts[0].get_text()
    plt.close(fig)


def test_ragged_micro_batches_weigh_their_tokens_unequally_unless_normalised_globally():
    rows = ch15.micro_batch_weights(dp=2, micro_batches=2)
    assert len(rows) == 4 and len({r["tokens"] for r in rows}) > 1  # ragged
    total = rows[0]["total"]
    assert sum(r["tokens"] for r in rows) == total
    assert sum(Fraction(r["tokens"], r["total"]) for r in rows) == 1
    assert sum(Fraction(r["tokens"], r["per_micro_denominator"]) for r in rows) == 1  # plausible, yet ...
    assert {r["per_micro_denominator"] for r in rows} != {total}  # ... not the same weights


def _verdict(ok, what="gradient", tensor="pos", error=0.8, step=0, max_error=1e-12):
    first = None if ok else {"step": step, "what": what, "tensor": tensor, "error": error, "ranks": [0]}
    return {"ok": ok, "first": first, "max_error": max_error, "tolerance": 1e-10, "message": "m"}


def test_verdict_rows_and_tables():
    rows = [ch15.equivalence_row("2x2x2x1", 0, _verdict(True, max_error=1.87e-12)),
            ch15.equivalence_row("1x1x1x4", 1, _verdict(True, max_error=3.2e-14))]
    text = str(ch15.equivalence_table(rows))
    assert "2e-12" in text and "3e-14" in text  # one significant digit
    assert "difference" not in str(ch15.equivalence_table(rows, differences=False))
    assert ch15.fault_row("tied_not_reduced", "1x1x4x1", _verdict(False, tensor="head.weight"))["first named"] == \
        "gradient of embed.weight"  # the head is named by what it copies
    loss = ch15.fault_row("per_microbatch_mean", "2x2x2x1", _verdict(False, "loss", "loss", 2e-3))
    assert loss["first named"] == "the loss" and loss["caught"]
    assert not ch15.fault_row("grads_over_tp", "2x2x2x1", _verdict(True))["caught"]
    assert not ch15.fault_row("grads_over_tp", "2x2x2x1", _verdict(False, step=1))["caught"]  # too late
    assert not ch15.fault_row("grads_over_tp", "2x2x2x1", _verdict(False, error=1e-9))["caught"]  # rounding-sized


def _fake_ranks():
    layout = Layout.parse("1x2x2x1", micro_batches=2)
    ranks = []
    for rank in range(4):
        c = layout.grid.coords(rank)
        boxes = [{"kind": k, "micro": i, "chunk": 0, "start": 0.01 * (n + c["pp"]), "end": 0.01 * (n + c["pp"]) + 0.008}
                 for n, (k, i) in enumerate([("F", 0), ("F", 1), ("B", 0), ("B", 1)])]
        ranks.append({"coords": c, "timelines": [boxes, boxes], "layout": layout.as_dict(),
                      "layout_name": layout.name})
    return ranks


def test_the_timeline_figure_draws_every_box_of_every_rank():
    fig = ch15.timeline_figure(_fake_ranks())
    ax = fig.axes[0]
    assert len(ax.patches) == 4 * 4
    assert [t.get_text() for t in ax.get_yticklabels()][3] == "rank 3: dp0 tp1 pp1 cp0"
    assert "step 1" in ax.get_xlabel() and "not GPU numbers" in ax.get_xlabel()
    plt.close(fig)


def _pngs(live) -> list:
    return [o for o in live.out.outputs if "image/png" in o.get("data", {})]


def _shown_text(live) -> str:
    return "".join(o.get("text", "") for o in live.out.outputs if o.get("output_type") == "stream")


def test_the_explorer_runs_on_the_product_of_the_degrees_and_refuses_a_bad_layout_before_launching():
    import ipywidgets as W

    from course_utils.validate import max_world_size

    controls = {d: W.Dropdown(options=[1, 2, 3, 4, 8], value=v) for d, v in
                (("dp", 1), ("tp", 2), ("pp", 2), ("cp", 1))}
    controls["micro_batches"] = W.Dropdown(options=[1, 2, 3, 4], value=2)
    live = ch15.LayoutRun(controls, auto_start=False)
    assert live.settings()["world_size"] == 4
    fig, _ = plt.subplots()
    live.show(fig)  # a figure of earlier settings on screen
    live.verdict.value = "EQUAL: layout 1x2x2x1 ..."
    controls["pp"].value = 3  # observed: a request, refused before any rank starts
    assert live.idle.is_set() and live._job is None
    assert "pp=3 does not divide layers=4 into equal stages" in live.status.value
    assert _pngs(live) == [] and _shown_text(live).startswith("(no figure: these settings were refused")
    assert live.verdict.value == "", "the refused settings left the previous layout's verdict beside the controls"
    controls["dp"].value = 8  # 8 x 2 x 3 x 1 = 48 ranks: said as the degrees the learner chose, not a world size
    limit = max_world_size()
    assert (f"dp x tp x pp x cp = 8 x 2 x 3 x 1 = 48 ranks; this machine's lab runs at most {limit}: lower a degree"
            in live.status.value)
    assert "world_size" not in live.status.value
    controls["tp"].value = 1
    controls["pp"].value = 1  # 8x1x1x1 with m = 2: dp x m = 16 does not divide the batch of 8
    assert ("dp x m = 8 x 2 = 16 does not divide the global batch of 8 samples: choose dp and m whose product is one "
            "of 1, 2, 4, 8") in live.status.value
    assert "global_batch=" not in live.status.value  # the learner cannot set it here: not named as a knob
    assert live._job is None and len(live.history) == 4
    assert all(isinstance(outcome, Exception) for _, outcome in live.history)
    assert _pngs(live) == []


def test_explorer_refusals_name_only_what_the_controls_change():
    assert ch15.explorer_problem({"dp": 2, "tp": 2, "pp": 2, "cp": 2}, limit=8) == (
        "dp x tp x pp x cp = 2 x 2 x 2 x 2 = 16 ranks; this machine's lab runs at most 8: lower a degree")
    assert ch15.explorer_problem({"dp": 2, "tp": 2, "pp": 2, "cp": 2}, limit=16) is None
    assert ch15.explorer_problem({"dp": 1, "tp": 2, "pp": 2, "cp": 1, "micro_batches": 2}, limit=8) is None
    both = ch15.explorer_problem({"dp": 1, "tp": 1, "pp": 3, "cp": 1, "micro_batches": 3}, limit=8)
    assert both == ("dp x m = 1 x 3 = 3 does not divide the global batch of 8 samples: choose dp and m whose product "
                    "is one of 1, 2, 4, 8; pp=3 does not divide layers=4 into equal stages")
    # every setting the notebook's controls offer is run or refused in words a learner acts on: never a world size
    import itertools

    options = ch15.explorer_controls()
    values = {k: [o[1] if isinstance(o, tuple) else o for o in c.options] if hasattr(c, "options") else [True, False]
              for k, c in options.items()}
    for combo in itertools.product(*values.values()):
        found = ch15.explorer_problem(dict(zip(values, combo)), limit=8)
        assert found is None or ("world" not in found and "global_batch=" not in found), found


def test_a_run_that_fails_takes_its_predecessors_figure_off_the_screen(monkeypatch):
    """While a run is going, the earlier layout's figure is marked as such; cancelled, failed or undrawable, no
    figure of other settings stays under the controls."""
    import ipywidgets as W

    from course_utils import widgets
    from course_utils.results import CourseError

    import threading

    release = threading.Event()

    class FailingJob:
        cold, start_note = False, ""

        def wait(self):
            release.wait(10)
            raise CourseError("rank 1 failed: a test's failure")

        def cancel(self):
            pass

    monkeypatch.setattr(widgets, "launch", lambda *a, **k: FailingJob())
    controls = {d: W.Dropdown(options=[1, 2], value=1) for d in ("dp", "tp", "pp", "cp")}
    live = ch15.LayoutRun(controls, auto_start=False)
    fig, _ = plt.subplots()
    live.show(fig)
    live.shown = "1x1x1x1"
    controls["tp"].value = 2
    # while it runs, the figure on screen is marked as the earlier layout's
    assert len(_pngs(live)) == 1 and "the figure below is still layout 1x1x1x1's" in live.verdict.value
    release.set()
    assert live.idle.wait(10)
    assert "rank 1 failed" in live.status.value
    assert _pngs(live) == [] and "(no figure: this run did not finish" in _shown_text(live)


def test_the_explorer_fits_a_laptop_window():
    """Controls in a grid of four columns with the status and verdict beside them, then the figure: no control is
    wider than a dropdown pair, and every control of the notebook's explorer is in the grid once."""
    import ipywidgets as W

    live = ch15.LayoutRun(auto_start=False)
    top, out = live.box.children
    assert out is live.out
    left, right = top.children
    grid = left.children[0]
    assert isinstance(grid, W.GridBox) and grid.layout.grid_template_columns == "repeat(4, max-content)"
    assert list(grid.children) == list(live.controls.values())
    assert live.status in right.children and live.verdict in right.children
    for control in live.controls.values():
        assert int(control.layout.width.rstrip("px")) <= 150, control


def test_compact_labels_fit_their_boxes():
    held = ch15.holdings(Layout.parse("1x2x1x4"))
    label = ch15.compact_label({**held[0], "tp": 2, "cp": 4}, chars=9, lines=8)
    assert label.splitlines() == ["r0 L0-3", "h0-3 t0-1", "14-15", "embed", "head"]
    assert ch15.compact_label({**held[0], "tp": 2, "cp": 4}, chars=30, lines=1) == "r0 L0-3 h0-3 t0-1 14-15 embed"
    assert all(len(line) <= 9 for h in held for line in
               ch15.compact_label({**h, "tp": 2, "cp": 4}, chars=9, lines=9).splitlines())


def test_printed_sentences_break_between_words():
    text = ("step 0: the loss differs from one process by 0.00053 (relative, tolerance 1e-10) on rank 0 (dp 0, tp 0, "
            "pp 0, cp 0), rank 1 (dp 0, tp 1, pp 0, cp 0), rank 2 (dp 0, tp 0, pp 0, cp 1), rank 3 (dp 0, tp 1, pp 0)")
    wrapped = ch15.wrap(text, indent="  ")
    assert all(len(line) <= ch15.TEXT_WIDTH for line in wrapped.splitlines()) and len(wrapped.splitlines()) >= 2
    assert " ".join(wrapped.split()) == text  # only spaces became line breaks: no word cut
    assert all(line.count("(") == line.count(")") for line in wrapped.splitlines())  # "(dp 0, tp 1, ...)" whole


def test_the_planner_ratio_figure_draws_every_row_from_1():
    """planner / measured as bars from 1 on a log axis: 0.5 is a bar from 0.5 to 1 (as long as 2's, from 1 to 2), an
    exact row a mark on the line; a planner of 0 and a missing measurement are drawn and labelled, not dropped; the
    ratios are written beside the axes and the legend covers no bar."""
    from matplotlib.patches import Rectangle

    from course_utils import ch15_truth as truth

    rows = [{"layout": "a", "dimension": "cp", "planner": 50.0, "measured": 100.0},
            {"layout": "a", "dimension": "pp", "planner": 200.0, "measured": 100.0},
            {"layout": "b", "dimension": "tp", "planner": 100.0, "measured": 100.0},
            {"layout": "b", "dimension": "embedding", "planner": 0.0, "measured": 8192.0},
            {"layout": "c", "dimension": "dp", "planner": 300.0, "measured": 0.0},
            {"layout": "c", "dimension": "dp", "planner": 300.0, "measured": None}]
    fig = truth.ratio_figure(rows)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a  cp", "a  pp", "b  tp", "b  embedding", "c  dp", "c  dp"]
    bars = {round(p.get_y() + p.get_height() / 2): p for p in ax.patches if isinstance(p, Rectangle)
            and p.get_height() < 1}
    assert (bars[0].get_x(), bars[0].get_x() + bars[0].get_width()) == pytest.approx((0.5, 1.0))  # 0.5: from 1 down
    assert (bars[1].get_x(), bars[1].get_x() + bars[1].get_width()) == pytest.approx((1.0, 2.0))
    assert 2 not in bars  # exact: a mark on the line, no bar
    assert bars[3].get_x() <= ax.get_xlim()[0] and bars[3].get_x() + bars[3].get_width() == pytest.approx(1.0)
    assert 4 not in bars and 5 not in bars  # nothing to divide by: no bar, but a label
    labels = {round(t.get_position()[1]): t.get_text() for t in ax.texts}
    assert labels == {0: "0.5", 1: "2", 2: "exact", 3: "0 (not modelled)", 4: "no measurement (0 bytes measured)",
                      5: "no measurement (0 bytes measured)"}
    assert ax.get_xscale() == "log" and ax.get_xlim()[0] < 0.5 < 2 < ax.get_xlim()[1]
    fig.canvas.draw()
    assert not ax.get_legend().get_window_extent().overlaps(ax.get_window_extent()), "the legend covers the rows"
    plt.close(fig)
    # the truth table and the figure are the same rows: a planner of 0 reads 0 in both
    assert truth.ratio_label(0.0, 8192.0) == "0 (not modelled)" and truth.ratio_label(5.0, 5.0) == "exact"


def _fake_step_ranks(n=4):
    comm = {d: {"wire_bytes": 1000.0 * (i + 1)} for i, d in enumerate(ch15.COMM_DIMS)}
    memory = {m: 2000.0 for m in ch15.MOMENTS}
    return [{"comm": [comm], "memory": [memory]} for _ in range(n)]


def test_the_widgets_bar_legends_sit_beside_the_bars():
    fig = plt.figure(figsize=(9, 3))
    grid = fig.add_gridspec(1, 4, width_ratios=[1, 0.32, 1, 0.32])
    axes = [fig.add_subplot(grid[0, i]) for i in range(4)]
    ch15.traffic_axes(_fake_step_ranks(), axes[0], legend_ax=axes[1])
    ch15.memory_axes(_fake_step_ranks(), axes[2], legend_ax=axes[3])
    fig.canvas.draw()
    for bars, side in ((axes[0], axes[1]), (axes[2], axes[3])):
        assert bars.get_legend() is None and side.get_legend() is not None
        legend = side.get_legend().get_window_extent()
        assert not legend.overlaps(bars.get_window_extent()), "a legend over the bars"
    plt.close(fig)


@pytest.mark.ranks
def test_the_ranks_report_holding_what_the_layout_predicts():
    res, verdict = ch15.run_layout("1x2x2x1", sequence_parallel=True, zero=1, steps=2)
    assert verdict["ok"], verdict["message"]
    assert ch15.mesh_matches_grid(res.ranks)
    assert ch15.holdings_mismatches(res.ranks) == []
    reported = ch15.reported_holdings(res.ranks)
    assert [r["head"] for r in reported] == [None, None, "head.weight", "head.weight"]
    assert all(set(r["coords"]) == set(DIMS) for r in reported)
    fig = ch15.draw_run(res, {})
    mesh, timeline, traffic, _, memory, _ = fig.axes  # the widget's four panels, and the two legends beside the bars
    assert len(mesh.patches) >= 4 and fig._suptitle.get_text().startswith("EQUAL: layout 1x2x2x1 equals one process")
    assert tuple(fig.get_size_inches()) == (9.0, 6.0)  # whatever the layout: the widget stays ~700 px tall
    fig.canvas.draw()
    small = [t.get_text() for t in fig.findobj(matplotlib.text.Text)
             if t.get_text().strip() and t.get_visible() and t.get_fontsize() < ch15.SMALLEST_FONT]
    assert not small, f"text under {ch15.SMALLEST_FONT} pt (under 9.7 px at the widget's 100 dpi): {small}"
    # the traffic bars stack, per rank, exactly the bytes the rank counted; the memory bars what it holds
    for i, r in enumerate(res.ranks):
        sent = sum(c["wire_bytes"] for c in r["comm"][-1].values()) / 1e3
        held = sum(r["memory"][-1].values()) / 1e3
        assert sum(p.get_height() for p in traffic.patches if round(p.get_x() + p.get_width() / 2) == i) \
            == pytest.approx(sent)
        assert sum(p.get_height() for p in memory.patches if round(p.get_x() + p.get_width() / 2) == i) \
            == pytest.approx(held)
    plt.close(fig)
