"""The launcher's promises, each tested on real torchrun ranks (gloo, CPU).

Every test here would fail if the property it names were missing: a crash must end the job promptly with
the rank's own traceback; a stuck rank must end at the timeout with the stuck collective named; a cancel
must leave no process behind; two jobs at once must not collide; bad input must be refused before launch.
"""
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

import course_utils as cu
from course_utils import reaper
from course_utils.jobs import describe_stack

pytestmark = [pytest.mark.ranks, pytest.mark.once]  # process handling: the same on every CPU


def _gone(pids, within=10.0):
    deadline = time.time() + within
    while time.time() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.1)
    return False


def test_results_come_back_from_every_rank():
    res = cu.run("workers.hello", world_size=4, value=1.0)
    # sum over ranks of (rank + 1) = n(n+1)/2 = 10, seen identically by every rank
    assert res.gather("sum") == [10.0] * 4
    assert [d["env"]["RANK"] for d in res.ranks] == ["0", "1", "2", "3"]
    assert res.backend == "gloo" and res.devices == ["cpu"] * 4


def test_the_seed_reaches_a_worker_that_takes_one():
    # cu.run's seed seeds the ranks' generators and is the worker's own `seed` parameter when main has one: a
    # run "at seed 7" must not silently draw seed 0's data (as chapter 14's seeded tests once did)
    runs = {seed: cu.run("workers.ch14_ring_attention", world_size=2, seq=8, seed=seed) for seed in (0, 7)}
    assert [runs[s][0]["config"]["seed"] for s in (0, 7)] == [0, 7]
    assert runs[0][0]["out"].ne(runs[7][0]["out"]).any()  # other inputs, other attention outputs
    assert cu.run("workers.hello", world_size=1, value=1.0, seed=3).gather("sum") == [1.0]  # no seed parameter


def test_warm_rerun_reuses_ranks_and_says_so():
    first = cu.run("workers.hello", world_size=2, value=0.0)
    again = cu.run("workers.hello", world_size=2, value=5.0)
    assert again.launch == "warm"
    # new parameters reached the same processes: 5*2 + (0+1) = 11
    assert again.gather("sum") == [11.0, 11.0]
    assert again.gather("pid") == first.gather("pid") or first.launch == "cold"


def test_cold_run_leaves_no_process():
    res = cu.run("workers.hello", world_size=2, warm=False)
    assert res.launch == "cold"
    assert _gone(res.gather("pid"))


def test_crash_ends_job_promptly_with_the_rank_traceback():
    start = time.time()
    with pytest.raises(cu.WorkerFailed) as info:
        cu.run("workers.rank_faults", world_size=2, mode="raise", bad_rank=1, timeout=120)
    assert time.time() - start < 60  # well before the 120 s timeout (a cold start included): the error ended it
    err = info.value
    assert err.rank == 1 and err.error_type == "ValueError"
    assert "rank 1 was told to fail" in str(err)
    assert "rank_faults.py" in err.rank_traceback  # the rank's own traceback, not the notebook's


def test_a_connection_lost_while_making_groups_is_retried_once_on_fresh_ranks(tmp_path):
    """Gloo's rare "Broken pipe" from new_group (a CI run met it) is the machine's, not the worker's: one rerun."""
    attempts = tmp_path / "attempts"
    res = cu.run("tests.rank_helpers.group_fault", world_size=2, attempts=str(attempts), faults=1, timeout=120)
    assert res.gather("sum") == [2.0, 2.0] and res.gather("run") == [2, 2]
    assert res.launch == "cold"  # the failed job's ranks were closed: the rerun started new ones
    assert "rank 0 lost a connection while making process groups (DistNetworkError: Broken pipe)" in res.retried
    assert "repeated once on fresh ranks" in res.describe()


def test_the_same_connection_loss_twice_is_raised(tmp_path):
    attempts = tmp_path / "attempts"
    with pytest.raises(cu.WorkerFailed) as info:
        cu.run("tests.rank_helpers.group_fault", world_size=2, attempts=str(attempts), faults=2, timeout=120)
    assert info.value.error_type == "DistNetworkError" and "_new_process_group_helper" in info.value.rank_traceback
    assert attempts.read_text().count("run") == 2  # tried, retried, then raised: never a third time


def test_an_error_of_the_workers_own_while_making_groups_is_not_retried(tmp_path):
    attempts = tmp_path / "attempts"
    with pytest.raises(cu.WorkerFailed) as info:
        cu.run("tests.rank_helpers.group_fault", world_size=2, attempts=str(attempts), faults=1, error="ValueError",
               timeout=120)
    assert info.value.error_type == "ValueError"
    assert attempts.read_text().count("run") == 1


def test_rank_that_dies_without_traceback_is_named():
    with pytest.raises(cu.WorkerFailed) as info:
        cu.run("workers.rank_faults", world_size=2, mode="die", bad_rank=0, timeout=60)
    assert "died" in str(info.value) and info.value.rank == 0


def test_stuck_rank_times_out_and_names_the_collective():
    start = time.time()
    with pytest.raises(cu.JobTimeout) as info:
        cu.run("workers.rank_faults", world_size=2, mode="skip_collective", bad_rank=1, seconds=300, timeout=4, warm=False)
    # ended by the 4 s job timeout (plus a cold start), not by gloo's 60 s timeout nor the 300 s sleep
    assert time.time() - start < 55
    stuck = info.value.stuck
    # rank 0 is inside all_reduce, waiting for rank 1, which is sleeping at the line that skips it
    assert "all_reduce" in stuck[0], stuck
    assert "rank_faults.py" in stuck[1] and "sleep" in stuck[1], stuck


def test_short_collective_timeout_turns_a_hang_into_an_error():
    # The injected fault in chapter 01: gloo itself gives up after 2 s and rank 0 reports where.
    with pytest.raises(cu.WorkerFailed) as info:
        cu.run("workers.rank_faults", world_size=2, mode="skip_collective", bad_rank=1, seconds=30,
               collective_timeout=2.0, timeout=40, warm=False)
    assert info.value.rank == 0
    assert "all_reduce" in info.value.rank_traceback


def test_cancel_leaves_no_process_behind():
    job = cu.launch("workers.rank_faults", world_size=2, mode="slow_metrics", seconds=60, timeout=120, warm=False)
    deadline = time.time() + 60
    while not all(job.metrics) and time.time() < deadline:  # metrics stream while it runs
        time.sleep(0.1)
    assert all(len(m) > 0 for m in job.metrics)
    pids = job._rank_job.pids()
    job.cancel()
    with pytest.raises(cu.JobCancelled):
        job.wait()
    assert _gone(pids), [p for p in pids if psutil.pid_exists(p)]


def test_two_jobs_at_once_do_not_collide():
    results, errors = [], []

    def one(value):
        try:
            results.append(cu.run("workers.hello", world_size=2, value=value, warm=False).gather("sum"))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(v,)) for v in (1.0, 2.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(r[0] for r in results) == [3.0, 5.0]


@pytest.mark.parametrize("kwargs, fragment", [
    ({"world_size": 0}, "starts no rank"),
    ({"world_size": 9}, "at most 8"),
    ({"world_size": 2.5}, "whole number"),
    ({"world_size": 2, "mode": "explode"}, "mode='explode' is not one of"),
    ({"world_size": 2, "bad_rank": 3}, "use 0 to 1"),
    ({"world_size": 2, "sconds": 3}, "did you mean 'seconds'"),
    ({"world_size": 2, "seconds": "long"}, "should be a float"),
    ({"world_size": 4, "nnodes": 3}, "divides world_size"),
])
def test_invalid_parameters_are_rejected_before_launch(kwargs, fragment):
    before = set(psutil.Process().children(recursive=True))
    with pytest.raises(cu.InvalidParameter) as info:
        cu.launch("workers.rank_faults", **kwargs)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)  # one sentence
    assert set(psutil.Process().children(recursive=True)) == before  # nothing was started


def test_ranks_leave_when_their_notebook_is_killed(tmp_path, monkeypatch):
    # A "notebook" process starts warm ranks, then is killed with SIGKILL (no atexit, no cleanup).
    from course_utils.scratch import SCRATCH

    script = textwrap.dedent("""
        import course_utils as cu
        from course_utils import launcher
        res = cu.run("workers.hello", world_size=2)
        agents = [a.pid for job in launcher._pools.values() for a in job.agents]
        print(" ".join(str(p) for p in res.gather("pid")), flush=True)
        print(" ".join(str(p) for p in agents), flush=True)
        print(" ".join(job.id for job in launcher._pools.values()), flush=True)
        import time; time.sleep(600)
    """)
    env = dict(os.environ, COURSE_CACHE_DIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    pids = [int(p) for p in proc.stdout.readline().split()]
    agents = [int(p) for p in proc.stdout.readline().split()]
    log_dir = SCRATCH / "torchelastic" / proc.stdout.readline().strip()  # the job's torchrun logs
    proc.kill()
    proc.wait()
    assert len(pids) == 2 and len(agents) == 1
    assert _gone(pids, within=15)  # the ranks saw their socket close and left
    # and the torchrun agent got its parent-death signal: nothing is left for a reaper that may never run
    # (this registry is in a temporary folder no later launch will look at)
    assert _gone(agents, within=15)
    # Only the job's log folder is left, since close() never ran; the next launch's reaper (here: one with this
    # registry) finds the dead owner and removes the folder the job recorded.
    assert log_dir.is_dir(), f"the job's torchrun logs are not in {log_dir}"
    monkeypatch.setenv("COURSE_CACHE_DIR", str(tmp_path))
    assert reaper.reap_stale() == 1
    assert not log_dir.exists()


def test_warm_ranks_started_from_a_short_lived_thread_outlive_it():
    """The parent-death signal fires when the *thread* that forked the agent exits (prctl(2)): an exercise check
    runs in a thread of its own, and ranks it started used to die with it, so every check after the first started
    cold. ``reaper.spawn`` forks from one thread that lives as long as the notebook."""
    import threading

    world = 3  # a world size no other test keeps warm: this run must start the ranks
    first = {}
    thread = threading.Thread(target=lambda: first.update(res=cu.run("workers.hello", world_size=world)))
    thread.start()
    thread.join()
    assert first["res"].launch == "cold"
    time.sleep(1.0)  # a killed agent would be gone by now
    assert cu.run("workers.hello", world_size=world).launch == "warm"


def test_spawn_raises_what_popen_raises_in_the_callers_thread():
    with pytest.raises(FileNotFoundError):
        reaper.spawn(["/nonexistent/torchrun"])
    proc = reaper.spawn([sys.executable, "-c", "print('ok')"], stdout=subprocess.PIPE, text=True)
    assert proc.communicate(timeout=30)[0] == "ok\n"


def test_idle_warm_ranks_stop_by_themselves_and_the_next_run_says_so(tmp_path):
    """A notebook that runs once and then sits (its tab closed, its kernel alive) loses its ranks after the stated
    idle time, with nobody calling anything; the next run is announced as a cold start after that idle stop, with
    the time this machine's last cold start of that worker on that many ranks took."""
    script = textwrap.dedent("""
        import json, time
        import course_utils as cu
        from course_utils import launcher
        res = cu.run("workers.hello", world_size=2)
        print(json.dumps({"pids": res.gather("pid"), "launch": res.launch, "started": res.startup_seconds,
                          "expected": launcher.expected_start_s(2)}), flush=True)
        time.sleep(6)                       # idle: nothing runs, nobody asks
        print(json.dumps({"warm": cu.warm_pools()}), flush=True)
        job = cu.launch("workers.hello", world_size=2)
        res = job.wait()
        print(json.dumps({"cold": job.cold, "note": job.start_note, "launch": res.launch}), flush=True)
        job = cu.launch("workers.hello", world_size=2)
        job.wait()
        print(json.dumps({"cold": job.cold, "note": job.start_note}), flush=True)
    """)
    env = dict(os.environ, COURSE_POOL_IDLE_S="2")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=240,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    first, idle, again, warm = (json.loads(line) for line in out.stdout.strip().splitlines())
    assert first["launch"] == "cold" and first["expected"] == [round(first["started"], 1), "this machine's last start"]
    assert idle["warm"] == [], "the idle ranks were still warm after 6 s with COURSE_POOL_IDLE_S=2"
    assert _gone(first["pids"], within=10), "the idle ranks' processes are still running"
    assert again["cold"] and again["launch"] == "cold"
    assert again["note"].startswith("the warm ranks of world 2 had stopped after ") and " s idle " in again["note"]
    # the time announced is the whole wait this machine's last cold start of workers.hello at 2 ranks took (the
    # ranks' start and the worker's first run on them), recorded by the first run above
    assert "starting 2 ranks (a cold start: about " in again["note"]
    assert "s to start them and run workers.hello for the first time, " in again["note"]
    assert "measured here on its last cold start" in again["note"] or "cold starts here" in again["note"]  # or a median
    assert warm == {"cold": False, "note": ""}


def test_stale_jobs_of_a_dead_owner_are_reaped(tmp_path, monkeypatch):
    # A process that survived its notebook (say the ranks were stuck in native code), registered by an
    # owner that no longer exists: the next launch must kill it, and must spare jobs of live owners.
    monkeypatch.setenv("COURSE_CACHE_DIR", str(tmp_path))
    dead_owner = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_owner.wait()
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    kept = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        created = psutil.Process(orphan.pid).create_time()
        (reaper.registry_dir() / "stale.json").write_text(json.dumps(
            {"owner": [dead_owner.pid, 1.0], "pids": [[orphan.pid, created]]}))
        reaper.register("mine", [kept.pid])  # owner: this live test process
        assert reaper.reap_stale() == 1
        assert orphan.wait(timeout=10) is not None
        assert kept.poll() is None
        assert [p.name for p in reaper.registry_dir().glob("*.json")] == ["mine.json"]
    finally:
        for p in (orphan, kept):
            p.kill()
            p.wait()


def test_reaper_spares_a_process_that_reused_a_recorded_pid(tmp_path, monkeypatch):
    # The registry outlives reboots and pids are recycled: an entry whose pid now belongs to another program
    # (different start time) must not get that program killed.
    monkeypatch.setenv("COURSE_CACHE_DIR", str(tmp_path))
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        created = psutil.Process(bystander.pid).create_time()
        (reaper.registry_dir() / "old.json").write_text(json.dumps(
            {"owner": [bystander.pid, created - 3600.0], "pids": [[bystander.pid, created - 3600.0]]}))
        assert reaper.reap_stale() == 1  # the entry is gone ...
        time.sleep(0.2)
        assert bystander.poll() is None  # ... and the process now holding that pid lives on
        assert not list(reaper.registry_dir().glob("*.json"))
    finally:
        bystander.kill()
        bystander.wait()


def test_torchrun_logs_stay_in_the_jobs_scratch_folder_and_leave_with_the_job(tmp_path, monkeypatch):
    # torchrun --tee writes each rank's stdout/stderr to files and tails them back; without --log-dir it makes
    # a torchelastic_* folder in the temp directory per launch and nobody removes it (thousands piled up).
    # The job's own folder, build/scratch/torchelastic/<job id>, holds them instead, the lines still reach the
    # notebook with their rank, and closing the job removes the folder.
    from course_utils.scratch import SCRATCH

    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the agents inherit it: tempfile.mkdtemp would land here
    job = cu.launch("tests.rank_helpers.say", world_size=2, text="tee check", warm=False, timeout=60)
    res = job.wait()
    rank_job = job._rank_job
    assert rank_job.closed
    assert not list(tmp_path.glob("torchelastic_*")), sorted(tmp_path.iterdir())
    log_dir = SCRATCH / "torchelastic" / rank_job.id
    for rank, r in enumerate(res.ranks):  # the ranks' torchrun files were in the job's folder while it ran
        assert r["error_file"].startswith(f"{log_dir}{os.sep}"), r["error_file"]
        for stream in ("stdout", "stderr"):
            assert f"[rank {rank}] tee check on {stream} from rank {rank}" in rank_job.output, list(rank_job.output)
    assert not log_dir.exists(), sorted(log_dir.rglob("*"))


def test_the_reaper_removes_only_torchrun_log_folders(tmp_path, monkeypatch):
    # The registry is a file anyone can edit: a recorded path that is not build/scratch/torchelastic/<job id>
    # must survive, even when its job is reaped.
    monkeypatch.setenv("COURSE_CACHE_DIR", str(tmp_path / "cache"))
    dead_owner = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_owner.wait()
    precious = tmp_path / "precious"
    precious.mkdir()
    logs = tmp_path / "build" / "scratch" / "torchelastic" / "1-1-abcdef"
    logs.mkdir(parents=True)
    for name, folder in (("other", precious), ("job", logs)):
        (reaper.registry_dir() / f"{name}.json").write_text(json.dumps(
            {"owner": [dead_owner.pid, 1.0], "pids": [], "log_dir": str(folder)}))
    assert reaper.reap_stale() == 2
    assert precious.is_dir() and not logs.exists()


def test_startup_timeout_says_which_ranks_never_connected_and_leaves_nothing():
    # Far too short a limit for torchrun to start and import torch: the message must say where the ranks
    # got to (not just "did not start") and how loaded the machine is, and the agents must be gone.
    from course_utils.jobs import RankJob

    job = RankJob(2, startup_timeout_s=0.3)
    agents = [a.pid for a in job.agents]
    with pytest.raises(cu.WorkerFailed) as info:
        job.wait_ready()
    message = str(info.value)
    assert "did not start within 0 s" in message or "did not start within 1 s" in message
    assert "never connected" in message and "load average" in message
    assert "COURSE_STARTUP_TIMEOUT" in message
    assert _gone(agents)


def test_registry_updates_from_many_threads_at_once_never_fail(tmp_path, monkeypatch):
    # Ranks say hello at the same moment and each reader thread updates the job's entry. With one shared
    # temporary file, one thread's rename stole another's file, and the FileNotFoundError killed that rank's
    # results stream: the rank looked "connected but never ready" until the startup timeout.
    monkeypatch.setenv("COURSE_CACHE_DIR", str(tmp_path))
    from concurrent.futures import ThreadPoolExecutor

    def hammer(_):
        for _ in range(50):
            reaper.register("busy", [os.getpid()])

    with ThreadPoolExecutor(8) as pool:
        for done in [pool.submit(hammer, i) for i in range(8)]:
            done.result()  # re-raises a thread's FileNotFoundError here
    entry = json.loads((reaper.registry_dir() / "busy.json").read_text())
    assert entry["pids"][0][0] == os.getpid()
    assert not list(reaper.registry_dir().glob("*.tmp")) and not list(reaper.registry_dir().glob(".*.tmp"))


def test_describe_stack_names_the_collective():
    stack = [["/w/workers/pool.py", 10, "run_task", "module.main(ctx)"],
             ["/w/workers/lab.py", 42, "main", "dist.all_reduce(x)"],
             ["/v/torch/distributed/c10d_logger.py", 80, "wrapper", "return func()"],
             ["/v/torch/distributed/distributed_c10d.py", 2500, "all_reduce", "work.wait()"]]
    assert describe_stack(stack) == "waiting in all_reduce called at lab.py:42 (dist.all_reduce(x))"
    stack[1] = ["<notebook: ring_all_reduce>", 7, "ring_all_reduce", ""]  # source sent from a notebook: no line text
    assert describe_stack(stack) == "waiting in all_reduce called at <notebook: ring_all_reduce>:7"


def test_watch_shows_live_metrics_then_the_outcome():
    job = cu.launch("workers.rank_faults", world_size=2, mode="slow_metrics", seconds=1.0, timeout=60)
    view = job.watch()
    status = view.children[0].children[1]
    res = job.wait()
    deadline = time.time() + 5
    while "done" not in status.value and time.time() < deadline:
        time.sleep(0.05)
    assert "done" in status.value and res.metrics[0][-1]["step"] == 9


def test_any_file_under_workers_moves_the_code_version(tmp_path):
    # Editing any file under workers/ (a module the worker imports, not just the worker itself) must count. Done on a
    # copy: touching the course's own workers/ would restart the warm ranks of a test running beside this one.
    from course_utils import launcher
    from course_utils.paths import ROOT

    for rel in ("hello.py", "protocol.py"):
        (tmp_path / "workers" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "workers" / rel).write_bytes((ROOT / "workers" / rel).read_bytes())
    dep = tmp_path / "workers" / "protocol.py"
    os.utime(tmp_path / "workers" / "hello.py", (1_000_000, 1_000_000))
    os.utime(dep, (1_000_000, 1_000_000))
    before = launcher._workers_version(tmp_path)
    os.utime(dep)  # "edit" a module the worker imports
    assert launcher._workers_version(tmp_path) > before


def test_warm_ranks_restart_when_a_worker_dependency_changes(monkeypatch):
    # The ranks' side of the rule above: warm ranks whose code version is older than the files are replaced.
    first = cu.run("workers.hello", world_size=1)
    again = cu.run("workers.hello", world_size=1)
    assert again.launch == "warm"
    edited = cu.launcher._workers_version() + 1.0
    monkeypatch.setattr(cu.launcher, "_workers_version", lambda root=None: edited)
    after = cu.run("workers.hello", world_size=1)
    assert after.launch == "cold" and after.gather("pid") != first.gather("pid")
    assert cu.run("workers.hello", world_size=1).launch == "warm"  # the new ranks carry the new version


def test_a_frame_of_unknown_kind_is_refused_at_the_sender():
    from workers import protocol

    with pytest.raises(ValueError, match="unknown frame kind 'reslut'"):
        protocol.encode("reslut", {"x": 1})
    frame = protocol.encode("result", {"x": 1}, rank=0)
    assert protocol.decode(frame[protocol.HEADER.size:])["data"] == {"x": 1}
