"""Rank-side server: join the job once, then run the tasks the notebook sends, until told to stop.

Started by the notebook as ``torchrun ... -m workers.pool``. Starting torchrun and importing torch
costs seconds; a process group that stays up between runs lets a widget rerun an experiment in well
under a second. Each task is still a fresh run of the worker (fresh seed, fresh module state if the
file changed): nothing is cached, every timing is a new measurement.

Safety: a reader thread owns the socket. If the notebook goes away (kernel restart, crash, cancel) the
socket closes and the rank exits at once with ``os._exit``, even when its main thread is blocked in a
collective. The reader thread also answers ``dump_stacks``: it reads the main thread's Python stack,
which is how the notebook names the collective a stuck rank is waiting in.
"""
from __future__ import annotations

import faulthandler
import importlib
import importlib.util
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback

from workers import protocol, runtime

_modules: dict[str, tuple[float, object]] = {}


def load_worker(worker: str):
    """Import ``workers.ch01_collectives`` or ``path/to/file.py``; re-import when the file changed."""
    if worker.endswith(".py"):
        path = os.path.abspath(worker)
        mtime = os.path.getmtime(path)
        cached = _modules.get(path)
        if cached and cached[0] == mtime:
            return cached[1]
        name = "course_worker_" + os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _modules[path] = (mtime, module)
        return module
    module = importlib.import_module(worker)
    path = getattr(module, "__file__", None)
    mtime = os.path.getmtime(path) if path else 0.0
    cached = _modules.get(worker)
    if cached and cached[0] != mtime:
        module = importlib.reload(module)
    _modules[worker] = (mtime, module)
    return module


def rehydrate(value):
    """Functions written in the notebook travel as source code and are defined again on each rank."""
    if isinstance(value, dict) and value.get("__course_callable__"):
        namespace = {"__name__": "__notebook__"}
        exec("import torch\nimport torch.distributed as dist\n", namespace)
        exec(compile(value["source"], f"<notebook: {value['name']}>", "exec"), namespace)
        return namespace[value["name"]]
    if isinstance(value, dict):
        return {k: rehydrate(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rehydrate(v) for v in value]
    return value


def main_thread_stack() -> list[list]:
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return []
    return [[f.filename, f.lineno, f.name, f.line or ""] for f in traceback.extract_stack(frame)]


def _reader(sock: socket.socket, reporter: runtime.Reporter, tasks: "queue.Queue") -> None:
    try:
        while True:
            frame = protocol.recv_frame(sock)
            kind = frame["kind"]
            if kind == "task":
                tasks.put(frame["data"])
            elif kind == "dump_stacks":
                reporter.send("stacks", {"stack": main_thread_stack()})
            elif kind == "shutdown":
                tasks.put(None)
                return
    except (protocol.ConnectionClosed, OSError):
        pass
    # The notebook is gone: leave now, whatever the main thread is doing.
    os._exit(0)


def run_task(ctx: runtime.Context, task: dict) -> None:
    reporter = ctx.reporter
    reporter.task = task["id"]
    start = time.perf_counter()
    try:
        runtime.seed_all(int(task.get("seed", 0)))
        module = load_worker(task["worker"])
        params = rehydrate(task.get("params", {}))
        # The run's timeout starts now: importing a worker on a loaded machine is not the run's fault.
        reporter.send("loaded", {"seconds": time.perf_counter() - start})
        out = module.main(ctx, **params)
        if out:
            ctx.result(**out)
    except BaseException as exc:  # report, then wait: the notebook decides to tear the job down (unless torchrun may)
        reporter.send("error", runtime.error_payload(exc))
        if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) > 0:
            # A job torchrun may restart: a failed run is a failed process, as under a plain torchrun, so the
            # agent sees it, stops the other ranks and starts them all again.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        return
    reporter.send("task_done", {"seconds": time.perf_counter() - start})


def serve() -> None:
    # A rank stuck in native code holding the GIL cannot answer dump_stacks from its reader thread; SIGUSR1
    # still prints every thread's Python stack to stderr (which torchrun tees to the notebook).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    addr = os.environ["COURSE_RESULTS_ADDR"]
    sock = socket.create_connection(protocol.parse_addr(addr), timeout=30)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rank = int(os.environ.get("RANK", 0))
    # Say hello before joining the group: if the rendezvous fails the notebook still knows we started.
    hello = {
        "rank": rank, "pid": os.getpid(), "host": socket.gethostname(),
        "local_rank": int(os.environ.get("LOCAL_RANK", 0)), "world_size": int(os.environ.get("WORLD_SIZE", 1)),
        "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),  # which of torchrun's starts this is
    }
    protocol.send_frame(sock, "hello", hello, rank=rank)
    reporter = runtime.Reporter(rank, sock)
    tasks: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(sock, reporter, tasks), daemon=True).start()
    try:
        ctx = runtime.init_distributed(sock=sock)
        ctx.reporter = reporter
    except BaseException as exc:
        reporter.send("error", runtime.error_payload(exc))
        raise
    reporter.send("ready", {
        "backend": ctx.backend, "device": str(ctx.device), "why": ctx.why,
        "local_world_size": ctx.local_world_size, "node_rank": ctx.node_rank,
        "torch": __import__("torch").__version__,
    })
    while (task := tasks.get()) is not None:
        run_task(ctx, task)
    os._exit(0)  # skip destroy_process_group: peers may already be gone, and exiting is what we want


if __name__ == "__main__":
    serve()
