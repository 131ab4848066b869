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


def test_the_issue_layouts_and_the_fault_cases_fit_the_model_and_show():
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
        "or 8; tp=3 does not divide ffn=128")
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
    assert len(sp[0]["sharded"]) == 6 * 4


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


def test_the_explorer_runs_on_the_product_of_the_degrees_and_refuses_a_bad_layout_before_launching():
    import ipywidgets as W

    controls = {d: W.Dropdown(options=[1, 2, 3, 4, 8], value=v) for d, v in
                (("dp", 1), ("tp", 2), ("pp", 2), ("cp", 1))}
    controls["micro_batches"] = W.Dropdown(options=[1, 2, 3, 4], value=2)
    live = ch15.LayoutRun(controls, auto_start=False)
    assert live.settings()["world_size"] == 4
    controls["pp"].value = 3  # observed: a request, refused by the worker's check_params before any rank starts
    assert live.idle.is_set() and live._job is None
    assert "pp=3 does not divide layers=4 into equal stages" in live.status.value
    controls["dp"].value = 8  # 8 x 2 x 3 x 1 = 48 ranks: more than this machine runs
    assert "world_size=48 is more ranks than this machine runs" in live.status.value
    controls["tp"].value = 1
    controls["pp"].value = 1  # 8x1x1x1 with m = 2: dp x m = 16 does not divide the batch of 8
    assert "dp=8 x micro_batches=2 = 16 does not divide global_batch=8" in live.status.value
    assert live._job is None and len(live.history) == 4
    assert all(isinstance(outcome, Exception) for _, outcome in live.history)


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
    mesh, timeline, traffic, memory = fig.axes  # the widget's four panels
    assert len(mesh.patches) >= 4 and timeline.get_title().startswith("EQUAL: layout 1x2x2x1 equals one process")
    # the traffic bars stack, per rank, exactly the bytes the rank counted; the memory bars what it holds
    for i, r in enumerate(res.ranks):
        sent = sum(c["wire_bytes"] for c in r["comm"][-1].values()) / 1e3
        held = sum(r["memory"][-1].values()) / 1e3
        assert sum(p.get_height() for p in traffic.patches if round(p.get_x() + p.get_width() / 2) == i) \
            == pytest.approx(sent)
        assert sum(p.get_height() for p in memory.patches if round(p.get_x() + p.get_width() / 2) == i) \
            == pytest.approx(held)
    plt.close(fig)
