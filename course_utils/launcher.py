"""``run`` and ``launch``: start a worker on real ranks from a notebook and get its results back.

    res = run("workers.ch01_collectives", world_size=4, collective="all_reduce")
    res[2]["after"]                   # rank 2's tensor after the collective

    job = launch("workers.ch02_ddp", world_size=2, steps=50)   # returns at once
    job.metrics                       # per-rank metric streams, growing while it runs
    job.cancel()                      # stops every process of the job
    res = job.wait()

Warm ranks: by default the ranks of a run stay up afterwards (one set per world size), so the next run
with the same world size skips torchrun's start (seconds) and answers in milliseconds. Each run is
still a new execution of the worker with a fresh seed; ``RunResult.launch`` says "cold" or "warm".
``warm=False`` starts and stops ranks just for this run. A failed, timed-out or cancelled run stops its
ranks; the next run starts new ones.

Warm ranks do not outlive their use: a set left idle for ``POOL_IDLE_S`` (10 minutes; ``COURSE_POOL_IDLE_S``)
is stopped by a background thread of the notebook's kernel, whether or not the notebook's tab is still open, and
the next run that needs it says so (``Job.start_note``). A cold start is announced with the time the caller will
wait, from the call to the answer (``expected_cold_s``): the ranks' start (torchrun, ``import torch``, rendezvous)
and the worker's first run on new ranks (its imports, building its model, first allocations, autograd's first pass:
seconds, where the same run on warm ranks takes one). Each cold start that answers records both, per worker and world
size (``build/cold_starts.json``); a worker never started cold here is estimated from its record at another size, or
from that many ranks' start and an allowance measured on a 2-core machine. On a machine busier than it has cores
(its 1-minute load average above the core count) that time is stretched by load / cores, and the note says so.
``run`` in a notebook prints the note as a progress line before it waits (``course_utils.progress``); a widget shows
it in its status line.
"""
from __future__ import annotations

import atexit
import collections
import inspect
import json
import math
import os
import statistics
import textwrap
import threading
import time
from typing import Any, Callable

from course_utils import progress
from course_utils.jobs import RankJob
from course_utils.results import CourseError, InvalidParameter, JobCancelled, RunResult, WorkerFailed
from course_utils.validate import check_params, current_names, max_world_size, takes_param
from workers.runtime import DEFAULT_COLLECTIVE_TIMEOUT_S

DEFAULT_TIMEOUT_S = 60.0
POOL_IDLE_S = float(os.environ.get("COURSE_POOL_IDLE_S", 600))
MAX_WARM_RANKS = int(os.environ.get("COURSE_MAX_WARM_RANKS", 8))

_pools: "collections.OrderedDict[tuple, RankJob]" = collections.OrderedDict()
_pools_lock = threading.Lock()
_retired: dict[tuple, float] = {}  # pool key -> how long it had been idle when it was stopped for that
_reaper: threading.Thread | None = None


def ship_callable(fn: Callable) -> dict:
    """A function defined in the notebook, sent to the ranks as source (it must not use notebook globals)."""
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as exc:
        raise InvalidParameter(
            f"cannot send {getattr(fn, '__name__', fn)!r} to the ranks: define it with `def` in a cell of its own") from exc
    return {"__course_callable__": True, "name": fn.__name__, "source": source}


def _wire_params(params: dict) -> dict:
    out = {}
    for key, value in params.items():
        if callable(value) and not isinstance(value, type):
            out[key] = ship_callable(value)
        else:
            out[key] = value
    return out


def _pool_key(world_size, nnodes, env, collective_timeout_s) -> tuple:
    return (world_size, nnodes, tuple(sorted((env or {}).items())), collective_timeout_s)


def _idle_s(job: RankJob, now: float) -> float:
    return now - getattr(job, "last_used", job.started_at)


def _retire_idle(now: float) -> None:
    """Stop the warm sets that died or sat idle longer than POOL_IDLE_S (caller holds ``_pools_lock``)."""
    for key, job in list(_pools.items()):
        if job.busy.locked():
            continue
        if not job.alive():
            _pools.pop(key).close()
        elif _idle_s(job, now) > POOL_IDLE_S:
            _retired[key] = _idle_s(job, now)
            _pools.pop(key).close(graceful=True)


def _reap_idle_pools() -> None:
    """The kernel's background thread: idle ranks leave by themselves, even if nobody runs anything again."""
    while True:
        time.sleep(min(30.0, max(POOL_IDLE_S / 4, 0.2)))
        with _pools_lock:
            _retire_idle(time.time())


def _start_reaper() -> None:
    global _reaper
    if _reaper is None or not _reaper.is_alive():
        _reaper = threading.Thread(target=_reap_idle_pools, name="course-idle-ranks", daemon=True)
        _reaper.start()


def _evict_for(world_size: int) -> None:
    """Keep at most MAX_WARM_RANKS warm processes: two cores and 24 GB go further that way."""
    _retire_idle(time.time())
    while _pools and sum(j.world_size for j in _pools.values() if not j.busy.locked()) + world_size > MAX_WARM_RANKS:
        idle_keys = [k for k, j in _pools.items() if not j.busy.locked()]
        if not idle_keys:
            break
        _pools.pop(idle_keys[0]).close(graceful=True)


def _cold_starts_file():
    from course_utils.paths import ROOT

    return ROOT / "build" / "cold_starts.json"


# What a cold start costs on top of the ranks' start, for a worker never started cold here: its first run on new
# ranks (importing the worker's modules, building the model, first-time allocations, autograd's first backward).
# Measured on this 2-core machine, another session's runs sharing it (load 1-8), 2026-12-05, first run on new
# ranks at the chapters' default settings (seconds; the same settings rerun warm in brackets):
#   workers.ch02_ddp        2 ranks 2.9 (0.03), 4 ranks 5.0 (0.06)
#   workers.ch15_composed   4 ranks 6.1 (0.84), 8 ranks 8.9 (1.07)   (the chapter 15 widget: tp 2, pp 2, m 2)
#   workers.ch16_moe_train  2 ranks 3.6 (1.4),  4 ranks 6.1 (3.2)    (the chapter 16 widget: 40 steps)
# Ranks share two cores, so the first run grows with the world like the start does: 1.5 s + 1 s per rank.
FIRST_RUN_BASE_S, FIRST_RUN_PER_RANK_S = 1.5, 1.0
RECENT_COLD_STARTS = 3  # per worker and world size: the estimate is the median of these (one busy start is not the rule)


def _read_store() -> dict:
    """The cold-start record, or {} when it is missing, unreadable or not what we wrote: never an error."""
    try:
        seen = json.loads(_cold_starts_file().read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return seen if isinstance(seen, dict) else {}


def _seconds(value) -> float | None:
    """A stored number of seconds, or None for anything else (a corrupt or hand-edited record)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return None
    return float(value)


def _update_store(change: Callable[[dict], None]) -> None:
    """Read, change and write the record. Written whole then renamed: other notebooks (make test runs two executions
    at once) may read it meanwhile; two writers at once may lose one's update, which costs one estimate, nothing more."""
    tmp = None
    try:
        path = _cold_starts_file()
        seen = _read_store()
        change(seen)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(seen, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except Exception:  # noqa: BLE001 - an estimate for next time, never a reason to fail a run
        try:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
        except OSError:
            pass


def cores() -> int:
    """The cores this process may run on (what the ranks share): ``len(os.sched_getaffinity(0))`` where the OS has
    it (Linux), else ``os.cpu_count()``."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def machine_load() -> tuple[float, int]:
    """The 1-minute load average (runnable processes, averaged) and ``cores()``; a load of 0 where the system keeps
    none (Windows)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = 0.0
    return load, cores()


def expected_start_s(world_size: int) -> tuple[float, str]:
    """Seconds the ranks' own start (torchrun, ``import torch``, rendezvous) of ``world_size`` ranks should take here,
    and where that number comes from. What a learner waits for is longer: see ``expected_cold_s``."""
    seen = _seconds(_read_store().get(str(world_size)))
    if seen is not None:
        return seen, "this machine's last start"
    # torchrun, `import torch` and rendezvous on an idle 2-core EPYC (2026-12-04): 2.9 s for 2 ranks,
    # 4.4-4.6 s for 4, 7.4-7.9 s for 8 (workers.rank_faults, warm=False, twice each).
    return 1.5 + 0.8 * world_size, "an idle 2-core machine"


def first_run_allowance_s(world_size: int) -> float:
    """What a worker never started cold here is expected to add on new ranks (see FIRST_RUN_BASE_S)."""
    return FIRST_RUN_BASE_S + FIRST_RUN_PER_RANK_S * world_size


def _cold_key(worker: str, world_size: int) -> str:
    return f"{worker}@{world_size}"


def _first_runs(worker: str) -> dict[int, dict[str, list]]:
    """This machine's record of ``worker``'s first runs, by world size, oldest first: ``"cold"``, [(start s, first run
    s)] of its cold starts; ``"warm"``, [first run s] of its first runs on ranks another worker had started (the same
    imports, model building and first allocations: a stand-in until it has started cold at that size)."""
    runs = _read_store().get("cold_runs")
    out: dict[int, dict[str, list]] = {}
    if not isinstance(runs, dict):
        return out
    for key, entry in runs.items():
        name, _, world = str(key).rpartition("@")
        if name != worker or not world.isdigit() or int(world) < 1 or not isinstance(entry, dict):
            continue
        cold = [(start, first) for start, first in (_pair(p) for p in _list(entry.get("runs"))) if first is not None]
        warm = [f for f in (_seconds(v) for v in _list(entry.get("first_on_warm"))) if f is not None]
        if cold or warm:
            out[int(world)] = {"cold": cold, "warm": warm}
    return out


def _list(value) -> list:
    return value if isinstance(value, list) else []


def _pair(value) -> tuple[float, float | None]:
    """A stored [start s, first run s], or (0, None) when it is not one."""
    if isinstance(value, list) and len(value) == 2:
        start, first = _seconds(value[0]), _seconds(value[1])
        if start is not None and first is not None:
            return start, first
    return 0.0, None


def expected_cold_s(worker: str, world_size: int) -> tuple[float, str]:
    """Seconds a learner waits for ``worker`` on ``world_size`` new ranks, from the call to the answer: the ranks'
    start and the worker's first run on them. Where that number comes from, in words, best first: this machine's
    recent cold starts of that worker at that size (the median of the last few); the start of that many ranks and
    the worker's first run on ranks started for another worker; the same scaled from another size; the start of that
    many ranks and a first run's allowance."""
    runs = _first_runs(worker)
    here = runs.get(world_size, {})
    if here.get("cold"):
        pairs = here["cold"]
        total = statistics.median(start + first for start, first in pairs)
        return total, ("measured here on its last cold start" if len(pairs) == 1
                       else f"the median of its last {len(pairs)} cold starts here")
    start, source = expected_start_s(world_size)
    ranks = f"{world_size} rank{'s' if world_size > 1 else ''}"
    started = (f"this machine's last start of {ranks}" if source == "this machine's last start"
               else "an idle 2-core machine's start")
    if here.get("warm"):
        return start + statistics.median(here["warm"]), f"from {started} and its first run on ranks here"
    if runs:
        # The same worker at another size: its first run scaled as the allowance scales (ranks share the cores).
        near = min(runs, key=lambda w: (abs(w - world_size), -w))
        firsts = [f for _, f in runs[near]["cold"]] or runs[near]["warm"]
        first = statistics.median(firsts) * first_run_allowance_s(world_size) / first_run_allowance_s(near)
        return start + first, f"from {started} and its first run on {near} rank{'s' if near > 1 else ''} here, scaled"
    if source == "this machine's last start":
        return start + first_run_allowance_s(world_size), f"from {started} and a first run's usual time"
    return start + first_run_allowance_s(world_size), "as on a 2-core machine"


def _record_start(world_size: int, seconds: float) -> None:
    """The ranks' start alone (a cold start whose run failed says nothing about the worker's first run)."""
    _update_store(lambda seen: seen.__setitem__(str(world_size), round(seconds, 1)))


def _record_first_run(worker: str, world_size: int, first_s: float, start_s: float | None = None) -> None:
    """After the first run of ``worker`` on a set of ranks that answered: on ranks started for it (``start_s``, a cold
    start: the ranks' start is recorded too), or on warm ranks that had not run it yet. Keeps the last few of each."""
    def change(seen: dict) -> None:
        if start_s is not None:
            seen[str(world_size)] = round(start_s, 1)
        runs = seen.get("cold_runs")
        if not isinstance(runs, dict):
            runs = seen["cold_runs"] = {}
        key = _cold_key(worker, world_size)
        entry = runs.get(key) if isinstance(runs.get(key), dict) else {}
        cold = [p for p in _list(entry.get("runs")) if _pair(p)[1] is not None]
        warm = [v for v in _list(entry.get("first_on_warm")) if _seconds(v) is not None]
        if start_s is not None:
            cold.append([round(start_s, 2), round(first_s, 2)])
        else:
            warm.append(round(first_s, 2))
        runs[key] = {"runs": cold[-RECENT_COLD_STARTS:], "first_on_warm": warm[-RECENT_COLD_STARTS:],
                     "when": time.strftime("%Y-%m-%d %H:%M")}

    _update_store(change)


def _start_note(world_size: int, key: tuple | None, worker: str = "") -> tuple[str, float]:
    """What the learner is told while new ranks start, and the seconds it announces: from the call to the answer."""
    ranks = f"{world_size} rank{'s' if world_size > 1 else ''}"
    try:
        if worker:
            expected, source = expected_cold_s(worker, world_size)
            what = f"to start {'them' if world_size > 1 else 'it'} and run {worker} for the first time, {source}"
        else:
            expected, what = expected_start_s(world_size)
    except Exception:  # noqa: BLE001 - a record we cannot make sense of: the model, never a failed run
        expected = 1.5 + 0.8 * world_size + (first_run_allowance_s(world_size) if worker else 0.0)
        what = (f"to start {'them' if world_size > 1 else 'it'} and run {worker} for the first time, as on a 2-core "
                "machine" if worker else "an idle 2-core machine")
    load, cores = machine_load()
    if load > cores:
        # More runnable processes than cores: the ranks' start and first run get about cores/load of a core each, so
        # the recorded (mostly idle-machine) wait is stretched by load/cores. A model, not a measurement: the 1-minute
        # load average lags, and the records themselves may hold busy starts (their median of the last few damps them).
        expected *= load / cores
        busy = (f", times {load / cores:.1f} because the machine is busy now (load {load:.1f} on {cores} "
                f"core{'s' if cores > 1 else ''})")
    else:
        busy = "; longer while the machine is busy"
    note = f"starting {ranks} (a cold start: about {max(expected, 1):.0f} s {what}{busy})"
    idle = _retired.pop(key, None) if key is not None else None
    if idle is not None:
        took = f"{idle:.0f} s" if idle < 120 else f"{idle / 60:.0f} min"
        note = (f"the warm ranks of world {world_size} had stopped after {took} idle "
                f"(COURSE_POOL_IDLE_S={POOL_IDLE_S:g}): " + note)
    return note, expected


def _workers_version(root=None) -> float:
    """Newest modification time under ``root``/workers/ (the course's by default): warm ranks must not run code older
    than the files."""
    from course_utils.paths import ROOT

    return max((p.stat().st_mtime for p in ((root or ROOT) / "workers").rglob("*.py")), default=0.0)


def _acquire_job(world_size, nnodes, env, collective_timeout_s, warm, worker: str = "",
                 max_restarts: int = 0, min_nodes: int | None = None) -> tuple[RankJob, bool]:
    """A started (maybe still starting) job for this run, and whether it is a pool to give back after."""
    if warm and not max_restarts:
        key = _pool_key(world_size, nnodes, env, collective_timeout_s)
        with _pools_lock:
            job = _pools.get(key)
            if job is not None and job.code_version != _workers_version() and not job.busy.locked():
                # A file under workers/ changed since these ranks started: their imports are stale.
                _pools.pop(key).close(graceful=True)
                job = None
            if job is not None and job.alive() and job.busy.acquire(blocking=False):
                _pools.move_to_end(key)
                return job, True
            if job is None or not job.alive():
                if job is not None:
                    _pools.pop(key).close()
                _evict_for(world_size)
                job = RankJob(world_size, nnodes=nnodes, env=env, collective_timeout_s=collective_timeout_s)
                job.code_version = _workers_version()
                job.busy.acquire()
                job.start_note, job.start_expected_s = _start_note(world_size, key, worker)
                _pools[key] = job
                _start_reaper()
                return job, True
        # The warm ranks are busy with another run: this run gets ranks of its own.
    job = RankJob(world_size, nnodes=nnodes, env=env, collective_timeout_s=collective_timeout_s,
                  max_restarts=max_restarts, min_nodes=min_nodes)
    job.start_note, job.start_expected_s = _start_note(world_size, None, worker)
    return job, False


class Job:
    """A run in progress. ``wait()`` returns its RunResult or raises what went wrong."""

    def __init__(self, worker: str, world_size: int, params: dict, *, timeout: float, seed: int, warm: bool,
                 nnodes: int, env: dict | None, collective_timeout_s: float,
                 on_event: Callable[[str, int, dict], None] | None, max_restarts: int = 0,
                 min_nodes: int | None = None):
        self._t_launch = time.perf_counter()  # what a cold start's record measures: from here to the answer
        self.worker, self.world_size, self.params = worker, world_size, params
        self.metrics: list[list[dict]] = [[] for _ in range(world_size)]
        self.logs: list[str] = []
        self.status = "starting"
        self._cancel = threading.Event()
        self._done = threading.Event()
        self._result: RunResult | None = None
        self._error: BaseException | None = None
        self._on_event = on_event
        self._watch = None  # (status HTML, log Output) once watch() was called
        self.waited_s: float | None = None  # a cold start that answered: seconds from the call to the answer
        # Processes are started here, in the caller's thread (their parent-death signal follows this thread).
        self._rank_job, self._pooled = _acquire_job(world_size, nnodes, env, collective_timeout_s, warm, worker,
                                                    max_restarts, min_nodes)
        # Whether this run waits for new ranks, the sentence that says so and the seconds it announces (from the call
        # to the answer: the ranks' start and this worker's first run on them).
        self.cold = len(self._rank_job.ready) < world_size
        self.start_note = getattr(self._rank_job, "start_note", "") if self.cold else ""
        self.expected_s = getattr(self._rank_job, "start_expected_s", None) if self.cold else None
        self._thread = threading.Thread(target=self._drive, args=(timeout, seed), daemon=True)
        self._thread.start()

    def _event(self, kind: str, rank: int, data: dict) -> None:
        if kind == "metric":
            self.metrics[rank].append(data)
        elif kind == "log":
            self.logs.append(f"[rank {rank}] {data['text']}")
        if self._on_event is not None:
            try:
                self._on_event(kind, rank, data)
            except Exception:  # a broken progress callback must not kill the run
                pass
        if self._watch is not None and kind in ("metric", "log"):
            self._refresh_watch(kind, rank, data)

    def watch(self):
        """A live view for the notebook: status, the latest metrics per rank, logs, and a cancel button."""
        import ipywidgets as W

        status = W.HTML(f"<b>{self.worker}</b> on {self.world_size} rank(s): {self.status}")
        logs = W.Output(layout=W.Layout(max_height="160px", overflow="auto"))
        button = W.Button(description="Cancel", icon="stop")
        button.on_click(lambda _: self.cancel())
        self._watch = (status, logs, button)
        threading.Thread(target=self._watch_until_done, daemon=True).start()
        return W.VBox([W.HBox([button, status]), logs])

    def _refresh_watch(self, kind: str, rank: int, data: dict) -> None:
        status, logs, _ = self._watch
        if kind == "log":
            logs.append_stdout(f"[rank {rank}] {data['text']}\n")
        latest = [m[-1] for m in self.metrics if m]
        if latest:
            cells = "; ".join(f"rank {r}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                         for k, v in m.items()) for r, m in enumerate(latest))
            status.value = f"<b>{self.worker}</b> {self.status}: {cells}"

    def _watch_until_done(self) -> None:
        self._done.wait()
        status, _, button = self._watch
        button.disabled = True
        if self._result is not None:
            status.value = f"<b>done</b>: {self._result.describe()}"
        else:
            status.value = f"<b>{self.status}</b>: {str(self._error).splitlines()[0] if self._error else ''}"

    def _drive(self, timeout: float, seed: int) -> None:
        job = self._rank_job
        try:
            started = len(job.ready) < job.world_size
            first_here = self.worker not in job.workers_run
            if started:
                job.wait_ready(cancelled=self._cancel.is_set)
            self.status = "running"
            try:
                self._result = job.run_task(self.worker, self.params, seed=seed, timeout_s=timeout,
                                            on_event=self._event, cancelled=self._cancel.is_set)
            except BaseException:
                if started:
                    _record_start(job.world_size, job.startup_seconds)
                raise
            self.status = "done"
            if started and job.attempt == 0:  # a restarted run's time says nothing about a cold start
                # Everything this cold start cost the caller: the ranks' start, then this worker's first run on them.
                self.waited_s = time.perf_counter() - self._t_launch
                _record_first_run(self.worker, job.world_size, max(self.waited_s - job.startup_seconds, 0.0),
                                  start_s=job.startup_seconds)
            elif first_here:
                # Warm ranks that had not run this worker: its first run's imports and allocations, a stand-in for
                # the first run of a cold start at this size until one is seen.
                _record_first_run(self.worker, job.world_size, self._result.seconds)
            job.workers_run.add(self.worker)
        except BaseException as exc:  # noqa: BLE001 - handed to wait()
            self._error = exc
            self.status = "cancelled" if isinstance(exc, JobCancelled) else "failed"
            job.close()
        finally:
            if self._pooled:
                job.last_used = time.time()
                job.busy.release()
            elif not job.closed:
                job.close(graceful=True)
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Stop the run and every process it started; ``wait()`` then raises JobCancelled."""
        self._cancel.set()
        self._done.wait(timeout=15)

    def wait(self, timeout: float | None = None) -> RunResult:
        try:
            if not self._done.wait(timeout):
                raise TimeoutError(f"{self.worker} still running after {timeout} s (the job itself keeps its own timeout)")
        except KeyboardInterrupt:  # the notebook's stop button: take the ranks down with us
            self.cancel()
            raise
        if self._error is not None:
            raise self._error
        return self._result

    @property
    def result(self) -> RunResult | None:
        return self._result

    @property
    def error(self) -> BaseException | None:
        return self._error

    def __repr__(self) -> str:
        return f"<Job {self.worker} world={self.world_size} {self.status}>"


def launch(worker: str, world_size: int = 2, *, timeout: float = DEFAULT_TIMEOUT_S, seed: int = 0,
           warm: bool = True, nnodes: int = 1, env: dict | None = None, collective_timeout: float | None = None,
           on_event: Callable[[str, int, dict], None] | None = None, max_restarts: int = 0,
           min_nodes: int | None = None, **params: Any) -> Job:
    """Start ``worker`` on ``world_size`` ranks and return at once. Parameters are checked first.

    ``seed`` seeds every rank's random generators before the run, and is also the worker's own ``seed``
    parameter when its ``main`` has one (the data or weights it draws from it): one seed, not two.

    ``max_restarts`` is torchrun's ``--max-restarts``: a rank that dies or raises ends the attempt, torchrun starts
    every rank again and the worker runs again from its top, up to that many times (``timeout`` bounds them all).
    Such a run gets ranks of its own, as ``warm=False`` does: restarted ranks are a new job, not a warm one.

    ``min_nodes`` (elastic, ``torchrun --nnodes=min_nodes:nnodes``): the ``nnodes`` agents meet in a c10d rendezvous,
    and a restart after a node is lost goes on with the nodes left, as long as there are at least ``min_nodes``: the
    worker runs again in a smaller world, and the result holds that world's ranks."""
    params = current_names(worker, params)
    if takes_param(worker, "seed"):
        params = {**params, "seed": seed}
    check_params(worker, world_size, params, nnodes=nnodes)
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise InvalidParameter(f"timeout must be a positive number of seconds, not {timeout!r}")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise InvalidParameter(f"max_restarts={max_restarts!r} must be a whole number, 0 or more")
    if min_nodes is not None and (isinstance(min_nodes, bool) or not isinstance(min_nodes, int)
                                  or not 1 <= min_nodes <= nnodes):
        raise InvalidParameter(f"min_nodes={min_nodes!r} must be a whole number from 1 to nnodes={nnodes}")
    if min_nodes is not None and min_nodes < nnodes and max_restarts < 1:
        raise InvalidParameter(f"min_nodes={min_nodes} lets the job go on after losing a node only through a restart: "
                               "give max_restarts of 1 or more")
    # A constant default, not derived from `timeout`: runs with different timeouts share the same warm ranks.
    coll_timeout = float(collective_timeout if collective_timeout is not None else DEFAULT_COLLECTIVE_TIMEOUT_S)
    return Job(worker, world_size, _wire_params(params), timeout=float(timeout), seed=seed, warm=warm,
               nnodes=nnodes, env=env, collective_timeout_s=coll_timeout, on_event=on_event, max_restarts=max_restarts,
               min_nodes=min_nodes)


def _announced(job: "Job") -> "Job":
    """A cell (or an exercise check) about to wait for new ranks says so, with the time to expect."""
    if job.cold:
        progress.say(f"{job.worker}: {job.start_note}")
    return job


def run(worker: str, world_size: int = 2, **kwargs: Any) -> RunResult:
    """Run ``worker`` on ``world_size`` ranks and return every rank's results (see ``launch`` for options).

    A run whose ranks lost a connection while torch made their process groups (and nothing else went wrong:
    ``WorkerFailed.lost_connection_making_groups``) is repeated once on fresh ranks, as torchrun's
    ``--max-restarts=1`` would; the result's ``retried`` and ``describe()`` say so. Any other failure, or the same
    one twice, is raised."""
    try:
        return _announced(launch(worker, world_size, **kwargs)).wait()
    except WorkerFailed as exc:
        if not exc.lost_connection_making_groups:
            raise
        why = f"rank {exc.rank} lost a connection while making process groups ({exc.error_type}: " \
              f"{str(exc.errors[exc.rank]['message']).splitlines()[0][:120]})"
    result = _announced(launch(worker, world_size, **kwargs)).wait()  # the failed job closed its ranks: new ones
    result.retried = why
    return result


def shutdown_pools() -> None:
    """Stop all warm ranks of this notebook (also done when the kernel exits)."""
    with _pools_lock:
        while _pools:
            _, job = _pools.popitem()
            job.close(graceful=job.alive() and not job.busy.locked())


def warm_pools() -> list[str]:
    return [f"world {j.world_size}: {j.tasks_run} run(s), pids {j.pids()}" for j in _pools.values()]


atexit.register(shutdown_pools)


def cold_check(worker: str, world_size: int, *, timeout: float = 300.0, **params: Any) -> dict:
    """One cold start as a learner meets it: every warm rank of this process stopped (as a chapter's last cell does),
    then ``worker`` on new ranks. The seconds the note announced against the seconds waited, from the call to the
    answer (this start then updates the record, as any cold start does). A measurement, not a test: it varies with
    the machine's load."""
    shutdown_pools()
    t0 = time.perf_counter()
    job = launch(worker, world_size, timeout=timeout, **params)
    res = job.wait()
    waited = time.perf_counter() - t0
    return {"worker": worker, "world_size": world_size, "announced_s": round(job.expected_s, 1),
            "waited_s": round(waited, 1), "announced/waited": round(job.expected_s / waited, 2),
            "start_s": round(res.startup_seconds, 1), "first_run_s": round(waited - res.startup_seconds, 1),
            "load": round(machine_load()[0], 1), "note": job.start_note}


def _main(argv: list[str] | None = None) -> None:
    """``python -m course_utils.launcher WORKER WORLD [name=value ...] [--times N] [--fresh]``: ``cold_check`` N times in
    a row, one JSON line each. ``--fresh`` uses an empty record (a temporary file) instead of build/cold_starts.json,
    so the first line shows the estimate for a worker never started here and the next ones this machine's record."""
    import argparse
    import tempfile
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="python -m course_utils.launcher", description=_main.__doc__)
    parser.add_argument("worker")
    parser.add_argument("world_size", type=int)
    parser.add_argument("params", nargs="*", help="name=value (a JSON value, or else a string)")
    parser.add_argument("--times", type=int, default=2)
    parser.add_argument("--fresh", action="store_true")
    args = parser.parse_args(argv)
    params = {}
    for item in args.params:
        name, _, text = item.partition("=")
        try:
            params[name] = json.loads(text)
        except ValueError:
            params[name] = text
    global _cold_starts_file
    if args.fresh:
        fresh = Path(tempfile.mkdtemp(prefix="cold-check-")) / "cold_starts.json"
        _cold_starts_file = lambda: fresh  # noqa: E731 - this process only
    for _ in range(args.times):
        print(json.dumps(cold_check(args.worker, args.world_size, **params)), flush=True)
    shutdown_pools()


__all__ = ["run", "launch", "Job", "shutdown_pools", "warm_pools", "ship_callable", "CourseError", "max_world_size",
           "expected_start_s", "expected_cold_s", "cold_check"]


if __name__ == "__main__":
    _main()
