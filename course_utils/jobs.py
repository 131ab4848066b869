"""A set of torchrun ranks connected back to this notebook, and how one task runs on them.

``RankJob`` starts ``torchrun ... -m workers.pool`` (one agent per simulated node), accepts one
results-protocol connection per rank, and routes every frame into a single queue. ``run_task`` sends a
task to all ranks and turns the frames that come back into a ``RunResult``, or into an exception that
names the failing rank (with its traceback), the dead rank (with its exit output), or, on a timeout,
where each rank was stuck.

``max_restarts`` > 0 is torchrun's ``--max-restarts``: when a rank of the task dies or raises, the agent stops the
others and starts every rank again (an *attempt*; the ranks' ``TORCHELASTIC_RESTART_COUNT``), and ``run_task`` sends
the same task to the new ranks, as torchrun re-runs a script from its top. Frames carry the attempt of the
process that sent them, so a dead attempt's late frames are dropped; the job fails only once restarts are used up.

``min_nodes`` (with ``nnodes`` > 1) makes the job elastic, as ``torchrun --nnodes=min:max`` on a cluster: the agents
meet in a c10d rendezvous (node 0's agent hosts its store), and when a node is lost the survivors' agent restarts
its ranks in a smaller world once at least ``min_nodes`` nodes are left. The ranks of the new attempt say how large
their world is (their hello); ``run_task`` gives the task to that many ranks and returns their results.
"""
from __future__ import annotations

import collections
import itertools
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

from course_utils import reaper, scratch
from course_utils.paths import ROOT
from course_utils.results import JobCancelled, JobTimeout, RunResult, WorkerFailed, merge_result
from workers import protocol
from workers.runtime import DEFAULT_COLLECTIVE_TIMEOUT_S, free_port

ERROR_GRACE_S = 0.5  # after the first failure, how long other ranks may still report theirs
# An elastic job's rendezvous closes this long after its smallest allowed membership has joined (torchrun's
# last_call_timeout, 30 s by default): the agents started together join well within it, and after a lost node the
# survivors give it this long to come back before they go on without it.
LAST_CALL_S = 5.0
# A node's agent sends the rendezvous a heartbeat every KEEP_ALIVE_S; after KEEP_ALIVE_MISSES missed ones the others
# count it dead and stop waiting for it (torchrun's defaults, 5 s x 3, keep the survivors of a lost node waiting 15 s)
KEEP_ALIVE_S, KEEP_ALIVE_MISSES = 1, 2
_job_counter = itertools.count(1)


def describe_stack(stack: list[list]) -> str:
    """Name the collective (or line) a rank is blocked in, from its main thread's stack."""
    if not stack:
        return "no Python stack (the rank is inside native code or already gone)"
    in_dist = [i for i, f in enumerate(stack) if f"{os.sep}torch{os.sep}distributed{os.sep}" in f[0]]
    user = [f for f in stack if f"{os.sep}torch{os.sep}" not in f[0] and not f[0].endswith("pool.py")]
    # code sent from a notebook has no source line to show: then the place alone
    where = (f"{Path(user[-1][0]).name}:{user[-1][1]}" + (f" ({user[-1][3].strip()})" if user[-1][3].strip() else "")
             if user else "?")
    if in_dist:
        # The outermost torch.distributed frame is the public call the worker made (all_reduce, barrier...).
        op = stack[in_dist[0]][2]
        if op in ("wrapper",) and len(in_dist) > 1:
            op = stack[in_dist[1]][2]
        return f"waiting in {op} called at {where}"
    return f"running {where}"



def default_startup_timeout_s() -> float:
    """How long ranks may take to start (torchrun, ``import torch``, rendezvous): ``COURSE_STARTUP_TIMEOUT`` or 300 s."""
    return float(os.environ.get("COURSE_STARTUP_TIMEOUT", 300))


class RankJob:
    """Ranks started by torchrun that run tasks sent from this notebook until ``close()``."""

    def __init__(self, world_size: int, *, nnodes: int = 1, env: dict | None = None,
                 collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S, startup_timeout_s: float | None = None,
                 label: str = "", max_restarts: int = 0, min_nodes: int | None = None,
                 last_call_s: float = LAST_CALL_S):
        if world_size % nnodes:
            raise ValueError("world_size must be a multiple of nnodes")
        if min_nodes is not None and not 1 <= min_nodes <= nnodes:
            raise ValueError(f"min_nodes={min_nodes} must be 1 to nnodes={nnodes}")
        self.world_size, self.nnodes = world_size, nnodes
        self.min_nodes = min_nodes if min_nodes is not None and nnodes > 1 else None  # None: a fixed world
        self.last_call_s = last_call_s
        self.lost_nodes: dict[int, int] = {}  # node -> its agent's exit code, for an elastic job that goes on
        self.nproc_per_node = world_size // nnodes
        self.label = label
        self.max_restarts = max_restarts  # torchrun's --max-restarts: 0 for every pooled job
        self.attempt = 0  # the attempt whose ranks this job talks to (frames of older ones are stale)
        self.id = f"{os.getpid()}-{next(_job_counter)}-{uuid.uuid4().hex[:6]}"
        self.log_dir = scratch.job_log_dir(self.id)  # torchrun's per-rank log files, removed by close()
        self.collective_timeout_s = collective_timeout_s
        # Starting torchrun and importing torch takes 5 s on an idle 2-core machine, minutes on a loaded one.
        self.startup_timeout_s = startup_timeout_s or default_startup_timeout_s()
        self.frames: queue.Queue = queue.Queue()
        self.conns: dict[int, socket.socket] = {}
        self.hello: dict[int, dict] = {}
        self.ready: dict[int, dict] = {}
        self.output: collections.deque[str] = collections.deque(maxlen=4000)
        self.agents: list[subprocess.Popen] = []
        self.closed = False
        self.busy = threading.Lock()
        self.tasks_run = 0
        self.workers_run: set[str] = set()  # workers that have answered on these ranks (set by the launcher)
        self.code_version = 0.0  # set by the launcher for warm pools
        self.started_at = time.time()
        self.startup_seconds = 0.0
        self._send_lock = threading.Lock()
        self._register_lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self._env = env or {}
        self._spawn()

    # -- starting ---------------------------------------------------------------------------------
    def _spawn(self) -> None:
        reaper.reap_stale()
        host, port = self._listener.getsockname()
        env = dict(os.environ)
        env.update({
            "COURSE_RESULTS_ADDR": f"{host}:{port}",
            "COURSE_COLLECTIVE_TIMEOUT": str(self.collective_timeout_s),
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            "TORCH_CPP_LOG_LEVEL": env.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
        })
        if self.max_restarts:
            # torchrun keeps one TCP store for every restart of the job and the ranks' process group keys in it carry
            # no attempt: a restarted rank can read a dead rank's gloo address (connectFullMesh: "Connection
            # refused"). Without the shared store, each attempt's rank 0 hosts a new one.
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        env.update({k: str(v) for k, v in self._env.items()})
        # --tee=3 makes torchrun write each rank's stdout/stderr to files under --log-dir and tail them to its own
        # stdout (read by _read_agent); given no --log-dir it makes a torchelastic_* folder in the system temp
        # directory per launch, which nothing ever removes.
        self._register()  # on record (for the reaper, should this notebook die) before the folder exists
        self.log_dir.mkdir(parents=True, exist_ok=True)
        common = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={self.nproc_per_node}",
                  f"--max-restarts={self.max_restarts}", "--monitor-interval=0.1", "--tee=3", f"--log-dir={self.log_dir}"]
        if self.nnodes == 1:
            commands = [common + ["--standalone", "-m", "workers.pool"]]
        elif self.min_nodes is not None:
            # Elastic, as on a cluster: a c10d rendezvous whose store node 0's agent hosts (started first, so its
            # lower pid also makes it group rank 0: ranks 0..k-1). A lost node other than node 0 leaves the store up.
            endpoint = f"127.0.0.1:{free_port()}"
            commands = [common + [f"--nnodes={self.min_nodes}:{self.nnodes}", "--rdzv-backend=c10d",
                                  f"--rdzv-endpoint={endpoint}", f"--rdzv-id={self.id}",
                                  f"--rdzv-conf=is_host={int(node == 0)},last_call_timeout={self.last_call_s:g},"
                                  f"keep_alive_interval={KEEP_ALIVE_S},keep_alive_max_attempt={KEEP_ALIVE_MISSES}",
                                  "-m", "workers.pool"] for node in range(self.nnodes)]
        else:
            # Several agents on this one machine, as on a cluster: a static rendezvous at a free port.
            master_port = free_port()
            commands = [common + [f"--nnodes={self.nnodes}", f"--node-rank={node}", "--rdzv-backend=static",
                                  "--master-addr=127.0.0.1", f"--master-port={master_port}", "-m", "workers.pool"]
                        for node in range(self.nnodes)]
        self.commands = commands
        self._t0 = time.perf_counter()
        for node, cmd in enumerate(commands):
            agent = reaper.spawn(cmd, env=env, cwd=str(ROOT), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, bufsize=1)
            self.agents.append(agent)
            threading.Thread(target=self._read_agent, args=(node, agent), daemon=True).start()
        self._register()
        threading.Thread(target=self._accept, daemon=True).start()

    def _read_agent(self, node: int, agent: subprocess.Popen) -> None:
        for line in agent.stdout:
            line = line.rstrip("\n")
            if line.startswith("[default") and "]:" in line:
                local, _, text = line[len("[default"):].partition("]:")
                rank = node * self.nproc_per_node + int(local) if local.isdigit() else local
                line = f"[rank {rank}] {text}"
            elif line.strip():
                line = f"[torchrun] {line}"
            self.output.append(line)
        code = agent.wait()
        self.frames.put(("agent_exit", node, code))

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self._listener.accept()
            except (socket.timeout, TimeoutError):
                continue
            except OSError:
                return
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._read_rank, args=(conn,), daemon=True).start()

    def _read_rank(self, conn: socket.socket) -> None:
        rank, attempt = None, self.attempt
        try:
            while True:
                frame = protocol.recv_frame(conn)
                rank = frame["rank"]
                if frame["kind"] == "hello":
                    attempt = frame["data"].get("attempt", 0)
                    self._register(hello=(rank, conn, frame["data"]))
                frame["attempt"] = attempt
                self.frames.put(("frame", rank, frame))
        except (protocol.ConnectionClosed, OSError):
            self.frames.put(("eof", rank, attempt))
        except Exception as exc:  # a frame we cannot read: report it as that rank's failure
            self.frames.put(("frame", rank, {"kind": "error", "task": None, "attempt": attempt, "data": {
                "type": type(exc).__name__, "message": f"unreadable results frame: {exc}", "traceback": ""}}))

    def _stale(self, kind: str, payload) -> bool:
        """An event from the ranks of an attempt torchrun has already replaced (its last frames, its closed sockets)."""
        sent_by = payload if kind == "eof" else payload.get("attempt", 0) if kind == "frame" else self.attempt
        return (sent_by or 0) < self.attempt

    def _register(self, hello: tuple | None = None) -> None:
        """Note a rank's hello and update the reaper's entry for this job. Ranks say hello at the same moment,
        from one reader thread each: the lock keeps their updates whole and in order, and a registry that
        cannot be written (a full disk, a read-only cache) costs only the crash-cleanup record, never the
        rank's results stream."""
        with self._register_lock:
            if hello is not None:
                rank, conn, data = hello
                self.conns[rank] = conn
                self.hello[rank] = data
            try:
                reaper.register(self.id, self.pids(), log_dir=str(self.log_dir))
            except OSError as exc:
                self.output.append(f"[course] could not update the job registry: {exc}")

    def wait_ready(self, cancelled: Callable[[], bool] = lambda: False) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        errors: dict[int, dict] = {}
        while len(self.ready) < self._attempt_world():
            if cancelled():
                self.close()
                raise JobCancelled("cancelled while the ranks were starting")
            try:
                event = self.frames.get(timeout=min(0.1, max(deadline - time.monotonic(), 0.01)))
            except queue.Empty:
                if time.monotonic() > deadline:
                    self._fail_startup(self._startup_diagnosis(), errors)
                continue
            kind, rank, payload = event
            if self._stale(kind, payload):
                continue
            if kind == "frame" and payload["kind"] == "ready":
                self.ready[rank] = payload["data"]
            elif kind == "frame" and payload["kind"] == "error":
                errors[rank] = payload["data"]
                self._fail_startup(f"rank {rank} failed while starting", errors)
            elif kind == "agent_exit" and not self._node_lost(rank, payload):
                self._fail_startup(f"torchrun (node {rank}) exited with code {payload} while starting", errors)
            elif kind == "eof" and rank is not None and rank not in self.ready:
                self._fail_startup(f"rank {rank} closed its connection while starting", errors)
        if self.attempt == 0:  # a restart's wait is part of the run, not of the ranks' start
            self.startup_seconds = time.perf_counter() - self._t0
        self.world_size = self._attempt_world()

    def _attempt_world(self) -> int:
        """How many ranks this attempt has: the job's world, or, elastic, what the attempt's ranks said in hello."""
        if self.min_nodes is None:
            return self.world_size
        said = [h["world_size"] for h in list(self.hello.values()) if h.get("attempt", 0) == self.attempt]
        return max(said, default=self.world_size)

    def _node_lost(self, node: int, code) -> bool:
        """An elastic job whose agent on ``node`` exited: on record and True while enough nodes are left to go on."""
        if self.min_nodes is None:
            return False
        self.lost_nodes[node] = code
        self.output.append(f"[torchrun] node {node}'s agent exited (code {code}): the job goes on with "
                           f"{self.nnodes - len(self.lost_nodes)} of {self.nnodes} nodes")
        return self.nnodes - len(self.lost_nodes) >= self.min_nodes

    def _startup_diagnosis(self) -> str:
        """Why the ranks are not ready: never connected (torchrun or ``import torch`` still running), or
        connected and waiting in the rendezvous (then their stacks say where)."""
        missing = sorted(set(range(self.world_size)) - set(self.ready))
        silent = [r for r in missing if r not in self.hello]
        joining = [r for r in missing if r in self.hello]
        parts = [f"ranks {missing} did not start within {self.startup_timeout_s:.0f} s"]
        if silent:
            parts.append(f"ranks {silent} never connected (torchrun or `import torch` had not finished)")
        if joining:
            stacks = self._collect_stacks(joining)
            where = ", ".join(f"rank {r} {describe_stack(stacks.get(r, []))}" for r in joining)
            parts.append(f"ranks {joining} connected but did not join the process group ({where})")
            mute = [r for r in joining if r not in stacks]
            if mute:
                parts.append(self._native_stacks(mute))
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        parts.append(f"load average {load:.1f} on {os.cpu_count()} cores; COURSE_STARTUP_TIMEOUT raises the limit")
        return "; ".join(parts)

    def _native_stacks(self, ranks: list[int]) -> str:
        """Ranks that cannot answer (stuck in native code, holding the GIL) print every thread's Python stack
        on SIGUSR1 (faulthandler, ``workers/pool.py``); the lines reach ``self.output``, shown with the error."""
        for r in ranks:
            try:
                os.kill(self.hello[r]["pid"], signal.SIGUSR1)
            except (OSError, KeyError):
                pass
        time.sleep(1.0)  # let torchrun's tee pass the dump on
        return f"ranks {ranks} did not answer: their stacks (faulthandler) are in the last output below"

    def _collect_stacks(self, ranks: list[int], wait_s: float = 5.0) -> dict[int, list]:
        """Ask every connected rank for its main thread's stack; a loaded machine answers slowly."""
        stacks: dict[int, list] = {}
        self.send_all("dump_stacks", {})
        until = time.monotonic() + wait_s
        while not set(ranks) <= set(stacks) and time.monotonic() < until:
            try:
                kind, rank, payload = self.frames.get(timeout=0.05)
            except queue.Empty:
                continue
            if kind == "frame" and payload["kind"] == "stacks":
                stacks[rank] = payload["data"]["stack"]
        return stacks

    def _fail_startup(self, summary: str, errors: dict) -> None:
        time.sleep(0.2)
        self.close()
        first = min(errors) if errors else None
        tb = errors[first]["traceback"] if errors else ""
        raise WorkerFailed(summary + (f": {errors[first]['message']}" if errors else "") + self._output_tail(40),
                           rank=first, rank_traceback=tb, errors=errors, logs=list(self.output), startup=True)

    # -- running ---------------------------------------------------------------------------------
    def send_all(self, kind: str, data: dict, task: int | None = None) -> None:
        frame = protocol.encode(kind, data, task=task)
        with self._send_lock:
            for conn in self.conns.values():
                try:
                    conn.sendall(frame)
                except OSError:
                    pass

    def run_task(self, worker: str, params: dict, *, seed: int = 0, timeout_s: float = 60.0,
                 on_event: Callable[[str, int, dict], None] | None = None,
                 cancelled: Callable[[], bool] = lambda: False) -> RunResult:
        """Run one task on every rank; raise WorkerFailed / JobTimeout / JobCancelled (the job is then closed)."""
        # Drop events left from an earlier task (late logs, stack replies).
        while True:
            try:
                self.frames.get_nowait()
            except queue.Empty:
                break
        task_id = self.tasks_run = self.tasks_run + 1
        n = self.world_size
        ranks = [dict() for _ in range(n)]
        metrics: list[list[dict]] = [[] for _ in range(n)]
        logs: list[str] = []
        done: dict[int, float] = {}
        errors: dict[int, dict] = {}
        died: dict[int, str] = {}
        fail_at = None
        loaded: set[int] = set()
        start = time.perf_counter()
        # Until every rank has imported the worker, only the (generous) startup limit applies.
        deadline = time.monotonic() + self.startup_timeout_s
        run_deadline = None  # the run's own limit, from the moment every rank first had the worker loaded
        task = {"id": task_id, "worker": worker, "params": params, "seed": seed}
        self.send_all("task", task, task=task_id)
        while len(done) < n:
            now = time.monotonic()
            if cancelled():
                self.close()
                raise JobCancelled(f"{worker} cancelled after {time.perf_counter() - start:.1f} s; its ranks were stopped")
            if fail_at is not None and now >= fail_at:
                self._raise_failure(worker, errors, died)
            if now >= deadline:
                if len(loaded) < n:
                    self.close()
                    missing = sorted(set(range(n)) - loaded)
                    raise JobTimeout(f"{worker}: ranks {missing} did not finish importing it within "
                                     f"{self.startup_timeout_s:g} s", logs=list(self.output))
                self._raise_timeout(worker, timeout_s, done)
            try:
                kind, rank, payload = self.frames.get(timeout=0.05)
            except queue.Empty:
                continue
            if self._stale(kind, payload):
                continue
            raised = kind == "frame" and payload["kind"] == "error"
            said = (str(payload["data"]["message"]).splitlines() or [""])[0] if raised else ""  # a message may be empty
            failure = (f"rank {rank} exited" if kind == "eof" and rank not in done else
                       f"rank {rank} raised {payload['data']['type']}: {said}" if raised else None)
            if failure and rank is not None and self.attempt < self.max_restarts:
                # torchrun's agent stops the other ranks and starts new ones: wait for them, give them the task again
                logs.append(f"[torchrun] attempt {self.attempt} of {worker} ended after "
                            f"{time.perf_counter() - start:.1f} s ({failure[:300]}); torchrun restarts every rank")
                self.attempt += 1
                self.ready = {}
                self.wait_ready(cancelled)
                n = self.world_size  # an elastic job may go on in a smaller world (its metrics keep every attempt's)
                ranks, done, errors, died, fail_at, loaded = [dict() for _ in range(n)], {}, {}, {}, None, set()
                deadline = time.monotonic() + self.startup_timeout_s
                self.send_all("task", task, task=task_id)
                continue
            if kind == "agent_exit" and self._node_lost(rank, payload):
                continue  # its ranks' failure (or their closed connections) restarts the attempt
            if kind == "eof" or kind == "agent_exit":
                who = rank if kind == "eof" else f"node {rank}"
                if kind == "eof" and rank in done:
                    continue
                died[rank if kind == "eof" else -1 - rank] = f"{'rank' if kind == 'eof' else 'torchrun'} {who} exited"
                fail_at = fail_at or time.monotonic() + ERROR_GRACE_S
                continue
            if payload.get("task") not in (task_id, None):
                continue
            fk, data = payload["kind"], payload["data"]
            if fk == "result":
                merge_result(ranks[rank], data)
            elif fk == "metric":
                metrics[rank].append(data)
            elif fk == "log":
                logs.append(f"[rank {rank}] {data['text']}")
            elif fk == "error":
                errors[rank] = data
                fail_at = fail_at or time.monotonic() + ERROR_GRACE_S
            elif fk == "loaded":
                loaded.add(rank)
                if len(loaded) == n:
                    # a restarted attempt keeps the first one's limit: the timeout bounds the whole run
                    run_deadline = run_deadline or time.monotonic() + timeout_s
                    deadline = run_deadline
            elif fk == "task_done":
                done[rank] = data["seconds"]
            if on_event is not None:
                on_event(fk, rank, data)
        seconds = time.perf_counter() - start
        launch = "cold" if task_id == 1 else "warm"
        first = self.ready[0]
        return RunResult(
            worker=worker, world_size=n, backend=first["backend"],
            devices=[self.ready[r]["device"] for r in range(n)], placement=first["why"],
            ranks=ranks, metrics=metrics[:n], logs=logs, seconds=seconds, launch=launch,
            startup_seconds=self.startup_seconds if launch == "cold" else 0.0,
            rank_seconds=[done[r] for r in range(n)],
        )

    def _raise_failure(self, worker: str, errors: dict, died: dict) -> None:
        time.sleep(0.3)  # let the agents print what killed a rank that died without a traceback
        self.close()
        dead = [r for r in died if r >= 0 and r not in errors]  # in the order their ends arrived
        if dead:
            # A rank that vanished is the cause; errors on the others (connection closed by peer) follow from it. The
            # first to vanish: on a loaded machine torchrun may stop another rank before it saw the closed connection.
            rank = dead[0]
            then = ""
            if errors:
                r0 = min(errors)
                then = f"; then rank {r0} raised {errors[r0]['type']}: {errors[r0]['message'][:200]}"
            raise WorkerFailed(f"{worker}: rank {rank} died without a Python traceback (killed, crashed or "
                               f"exited){then}{self._output_tail()}", rank=rank, errors=errors, logs=list(self.output))
        if errors:
            first = min(errors)
            err = errors[first]
            others = f" (ranks {sorted(set(errors) - {first})} failed too)" if len(errors) > 1 else ""
            raise WorkerFailed(f"{worker}: rank {first} raised {err['type']}: {err['message']}{others}",
                               rank=first, error_type=err["type"], rank_traceback=err["traceback"],
                               errors=errors, logs=list(self.output))
        raise WorkerFailed(f"{worker}: torchrun exited before the ranks finished{self._output_tail()}",
                           logs=list(self.output))

    def _raise_timeout(self, worker: str, timeout_s: float, done: dict) -> None:
        stuck_ranks = [r for r in range(self.world_size) if r not in done]
        stacks = self._collect_stacks([r for r in stuck_ranks if r in self.conns])  # answered from a thread
        self.close()
        stuck = {r: describe_stack(stacks.get(r, [])) for r in stuck_ranks}
        lines = "; ".join(f"rank {r} {where}" for r, where in stuck.items())
        finished = sorted(done)
        summary = (f"{worker} timed out after {timeout_s:g} s: {lines}"
                   + (f"; ranks {finished} had finished" if finished else "")
                   + ". A rank waiting in a collective usually means another rank never called it.")
        raise JobTimeout(summary, stuck=stuck, logs=list(self.output))

    def _output_tail(self, n: int = 15) -> str:
        tail = [l for l in list(self.output)[-n:] if l.strip()]
        return ("\nlast output:\n" + "\n".join(tail)) if tail else ""

    # -- stopping --------------------------------------------------------------------------------
    def pids(self) -> list[int]:
        # list(...) takes a snapshot: hellos arrive on reader threads
        return [a.pid for a in self.agents] + [h["pid"] for h in list(self.hello.values())]

    def alive(self) -> bool:
        return not self.closed and all(a.poll() is None for a in self.agents)

    def close(self, graceful: bool = False) -> None:
        """Stop every process of this job. Graceful: ask the ranks to leave first (used for idle pools)."""
        if self.closed:
            return
        self.closed = True
        if graceful:
            self.send_all("shutdown", {})
            for a in self.agents:
                try:
                    a.wait(timeout=3)
                except subprocess.TimeoutExpired:
                    pass
        reaper.kill_tree(self.pids())
        for a in self.agents:
            try:
                a.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        for conn in list(self.conns.values()):
            try:
                conn.close()
            except OSError:
                pass
        self._listener.close()
        scratch.remove_job_log_dir(self.log_dir)  # after the agents are gone: nothing writes there any more
        reaper.unregister(self.id)
