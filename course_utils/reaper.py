"""No process outlives its notebook.

Three layers, because each alone has a hole:
1. every rank keeps a socket to the notebook and exits the moment it closes (``workers/pool.py``);
2. on Linux each torchrun agent gets ``PR_SET_PDEATHSIG``: if the notebook's kernel dies, the agent is
   sent SIGKILL (not SIGTERM: torchrun's SIGTERM handler sometimes hung in its own shutdown with its workers
   already gone, about one kill in six here, and the agent lived on as an orphan); its ranks leave by 1.;
3. every job is written to a registry (one small JSON file per job in the user's cache). The next time
   any notebook starts a job, jobs whose owner is dead are killed here ("stale jobs are reaped"), and the
   torchrun log folder each one recorded (``scratch.job_log_dir``) is removed with them.
"""
from __future__ import annotations

import ctypes
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil

from course_utils import scratch


def registry_dir() -> Path:
    root = os.environ.get("COURSE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "parallel-course")
    path = Path(root) / "jobs"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _identity(pid: int) -> list | None:
    """(pid, start time): a pid alone can be reused by an unrelated process after ours is gone."""
    try:
        return [pid, psutil.Process(pid).create_time()]
    except psutil.Error:
        return None


def _process(ident: list) -> psutil.Process | None:
    """The process ``ident`` names if it is still that process (same start time), else None."""
    pid, created = ident
    try:
        proc = psutil.Process(pid)
        return proc if abs(proc.create_time() - created) < 1e-3 else None
    except psutil.Error:
        return None


def _alive(ident: list) -> bool:
    return _process(ident) is not None


def register(job_id: str, pids: list[int], log_dir: str | None = None) -> None:
    """Record (or update) a job's processes, and the torchrun log folder to remove with them. Safe to call
    from several threads and processes at once: each call writes its own temporary file and renames it over
    the entry (the last rename wins, whole)."""
    owner = _identity(os.getpid())
    idents = [i for i in (_identity(p) for p in pids) if i]
    path = registry_dir() / f"{job_id}.json"
    tmp = path.with_name(f".{job_id}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps({"owner": owner, "pids": idents, "log_dir": log_dir}))
    os.replace(tmp, path)


def unregister(job_id: str) -> None:
    try:
        (registry_dir() / f"{job_id}.json").unlink()
    except FileNotFoundError:
        pass


def kill_tree(pids: list[int | psutil.Process], *, grace_s: float = 0.0) -> None:
    """Kill the given processes and all their descendants (SIGTERM first when ``grace_s`` > 0).

    Pass plain pids only for children this process has not yet waited for (their pid cannot be reused);
    for anything else pass the ``psutil.Process`` found when its identity was checked: psutil refuses to
    signal a Process whose pid now belongs to another program.
    """
    procs: dict[int, psutil.Process] = {}
    for item in pids:
        try:
            p = item if isinstance(item, psutil.Process) else psutil.Process(item)
        except psutil.Error:
            continue
        procs[p.pid] = p
        try:
            for child in p.children(recursive=True):
                procs[child.pid] = child
        except psutil.Error:
            pass
    if not procs:
        return
    if grace_s > 0:
        for p in procs.values():
            try:
                p.send_signal(signal.SIGTERM)
            except psutil.Error:
                pass
        _, procs_left = psutil.wait_procs(list(procs.values()), timeout=grace_s)
    else:
        procs_left = list(procs.values())
    for p in procs_left:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs_left, timeout=5)


def reap_stale() -> int:
    """Kill the processes of jobs whose notebook is gone, and remove their torchrun log folders. Returns how
    many jobs were reaped."""
    reaped = 0
    for path in registry_dir().glob("*.json"):
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):
            path.unlink(missing_ok=True)
            continue
        owner = entry.get("owner")
        if owner and _alive(owner):
            continue
        live = [proc for proc in (_process(ident) for ident in entry.get("pids", [])) if proc is not None]
        kill_tree(live)
        if entry.get("log_dir"):  # after the kill: a live agent would go on writing into it
            scratch.remove_job_log_dir(entry["log_dir"])
        path.unlink(missing_ok=True)
        reaped += 1
    return reaped


_spawn_requests: "queue.Queue | None" = None
_spawner_lock = threading.Lock()


def _spawner_loop(requests: "queue.Queue") -> None:
    while True:
        cmd, kwargs, done = requests.get()
        try:
            done["proc"] = subprocess.Popen(cmd, preexec_fn=die_with_parent, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            done["error"] = exc
        done["event"].set()


def spawn(cmd: list[str], **popen_kwargs) -> subprocess.Popen:
    """``subprocess.Popen(cmd, preexec_fn=die_with_parent, **popen_kwargs)``, forked from one thread that lives as
    long as this process.

    ``PR_SET_PDEATHSIG`` fires when the *thread* that forked the child exits, not the process (prctl(2)). An agent
    forked from a short-lived thread (an exercise check runs in one, so that an endless answer cannot freeze the
    notebook) was killed the moment that thread ended, and its warm ranks with it: every later run started cold
    (chapter 15's 8-rank check took 14 s each time instead of 0.3 s). The spawning thread is a daemon: nothing joins
    it at exit, so the kernel's atexit handlers still close the warm ranks gracefully before it goes."""
    global _spawn_requests
    with _spawner_lock:
        if _spawn_requests is None:
            _spawn_requests = queue.Queue()
            threading.Thread(target=_spawner_loop, args=(_spawn_requests,), name="course-spawner", daemon=True).start()
    done = {"event": threading.Event()}
    _spawn_requests.put((cmd, popen_kwargs, done))
    done["event"].wait()
    if "error" in done:
        raise done["error"]
    return done["proc"]


def die_with_parent() -> None:
    """``preexec_fn`` for the torchrun agent: SIGKILL it when the thread that started it dies (Linux): ``spawn``
    forks from a thread that lives as long as the notebook's kernel."""
    os.setsid()  # its own process group, so a cancel can signal the agent without touching the notebook
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
