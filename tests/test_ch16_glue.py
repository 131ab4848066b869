"""Chapter 16's notebook glue (course_utils/ch16.py): the tables it prints, the figures, and the explorer widget.

Exact assertions, and verdicts with the margins ``ch16.IMBALANCE_SPREAD`` quotes (orderings between the ranks of
one run). The float errors and CPU times are printed in cells nbval does not compare."""
import matplotlib
import matplotlib.text

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

import course_utils as cu  # noqa: E402
from course_utils import ch16  # noqa: E402
from course_utils.planner import all_to_all_bytes  # noqa: E402
from course_utils.tables import Table  # noqa: E402


@pytest.mark.ranks
def test_equivalence_rows_name_every_case_and_say_equal():
    res = cu.run(ch16.WORKER, 2, timeout=180, ep=2, sweep=True)
    rows = ch16.equivalence_rows(res, 2, 2)
    assert len(rows) == 8 and all(r["equal"] == "yes" for r in rows)
    assert [(r["experts"], r["top-k"], r["capacity"]) for r in rows][:4] == [
        (4, 1, "dropless"), (4, 1, 1.0), (4, 2, "dropless"), (4, 2, 1.0)]
    assert all((r["dropped"] > 0) == (r["capacity"] != "dropless") for r in rows)
    text = str(ch16.equivalence_table(rows))
    assert "EP 2 (2 ranks)" in text and "tolerance 1e-10" in text and "NO" not in text
    assert "output err" in str(ch16.equivalence_table(rows, errors=True))


@pytest.mark.ranks
def test_split_and_byte_rows_add_up():
    res = cu.run(ch16.WORKER, 4, timeout=180, ep=2, experts=8, top_k=2, capacity_factor=1.0)
    rows = ch16.split_rows(res)
    assert [r["experts"] for r in rows] == ["0,1,2,3", "4,5,6,7", "0,1,2,3", "4,5,6,7"]
    for r in rows:
        assert sum(r["send splits"]) == r["kept"] and sum(r["rows per expert"]) == sum(r["recv splits"])
        assert r["bytes out"] == (sum(r["send splits"]) - r["send splits"][rows.index(r) % 2]) * 16 * 8
    assert max(len(line) for line in str(Table.of(rows, formats=ch16.SPLIT_FORMATS)).splitlines()) <= 110
    balanced = cu.run(ch16.WORKER, 4, timeout=180, ep=2, experts=8, top_k=2, tokens=64, balanced=True)
    table = ch16.bytes_rows({"even": balanced}, hidden=16, top_k=2, element_bytes=8)
    assert [r["measured"] for r in table] == [all_to_all_bytes(16, 16, 2, 2, 8)] * 4 == [2048.0] * 4
    assert all(r["measured / model"] == 1.0 and r["model"] == 2048 and isinstance(r["model"], int) for r in table)
    printed = Table.of(table, formats=ch16.BYTES_FORMATS)
    assert printed.rows[0][2:] == ["2,048", "2,048", "1.000"]  # counts as integers with separators, never 2.048e+03


@pytest.mark.ranks
def test_a_skewed_batch_makes_the_other_ranks_wait_for_the_busiest():
    runs = ch16.imbalance_runs()
    for res in runs.values():  # six timed repeats per rank, each split into its parts
        for r in res.ranks:
            timings = r["cases"][0]["timings"]
            assert len(timings) == ch16.IMBALANCE["repeats"] and set(timings[0]) == set(ch16.TIMINGS.values())
            assert all(t["dispatch_s"] + t["expert_s"] + t["combine_s"] <= t["forward_s"] <= t["step_s"]
                       for t in timings)
    rows = ch16.imbalance_rows(runs)
    # exact: dropless, every choice is computed once; the counts are the same under every CPU's kernels
    assert sum(r["rows computed"] for r in rows if r["batch"] == "skewed") == 2048 * 2
    busy = ch16.slowest(rows, "skewed")
    assert busy["rank"] == 0 and busy["rows computed"] > 1.5 * 2048 * 2 / 4  # expert 0 lives on rank 0: 2.14x
    # CPU time within one run, bound from IMBALANCE_SPREAD (3.2-4.7x over 18 runs). The waits are wall times and are
    # not asserted: 5.3-25x over those runs, but 0.51x once in CI with a browser test sharing the two cores.
    measures = ch16.imbalance_measures(rows)
    assert measures["busy_cpu_over_others"] > ch16.BUSY_CPU_BOUND
    assert "NO" not in ch16.imbalance_verdict(rows)
    assert measures["others_wait_over_busy"] > 0 and "as long as rank 0" in ch16.imbalance_waits(rows)


def _imbalance_rank(batch, rank, rows, dispatch, expert, cpu, wait):
    timings = [{"dispatch_s": 1.0, "expert_s": 1.0, "expert_cpu_s": 1.0, "combine_s": 1.0, "forward_s": 9.0,
                "step_s": 9.0}]  # the warm-up: left out of the medians
    timings += [{"dispatch_s": dispatch * f, "expert_s": expert * f, "expert_cpu_s": cpu * f, "combine_s": wait * f,
                 "forward_s": (dispatch + expert + wait) * f, "step_s": 3 * (dispatch + expert + wait) * f}
                for f in (0.9, 1.0, 1.1, 1.0, 5.0)]  # median: f = 1.0 whatever the outlier
    return {"cases": [{"local_experts": [2 * rank, 2 * rank + 1], "tokens_per_local_expert": [rows, 0],
                       "timings": timings}]}


def _fake_imbalance(busy_wait=0.002):
    even = [_imbalance_rank("even", r, 100, 0.01, 0.05, 0.02, 0.005) for r in range(4)]
    skewed = [_imbalance_rank("skewed", 0, 250, 0.01, 0.12, 0.05, busy_wait)]
    skewed += [_imbalance_rank("skewed", r, 50, 0.01, 0.03, 0.01, 0.09) for r in range(1, 4)]
    return {"even": _Res(*even), "skewed": _Res(*skewed)}


def test_imbalance_rows_measures_verdict_and_figure():
    rows = ch16.imbalance_rows(_fake_imbalance())
    busy = ch16.slowest(rows, "skewed")
    assert busy["rank"] == 0 and busy["rows computed"] == 250 and busy["experts"] == "0,1"
    assert busy["expert ms"] == pytest.approx(120.0) and busy["combine wait ms"] == pytest.approx(2.0)
    m = ch16.imbalance_measures(rows)
    assert m["busy_share"] == pytest.approx(250 / 100) and m["busy_cpu_over_others"] == pytest.approx(5.0)
    assert m["others_wait_over_busy"] == pytest.approx(45.0) and m["busiest_cpu_skewed_over_even"] == pytest.approx(2.5)
    assert m["forward_skewed_over_even"] == pytest.approx(132 / 65)  # the busy rank: 10 + 120 + 2 ms; even: 10 + 50 + 5
    verdict = ch16.imbalance_verdict(rows)
    assert verdict.count("yes") == 1 and "2.5x an even share" in verdict
    assert "at least 45.0x as long as rank 0" in ch16.imbalance_waits(rows)  # measured, printed, not judged
    assert "at least 1.0x as long as rank 0" in ch16.imbalance_waits(ch16.imbalance_rows(_fake_imbalance(0.09)))
    assert "4 ranks on 2 CPU cores" in ch16.imbalance_sentence(rows, cores=2)
    fig = ch16.draw_imbalance(rows)
    even, skewed = fig.axes[:2]
    assert skewed.get_title() == "skewed batch" and len(skewed.patches) == 3 * 4  # 3 parts x 4 ranks
    waits = [p.get_width() for p in skewed.patches[8:]]  # the third part of every bar: the wait at the combine
    assert waits == pytest.approx([2.0, 90.0, 90.0, 90.0])
    assert any("250 rows (2.5x)" in t.get_text() for t in skewed.texts)
    assert smallest_text_px(fig, dpi=110) >= 9
    plt.close(fig)


def smallest_text_px(fig, dpi: float, shown: float = 950) -> float:
    """The smallest visible text of ``fig`` in screen pixels when saved at ``dpi`` (tight) and shown at most ``shown``
    pixels wide, as JupyterLab shows a figure in a ~1000 px notebook column."""
    fig.set_dpi(dpi)
    renderer = fig.canvas.get_renderer()
    width_px = fig.get_tightbbox(renderer).width * dpi
    scale = min(1.0, shown / width_px)
    sizes = [t.get_fontsize() for t in fig.findobj(matplotlib.text.Text) if t.get_visible() and t.get_text().strip()]
    return min(sizes) * dpi / 72 * scale


def _fake_training(load):
    steps, experts = 60, 8
    counts = [[[64] * experts, [64] * experts]] * steps
    return {"loss": [2.5 - i / 60 for i in range(steps)], "max_load": [[load, 1.0]] * steps,
            "would_drop": [[[0.3, 0.2, 0.1, 0.0], [0.1, 0.0, 0.0, 0.0]]] * steps, "aux": [[1.1, 1.0]] * steps,
            "counts": counts, "capacity_factors": [1.0, 1.25, 1.5, 2.0], "dropped": [[0.0, 0.0]] * steps,
            "dispatch_bytes": [[4096, 4096]] * steps, "global_batch": 16, "model": {"seq": 32, "hidden": 32}}


class _Res:
    def __init__(self, *ranks):
        self.ranks = list(ranks)

    def __getitem__(self, i):
        return self.ranks[i]


def test_training_summary_verdict_and_figures():
    runs = {"aux": _Res(_fake_training(1.3)), "none": _Res(_fake_training(2.0))}
    summary = ch16.training_summary(runs)
    assert [s["max load (last 50)"] for s in summary] == [1.3, 2.0] and [s["peak load"] for s in summary] == [1.3, 2.0]
    assert summary[0]["% dropped at capacity 1.0"] == pytest.approx(30.0)  # percent, as everywhere in the chapter
    verdict = ch16.aux_verdict(summary, "aux", "none")
    assert verdict.count("yes") == 2 and "fewer choices, by over 5% of all choices: NO" in verdict  # both drop 30 %
    assert "points" not in verdict
    sentence = ch16.load_sentence(summary, "aux", "none")
    assert "1.30x with the aux loss, 2.00x without" in sentence and "30.0% and 30.0%" in sentence
    assert "30.0%" in str(Table.of(summary, formats=ch16.SUMMARY_FORMATS))
    fig = ch16.draw_training(runs)
    axes = {ax.get_title(): ax for ax in fig.axes}
    loss = axes["loss"]
    assert [line.get_linestyle() for line in loss.lines] == ["-", "--"]  # the two curves read apart
    assert loss.lines[0].get_marker() != loss.lines[1].get_marker()
    diff = axes["loss: none minus aux"]
    assert list(diff.lines[0].get_ydata()) == [0.0] * 60  # the same fake loss: no difference
    heat = axes["aux: load per expert, layer 0"]
    assert heat.images[0].get_array().shape == (8, 60)  # experts x steps, each 1.0: an even share
    assert float(heat.images[0].get_array().max()) == 1.0
    assert list(heat.get_yticks()) == list(range(8))  # one integer tick per expert
    assert smallest_text_px(fig, dpi=110) >= 9
    plt.close(fig)
    fig = ch16.draw_drops(runs)
    assert [round(y, 6) for y in fig.axes[0].lines[0].get_ydata()] == [30.0, 20.0, 10.0, 0.0]
    assert fig.axes[0].get_ylim()[0] == 0 and smallest_text_px(fig, dpi=110) >= 9
    plt.close(fig)
    params = {"experts": 8, "ep": 2, "top_k": 2, "capacity_factor": 1.0, "aux_coeff": 0.01}
    fig = ch16.draw_explorer(runs["aux"], params)
    bars = [p.get_height() for p in fig.axes[2].patches]
    assert bars == [4096, 4096]
    model = fig.axes[2].lines[0].get_ydata()[0]
    assert model == 2 * all_to_all_bytes(8 * 32, 32, 2, 2, 4)  # two layers, 8 samples x 32 tokens per rank
    assert list(fig.axes[0].get_xticks()) == list(range(8))  # integer expert ticks, not 2.5, 5.0
    assert len(fig.axes) == 4 and fig.axes[3].get_ylim() == (0, 5.0)  # the drops' axis: 0 to 5 % when none dropped
    for ax in fig.axes[:3]:  # legends below the panels, never over the bars
        legend = ax.get_legend()
        assert legend is not None and legend.get_bbox_to_anchor().y0 < ax.get_window_extent().y0
    assert smallest_text_px(fig, dpi=100) >= 9
    plt.close(fig)
    fig = ch16.draw_explorer(runs["aux"], {**params, "capacity_factor": 0.0})
    assert len(fig.axes) == 3  # dropless: no drops axis drawn from -0.04 to 0.04, a sentence instead
    assert any(t.get_text() == "dropless: no token dropped" for t in fig.axes[1].texts)
    plt.close(fig)


def test_the_explorers_controls_reach_both_refusals_before_any_rank_starts():
    import ipywidgets as W

    # the notebook's options; each value below raises in Dropdown unless the options hold it. Every step is refused,
    # so nothing launches: the refusal comes before any rank starts
    start = {"experts": 6, "top_k": 2, "capacity_factor": 1.0, "aux_coeff": 0.01, "ep": 4}
    controls = {name: W.Dropdown(options=options, value=start[name])
                for name, (_, options, _) in ch16.EXPLORER_CONTROLS.items()}
    live = ch16.MoEExplorer(controls, auto_start=False)
    live.request()
    assert live._job is None and "ep=4 does not divide experts=6" in live.status.value
    controls["top_k"].value = 8
    controls["ep"].value = 1
    assert live._job is None and "top_k=8 must be between 1 and experts=6" in live.status.value
    controls["experts"].value = 4
    assert live._job is None and "top_k=8 must be between 1 and experts=4" in live.status.value
    assert len(live.history) == 4 and all(isinstance(outcome, Exception) for _, outcome in live.history)
    assert all(". " not in str(outcome) for _, outcome in live.history)  # one sentence each


def test_the_explorer_runs_on_ep_ranks_and_refuses_before_launching():
    import ipywidgets as W

    controls = {"experts": W.Dropdown(options=[4, 6, 8], value=6), "top_k": W.Dropdown(options=[1, 2, 8], value=2),
                "capacity_factor": W.Dropdown(options=[0.0, 1.0], value=1.0),
                "aux_coeff": W.Dropdown(options=[0.0, 0.01], value=0.01), "ep": W.Dropdown(options=[1, 2, 4], value=4)}
    live = ch16.MoEExplorer(controls, auto_start=False)
    assert live.settings()["world_size"] == 4 and live.fixed == {"steps": ch16.WIDGET_STEPS}
    controls["capacity_factor"].value = 0.0  # refused by the worker's check_params before any rank starts
    assert live._job is None and "ep=4 does not divide experts=6" in live.status.value
    controls["top_k"].value = 8
    controls["experts"].value = 4
    assert "top_k=8 must be between 1 and experts=4" in live.status.value
    assert live._job is None and len(live.history) == 3
    assert all(isinstance(outcome, Exception) for _, outcome in live.history)
