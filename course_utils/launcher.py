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
the next run that needs it says so (``Job.start_note``). A cold start is announced with the time it is expected to
take: this machine's last start of that many ranks (``build/cold_starts.json``), or a model measured on a 2-core
machine before any; ``run`` in a notebook prints it as a progress line before it waits (``course_utils.progress``).
"""
from __future__ import annotations

import atexit
import collections
import inspect
import json
import os
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


def expected_start_s(world_size: int) -> tuple[float, str]:
    """Seconds a cold start of ``world_size`` ranks should take here, and where that number comes from."""
    try:
        seen = json.loads(_cold_starts_file().read_text())
        return float(seen[str(world_size)]), "this machine's last start"
    except (OSError, ValueError, KeyError, TypeError):
        # torchrun, `import torch` and rendezvous on an idle 2-core EPYC (2026-12-04): 2.9 s for 2 ranks,
        # 4.4-4.6 s for 4, 7.4-7.9 s for 8 (workers.rank_faults, warm=False, twice each).
        return 1.5 + 0.8 * world_size, "an idle 2-core machine"


def _record_start(world_size: int, seconds: float) -> None:
    path = _cold_starts_file()
    try:
        seen = json.loads(path.read_text()) if path.exists() else {}
        seen[str(world_size)] = round(seconds, 1)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written whole then renamed: other notebooks (make test runs two executions at once) may read it meanwhile.
        tmp = path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(seen, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except (OSError, ValueError):
        pass  # an estimate for next time, never a reason to fail a run


def _start_note(world_size: int, key: tuple | None) -> str:
    """What the learner is told while new ranks start."""
    expected, source = expected_start_s(world_size)
    note = (f"starting {world_size} rank{'s' if world_size > 1 else ''} (a cold start: about {expected:.0f} s, "
            f"{source}; longer while the machine is busy)")
    idle = _retired.pop(key, None) if key is not None else None
    if idle is not None:
        took = f"{idle:.0f} s" if idle < 120 else f"{idle / 60:.0f} min"
        note = (f"the warm ranks of world {world_size} had stopped after {took} idle "
                f"(COURSE_POOL_IDLE_S={POOL_IDLE_S:g}): " + note)
    return note


def _workers_version() -> float:
    """Newest modification time under workers/: warm ranks must not run code older than the files."""
    from course_utils.paths import ROOT

    return max((p.stat().st_mtime for p in (ROOT / "workers").rglob("*.py")), default=0.0)


def _acquire_job(world_size, nnodes, env, collective_timeout_s, warm) -> tuple[RankJob, bool]:
    """A started (maybe still starting) job for this run, and whether it is a pool to give back after."""
    if warm:
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
                job.start_note = _start_note(world_size, key)
                _pools[key] = job
                _start_reaper()
                return job, True
        # The warm ranks are busy with another run: this run gets ranks of its own.
    job = RankJob(world_size, nnodes=nnodes, env=env, collective_timeout_s=collective_timeout_s)
    job.start_note = _start_note(world_size, None)
    return job, False


class Job:
    """A run in progress. ``wait()`` returns its RunResult or raises what went wrong."""

    def __init__(self, worker: str, world_size: int, params: dict, *, timeout: float, seed: int, warm: bool,
                 nnodes: int, env: dict | None, collective_timeout_s: float,
                 on_event: Callable[[str, int, dict], None] | None):
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
        # Processes are started here, in the caller's thread (their parent-death signal follows this thread).
        self._rank_job, self._pooled = _acquire_job(world_size, nnodes, env, collective_timeout_s, warm)
        # Whether this run waits for new ranks, and the sentence that says so (with the time to expect).
        self.cold = len(self._rank_job.ready) < world_size
        self.start_note = getattr(self._rank_job, "start_note", "") if self.cold else ""
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
            if len(job.ready) < job.world_size:
                job.wait_ready(cancelled=self._cancel.is_set)
                _record_start(job.world_size, job.startup_seconds)
            self.status = "running"
            self._result = job.run_task(self.worker, self.params, seed=seed, timeout_s=timeout,
                                        on_event=self._event, cancelled=self._cancel.is_set)
            self.status = "done"
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
           on_event: Callable[[str, int, dict], None] | None = None, **params: Any) -> Job:
    """Start ``worker`` on ``world_size`` ranks and return at once. Parameters are checked first.

    ``seed`` seeds every rank's random generators before the run, and is also the worker's own ``seed``
    parameter when its ``main`` has one (the data or weights it draws from it): one seed, not two."""
    params = current_names(worker, params)
    if takes_param(worker, "seed"):
        params = {**params, "seed": seed}
    check_params(worker, world_size, params, nnodes=nnodes)
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise InvalidParameter(f"timeout must be a positive number of seconds, not {timeout!r}")
    # A constant default, not derived from `timeout`: runs with different timeouts share the same warm ranks.
    coll_timeout = float(collective_timeout if collective_timeout is not None else DEFAULT_COLLECTIVE_TIMEOUT_S)
    return Job(worker, world_size, _wire_params(params), timeout=float(timeout), seed=seed, warm=warm,
               nnodes=nnodes, env=env, collective_timeout_s=coll_timeout, on_event=on_event)


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

__all__ = ["run", "launch", "Job", "shutdown_pools", "warm_pools", "ship_callable", "CourseError", "max_world_size",
           "expected_start_s"]
