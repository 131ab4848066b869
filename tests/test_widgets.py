"""LiveRun on real ranks: a change reruns, bad settings are explained, one job at a time, cancel works."""
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest

from course_utils.widgets import LiveRun, slider

pytestmark = [pytest.mark.ranks, pytest.mark.once]  # widget mechanics (reruns, queueing, cancel, status lines): the same on every CPU


def draw(res, params):
    fig, ax = plt.subplots()
    ax.bar(range(res.world_size), res.gather("sum"))
    return fig


def test_slider_change_reruns_on_real_ranks_and_draws():
    value = slider("value", 1, 0, 10)
    live = LiveRun("workers.hello", {"value": value}, draw, params={"world_size": 2})
    assert live.wait(120)
    settings, first = live.history[-1]
    assert first.gather("sum") == [3.0, 3.0]  # 1*2 + (0+1)
    value.value = 4
    assert live.wait(60)
    assert live.history[-1][1].gather("sum") == [9.0, 9.0]  # 4*2 + 1
    assert live.history[-1][1].launch == "warm"
    assert len(live.out.outputs) == 1 and "image/png" in live.out.outputs[0]["data"]


def test_invalid_setting_is_explained_not_launched():
    mode = slider("bad_rank", 0, 0, 5)
    live = LiveRun("workers.rank_faults", {"bad_rank": mode}, lambda r, p: "ok", params={"world_size": 2, "mode": "ok"})
    assert live.wait(120)
    assert live.out.outputs  # the valid setting's answer
    mode.value = 3
    assert live.wait(5)
    assert "use 0 to 1" in live.status.value and "course-refusal" in live.status.value
    assert live.history[-1][1].__class__.__name__ == "InvalidParameter"
    assert live.out.outputs == ()  # nothing of the earlier setting is left beside the refusal


def test_changes_during_a_run_queue_and_only_the_newest_runs():
    seconds = slider("seconds", 2, 0, 10)
    live = LiveRun("workers.rank_faults", {"seconds": seconds}, lambda r, p: f"slept {p['seconds']}",
                   params={"world_size": 2, "mode": "sleep"}, timeout=60)
    time.sleep(0.5)
    for s in (3, 4, 0):  # three changes while the first run sleeps
        seconds.value = s
    assert live.wait(120)
    ran = [s["seconds"] for s, _ in live.history]
    assert ran == [2, 0], ran  # the first run, then only the newest waiting settings


def test_cancel_button_stops_the_run():
    seconds = slider("seconds", 30, 0, 60)
    live = LiveRun("workers.rank_faults", {"seconds": seconds}, lambda r, p: "done",
                   params={"world_size": 2, "mode": "sleep"}, timeout=120)
    # what the button and progress bar are at each change of the status line, as a learner reading it would find them
    seen = []
    live.status.observe(lambda change: seen.append((change["new"], live.cancel_button.disabled,
                                                    live.progress.layout.visibility)), names="value")
    time.sleep(1.0)
    start = time.time()
    live.cancel_button.click()
    assert live.wait(30)
    assert time.time() - start < 20
    assert live.history[-1][1] == "cancelled"
    assert seen[-1] == ("cancelled: the ranks were stopped", True, "hidden"), seen  # greyed out before it says so
    seconds.value = 0  # a run that ends by itself: the same order for "ran in"
    assert live.wait(60)
    assert "done" in live.out.outputs[0]["text"]
    assert seen[-1][1:] == (True, "hidden") and "ran in" in seen[-1][0], seen


def test_the_status_announces_a_cold_start_with_its_time_and_then_says_warm():
    from course_utils import launcher

    value = slider("value", 1, 0, 10)
    seen = []
    launcher.shutdown_pools()  # world 3 is started cold here whatever ran before
    live = LiveRun("workers.hello", {"value": value}, draw, params={"world_size": 3}, auto_start=False)
    live.status.observe(lambda change: seen.append(change["new"]), names="value")
    live.request()
    assert live.wait(120)
    value.value = 2
    assert live.wait(60)
    pending = [s for s in seen if "running on real ranks" in s]
    assert len(pending) == 2, seen
    assert "starting 3 ranks (a cold start: about " in pending[0] and " s to start them and run workers.hello for the " \
        "first time, " in pending[0], pending[0]
    assert pending[1] == "<i>running on real ranks (warm)...</i>"
    assert "cold start" in seen[seen.index(pending[0]) + 1] and "warm ranks" in seen[-1]


def test_controls_wrap_instead_of_squeezing_a_long_labelled_slider():
    import ipywidgets as W

    from course_utils.widgets import controls_row

    m = slider("micro-batches m", 4, 1, 16)
    schedule = W.ToggleButtons(options=["GPipe", "1F1B", "interleaved 1F1B"])
    row = controls_row([schedule, m])
    assert row.layout.flex_flow == "row wrap"
    assert all(c.layout.flex == "0 0 auto" for c in (schedule, m))  # neither shrinks: the row wraps instead
    assert int(m.layout.width.rstrip("px")) >= 7 * len("micro-batches m") + 230


def test_derived_parameters_follow_the_controls_and_greyed_controls_follow_the_settings():
    import ipywidgets as W

    mode = W.Dropdown(options=["ok", "sleep"], value="ok", description="mode")
    seconds = slider("seconds", 0, 0, 5)
    live = LiveRun("workers.rank_faults", {"mode": mode, "seconds": seconds}, lambda r, p: f"bad_rank {p['bad_rank']}",
                   params={"world_size": 2}, derive=lambda s: {"bad_rank": 1 if s["mode"] == "ok" else 0},
                   applies={"seconds": lambda s: s["mode"] == "sleep"})
    assert live.wait(120)
    assert seconds.disabled and live.out.outputs[0]["text"] == "bad_rank 1\n"
    mode.value = "sleep"  # 0 s of sleep: a quick run, with the derived parameter changed
    assert live.wait(60)
    assert not seconds.disabled and live.out.outputs[0]["text"] == "bad_rank 0\n"


def test_under_make_bench_a_widget_measures_itself_warm_and_cold(tmp_path, monkeypatch):
    import json

    out = tmp_path / "widgets.jsonl"
    monkeypatch.setenv("COURSE_WIDGET_BENCH", str(out))
    monkeypatch.setenv("COURSE_BENCH_CHAPTER", "99_probe")
    value = slider("value", 10, 10, 20)  # at its minimum: the first move that runs is one step up
    live = LiveRun("workers.hello", {"value": value}, draw, params={"world_size": 2})
    assert live.wait(300)
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["chapter"] == "99_probe" and record["worker"] == "workers.hello" and record["world_size"] == 2
    assert record["control"] == "value" and record["warm_median_s"] > 0 and record["cold_s"] > record["cold_startup_s"] > 0
    assert record["cold_announced_s"] > 0  # what the status line promised for that cold start, beside what it took
    assert value.value == 10 and live.history[-1][1].launch == "cold"  # restored, and the last run was the cold one
    assert [s["value"] for s, _ in live.history] == [10, 11, 10, 11, 10, 10]
    assert live.wait(5) and len(out.read_text().splitlines()) == 1  # measured once per widget
