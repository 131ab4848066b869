"""What a cold start announces (course_utils/launcher.py: expected_cold_s, the note): the whole wait from the call to
the answer, the worker's first run on new ranks included, from this machine's record of it; a missing or corrupt
record falls back to a model and never fails a run. Nothing here depends on how fast this machine is: the record is
a file each test writes, and the one test on real ranks checks what was recorded, not how long it took."""
from __future__ import annotations

import json
import threading

import pytest

from course_utils import launcher

pytestmark = pytest.mark.once  # what the launcher announces and records: the same on every CPU

MACHINE_LOAD = launcher.machine_load  # the real one (the tests' store pins a quiet machine)
W16 = "workers.some_model"  # any worker: the record is keyed by its name, nothing imports it


@pytest.fixture
def store(tmp_path, monkeypatch):
    """The record, moved to a file of this test's own, on a machine that is quiet whatever this one is doing."""
    path = tmp_path / "build" / "cold_starts.json"
    monkeypatch.setattr(launcher, "_cold_starts_file", lambda: path)
    monkeypatch.setattr(launcher, "machine_load", lambda: (0.5, 2))
    return path


def write(path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data))


def test_a_seen_cold_start_announces_the_start_and_the_first_run_together(store):
    write(store, {"4": 3.1, "cold_runs": {f"{W16}@4": {"runs": [[4.5, 6.5]]}}})
    assert launcher.expected_cold_s(W16, 4) == (11.0, "measured here on its last cold start")
    note, seconds = launcher._start_note(4, None, W16)
    assert seconds == 11.0
    assert note == (f"starting 4 ranks (a cold start: about 11 s to start them and run {W16} for the first time, "
                    "measured here on its last cold start; longer while the machine is busy)")
    # the start alone (what the note used to announce) is still there, for what needs it
    assert launcher.expected_start_s(4) == (3.1, "this machine's last start")


def test_a_busy_machine_stretches_the_announced_wait_by_its_load_per_core(store, monkeypatch):
    """Load 5 on 2 cores: the ranks get about 2/5 of a core each, so the recorded 11 s is announced as 27.5 s, and the
    note says why; a load at or under the core count changes nothing (the record is what an idle machine did)."""
    write(store, {"4": 3.1, "cold_runs": {f"{W16}@4": {"runs": [[4.5, 6.5]]}}})
    monkeypatch.setattr(launcher, "machine_load", lambda: (5.0, 2))
    note, seconds = launcher._start_note(4, None, W16)
    assert seconds == pytest.approx(27.5)
    assert note == (f"starting 4 ranks (a cold start: about 28 s to start them and run {W16} for the first time, "
                    "measured here on its last cold start, times 2.5 because the machine is busy now (load 5.0 on 2 "
                    "cores))")
    monkeypatch.setattr(launcher, "machine_load", lambda: (2.0, 2))
    assert launcher._start_note(4, None, W16)[1] == 11.0
    load, cores = MACHINE_LOAD()  # this machine's own: a number of processes and at least one core
    assert load >= 0 and isinstance(cores, int) and cores >= 1


def test_the_estimate_is_the_median_of_the_last_cold_starts(store):
    write(store, {"cold_runs": {f"{W16}@4": {"runs": [[4.0, 6.0], [9.0, 12.0], [5.0, 6.0]]}}})
    assert launcher.expected_cold_s(W16, 4) == (11.0, "the median of its last 3 cold starts here")  # one busy start


def test_a_cold_start_is_recorded_per_worker_and_world_size_keeping_the_last_three(store):
    write(store, {"2": 2.2, "cold_runs": {"workers.hello@4": {"runs": [[3.0, 0.1]]}}})
    for first in (6.0, 7.0, 8.0, 9.0):
        launcher._record_first_run(W16, 4, first, start_s=4.44)
    seen = json.loads(store.read_text())
    assert seen["4"] == 4.4 and seen["2"] == 2.2  # the ranks' start, per world size, as before
    assert seen["cold_runs"][f"{W16}@4"]["runs"] == [[4.44, 7.0], [4.44, 8.0], [4.44, 9.0]]
    assert seen["cold_runs"]["workers.hello@4"]["runs"] == [[3.0, 0.1]]  # another worker's record is left alone
    assert launcher.expected_cold_s(W16, 4)[0] == pytest.approx(4.44 + 8.0)
    assert not list(store.parent.glob("*.tmp")), "the write-then-rename left a temporary file"


def test_a_first_run_on_warm_ranks_stands_in_until_a_cold_start_is_seen(store):
    write(store, {"4": 3.0})
    launcher._record_first_run(W16, 4, 5.0)  # ranks another worker had started: no start of its own
    assert launcher.expected_cold_s(W16, 4) == (8.0, "from this machine's last start of 4 ranks and its first run "
                                                     "on ranks here")
    launcher._record_first_run(W16, 4, 6.0, start_s=4.0)
    assert launcher.expected_cold_s(W16, 4) == (10.0, "measured here on its last cold start")  # a cold start wins


def test_another_world_size_of_the_same_worker_is_scaled_like_the_allowance(store):
    write(store, {"8": 8.0, "cold_runs": {f"{W16}@4": {"runs": [[4.0, 5.5]]}, f"{W16}@1": {"runs": [[2.0, 1.0]]}}})
    seconds, source = launcher.expected_cold_s(W16, 8)
    # the nearest size seen (4), its first run times allowance(8) / allowance(4), on top of 8 ranks' start
    assert seconds == pytest.approx(8.0 + 5.5 * launcher.first_run_allowance_s(8) / launcher.first_run_allowance_s(4))
    assert source == "from this machine's last start of 8 ranks and its first run on 4 ranks here, scaled"


def test_a_worker_never_seen_gets_the_start_and_the_first_run_allowance(store):
    write(store, {"4": 3.0, "cold_runs": {"workers.hello@4": {"runs": [[3.0, 0.1]]}}})
    assert launcher.expected_cold_s(W16, 4) == (3.0 + launcher.first_run_allowance_s(4),
                                                "from this machine's last start of 4 ranks and a first run's usual time")
    assert launcher.first_run_allowance_s(8) > launcher.first_run_allowance_s(4) > 0  # ranks share the cores


@pytest.mark.parametrize("content", [
    None,  # no record yet
    "",  # a file being written by hand, or truncated
    "{not json",
    "\xff\xfe binary",
    "[1, 2, 3]",  # JSON, but not ours
    {"4": "fast", "cold_runs": "none"},
    {"4": -3.0, "cold_runs": {f"{W16}@4": {"runs": "x"}}},
    {"4": float("nan"), "cold_runs": {f"{W16}@4": {"runs": [["a", 1.0], [1.0], [-1.0, 2.0], [1.0, float("inf")]]}}},
    {"cold_runs": {f"{W16}@x": {"runs": [[1.0, 2.0]]}, f"{W16}@0": {"runs": [[1.0, 2.0]]}, f"{W16}@4": [1.0, 2.0]}},
    {"cold_runs": {f"{W16}@4": {"runs": [[True, 2.0]], "first_on_warm": ["a", None, -1]}}},
])
def test_a_missing_or_corrupt_record_falls_back_without_raising(store, content):
    if isinstance(content, str):
        store.parent.mkdir(parents=True)
        store.write_bytes(content.encode("latin-1"))
    elif content is not None:
        write(store, content)
    seconds, source = launcher.expected_cold_s(W16, 4)
    assert (seconds, source) == (1.5 + 0.8 * 4 + launcher.first_run_allowance_s(4), "as on a 2-core machine")
    note, _ = launcher._start_note(4, None, W16)
    assert note.startswith(f"starting 4 ranks (a cold start: about {seconds:.0f} s to start them and run {W16} for "
                           "the first time, as on a 2-core machine;")
    # and the next cold start writes a good record over it
    launcher._record_first_run(W16, 4, 6.0, start_s=4.0)
    assert launcher.expected_cold_s(W16, 4) == (10.0, "measured here on its last cold start")


def test_a_record_that_cannot_be_written_costs_nothing(store):
    store.parent.mkdir(parents=True)
    store.mkdir()  # a directory where the file should be: reading and writing both fail
    launcher._record_first_run(W16, 4, 6.0, start_s=4.0)
    launcher._record_start(4, 4.0)
    assert launcher.expected_cold_s(W16, 4)[1] == "as on a 2-core machine"


def test_an_estimate_that_raises_still_gives_a_note(store, monkeypatch):
    def broken(worker, world_size):
        raise RuntimeError("a bug in the estimate")

    monkeypatch.setattr(launcher, "expected_cold_s", broken)
    note, seconds = launcher._start_note(2, None, W16)
    assert seconds == 1.5 + 0.8 * 2 + launcher.first_run_allowance_s(2)
    assert note == (f"starting 2 ranks (a cold start: about 7 s to start them and run {W16} for the first time, as on a "
                    "2-core machine; longer while the machine is busy)")


def test_writers_at_once_leave_a_record_every_reader_can_read(store):
    errors = []

    def writer(i):
        try:
            for n in range(20):
                launcher._record_first_run(f"workers.w{i}", 2, 1.0 + n, start_s=2.0)
                launcher.expected_cold_s(f"workers.w{(i + 1) % 4}", 2)
        except Exception as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    seen = json.loads(store.read_text())  # whole: written then renamed, never half a file
    assert seen["2"] == 2.0 and isinstance(seen["cold_runs"], dict)
    assert not list(store.parent.glob("*.tmp"))


def test_the_idle_stop_is_said_before_the_estimate(store):
    key = ("probe",)
    launcher._retired[key] = 700.0
    note, _ = launcher._start_note(2, key, "workers.hello")
    assert note.startswith("the warm ranks of world 2 had stopped after 12 min idle (COURSE_POOL_IDLE_S=")
    assert "): starting 2 ranks (a cold start: about " in note
    assert key not in launcher._retired  # said once


def test_the_widget_status_shows_the_whole_wait_while_it_waits(store, monkeypatch):
    """The status line of a LiveRun whose run starts ranks is the launcher's note (with no 'then running' after a
    number that already counts the run); a warm run says warm. A stand-in job: no ranks needed to read a status line."""
    from course_utils import widgets

    released = threading.Event()

    class Pending:
        def __init__(self, cold):
            self.cold = cold
            self.start_note = launcher._start_note(4, None, W16)[0] if cold else ""

        def wait(self):
            released.wait(30)
            raise launcher.JobCancelled("stand-in")

    write(store, {"cold_runs": {f"{W16}@4": {"runs": [[4.5, 6.5]]}}})
    jobs = iter([Pending(True), Pending(False)])
    monkeypatch.setattr(widgets, "launch", lambda *a, **k: next(jobs))
    value = widgets.slider("value", 1, 0, 3)
    live = widgets.LiveRun(W16, {"value": value}, lambda r, p: "", params={"world_size": 4})
    assert live.status.value == (f"<i>starting 4 ranks (a cold start: about 11 s to start them and run {W16} for the "
                                 "first time, measured here on its last cold start; longer while the machine is busy): "
                                 "running on real ranks...</i>")
    released.set()
    assert live.wait(30)
    released.clear()
    value.value = 2
    assert live.status.value == "<i>running on real ranks (warm)...</i>"
    released.set()
    assert live.wait(30)


@pytest.mark.ranks
def test_a_cold_start_on_real_ranks_updates_the_record_with_what_it_cost(store):
    """Start and first run are recorded as the launcher saw them: the start is the result's own startup_seconds, and
    start + first run is the job's wait from the call to the answer (whatever this machine's speed)."""
    job = launcher.launch("workers.hello", world_size=1, warm=False, value=1.0)
    assert job.cold and job.expected_s == launcher.expected_cold_s("workers.hello", 1)[0] == pytest.approx(
        1.5 + 0.8 + launcher.first_run_allowance_s(1))  # nothing recorded yet: the model
    res = job.wait()
    seen = json.loads(store.read_text())
    (start, first), = seen["cold_runs"]["workers.hello@1"]["runs"]
    assert seen["1"] == round(res.startup_seconds, 1) and start == round(res.startup_seconds, 2)
    assert start + first == pytest.approx(job.waited_s, abs=0.02)
    assert launcher.expected_cold_s("workers.hello", 1) == (pytest.approx(job.waited_s, abs=0.02),
                                                            "measured here on its last cold start")
    again = launcher.launch("workers.hello", world_size=1, warm=False, value=1.0)
    assert again.start_note.startswith("starting 1 rank (a cold start: about ") and \
        again.start_note.endswith(" s to start it and run workers.hello for the first time, measured here on its "
                                  "last cold start; longer while the machine is busy)")
    again.wait()
    assert len(json.loads(store.read_text())["cold_runs"]["workers.hello@1"]["runs"]) == 2
