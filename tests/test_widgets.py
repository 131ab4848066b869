"""LiveRun on real ranks: a change reruns, bad settings are explained, one job at a time, cancel works."""
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest

from course_utils.widgets import LiveRun, slider

pytestmark = pytest.mark.ranks


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
    live = LiveRun("workers.drills", {"bad_rank": mode}, lambda r, p: "ok", params={"world_size": 2, "mode": "ok"})
    assert live.wait(120)
    mode.value = 3
    assert live.wait(5)
    assert "use 0 to 1" in live.status.value
    assert live.history[-1][1].__class__.__name__ == "InvalidParameter"


def test_changes_during_a_run_queue_and_only_the_newest_runs():
    seconds = slider("seconds", 2, 0, 10)
    live = LiveRun("workers.drills", {"seconds": seconds}, lambda r, p: f"slept {p['seconds']}",
                   params={"world_size": 2, "mode": "sleep"}, timeout=60)
    time.sleep(0.5)
    for s in (3, 4, 0):  # three changes while the first run sleeps
        seconds.value = s
    assert live.wait(120)
    ran = [s["seconds"] for s, _ in live.history]
    assert ran == [2, 0], ran  # the first run, then only the newest waiting settings


def test_cancel_button_stops_the_run():
    seconds = slider("seconds", 30, 0, 60)
    live = LiveRun("workers.drills", {"seconds": seconds}, lambda r, p: "done",
                   params={"world_size": 2, "mode": "sleep"}, timeout=120)
    time.sleep(1.0)
    start = time.time()
    live.cancel_button.click()
    assert live.wait(30)
    assert time.time() - start < 20
    assert live.history[-1][1] == "cancelled"
    assert "cancelled" in live.status.value
