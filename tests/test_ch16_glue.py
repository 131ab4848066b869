"""Chapter 16's notebook glue (course_utils/ch16.py): the tables it prints, the figures, and the explorer widget.

Exact assertions only: counts, bytes, verdicts. The float errors and CPU times are printed in cells nbval does not
compare."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

import course_utils as cu  # noqa: E402
from course_utils import ch16  # noqa: E402
from course_utils.planner import all_to_all_bytes  # noqa: E402


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
    assert [r["experts held"] for r in rows] == ["0,1,2,3", "4,5,6,7", "0,1,2,3", "4,5,6,7"]
    for r in rows:
        assert sum(r["send splits"]) == r["kept choices"] and sum(r["rows per local expert"]) == sum(r["recv splits"])
    balanced = cu.run(ch16.WORKER, 4, timeout=180, ep=2, experts=8, top_k=2, tokens=64, balanced=True)
    table = ch16.bytes_rows({"even": balanced}, hidden=16, top_k=2, element_bytes=8)
    assert [r["measured"] for r in table] == [all_to_all_bytes(16, 16, 2, 2, 8)] * 4 == [2048.0] * 4
    assert all(r["measured / model"] == 1.0 for r in table)


@pytest.mark.ranks
def test_a_skewed_batch_loads_the_rank_holding_expert_zero():
    runs = {label: cu.run(ch16.WORKER, 4, timeout=180, ep=4, experts=8, top_k=2, tokens=1024, hidden=32, ffn=64,
                          dtype="float32", report=False, skew=skew) for label, skew in (("even", 0.0), ("skewed", 4.0))}
    rows = ch16.imbalance_rows(runs)
    assert sum(r["rows computed"] for r in rows if r["batch"] == "skewed") == 1024 * 2  # dropless: every choice
    assert ch16.slowest(rows, "skewed")["rank"] == 0  # expert 0 lives on rank 0
    assert ch16.slowest(rows, "skewed")["rows computed"] > 1.5 * 1024 * 2 / 4


def _fake_training(load):
    steps, experts = 60, 8
    counts = [[[64] * experts, [64] * experts]] * steps
    return {"loss": [2.5 - i / 60 for i in range(steps)], "max_load": [[load, 1.0]] * steps,
            "would_drop": [[[0.3, 0.2, 0.1, 0.0], [0.1, 0.0, 0.0, 0.0]]] * steps, "aux": [[1.1, 1.0]] * steps,
            "counts": counts, "capacity_factors": [1.0, 1.25, 1.5, 2.0], "dropped": [[0.0, 0.0]] * steps,
            "dispatch_bytes": [[4096, 4096]] * steps, "global_batch": 16, "model": {"seq": 32, "hidden": 32}}


class _Res:
    def __init__(self, rank0):
        self.ranks = [rank0]

    def __getitem__(self, i):
        return self.ranks[i]


def test_training_summary_verdict_and_figures():
    runs = {"aux": _Res(_fake_training(1.3)), "none": _Res(_fake_training(2.0))}
    summary = ch16.training_summary(runs)
    assert [s["max load (last 50)"] for s in summary] == [1.3, 2.0]
    assert summary[0]["dropped at capacity 1.0"] == pytest.approx(0.3)
    verdict = ch16.aux_verdict(summary, "aux", "none")
    assert verdict.count("yes") == 2 and "NO" in verdict  # both drop 30 %: not 5 points fewer
    fig = ch16.draw_training(runs)
    assert fig.axes[0].get_title() == "loss" and fig.axes[2].get_title().startswith("aux: tokens per expert")
    assert fig.axes[2].images[0].get_array().shape == (8, 60)  # experts x steps, each 1.0: an even share
    assert float(fig.axes[2].images[0].get_array().max()) == 1.0
    plt.close(fig)
    fig = ch16.draw_drops(runs)
    assert [round(y, 6) for y in fig.axes[0].lines[0].get_ydata()] == [30.0, 20.0, 10.0, 0.0]
    plt.close(fig)
    fig = ch16.draw_explorer(runs["aux"], {"experts": 8, "ep": 2, "top_k": 2, "capacity_factor": 1.0, "aux_coeff": 0.01})
    bars = [p.get_height() for p in fig.axes[2].patches]
    assert bars == [4096, 4096]
    model = fig.axes[2].lines[0].get_ydata()[0]
    assert model == 2 * all_to_all_bytes(8 * 32, 32, 2, 2, 4)  # two layers, 8 samples x 32 tokens per rank
    plt.close(fig)


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
