"""What every rank runs first: pick a backend and device, join the process group, report results.

A worker is a module with ``main(ctx, **params)``. It runs two ways, unchanged:

* from a terminal, on one node or many:  ``torchrun --nproc-per-node 4 workers/ch01_collectives.py --size 8``
  (``entrypoint(main)`` parses ``--name value`` from ``main``'s signature and prints each rank's results);
* from a notebook, through ``course_utils.run``: the ranks are started by ``workers/pool.py`` and every
  result, metric and traceback travels over the results protocol (``workers/protocol.py``).

Backend and device (``select_placement``): NCCL when every local rank has a GPU of its own; gloo on CUDA
tensors when there are GPUs but fewer than local ranks (NCCL refuses two ranks on one GPU: "Duplicate GPU
detected"); gloo on the CPU otherwise. ``COURSE_BACKEND`` / ``COURSE_DEVICE`` override the choice.
"""
from __future__ import annotations

import contextlib
import datetime
import inspect
import os
import random
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from workers import protocol

DEFAULT_COLLECTIVE_TIMEOUT_S = 60.0  # gloo/NCCL give up on a collective after this (a stuck rank)

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single (the old names warn that they
# are deprecated). Both names reach the same backend call, on gloo and on NCCL.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# The collectives gloo implements for CUDA tensors (PyTorch's backend table); for every other one (all_gather,
# reduce_scatter, all_to_all, send/recv, gather, scatter, reduce) gloo needs CPU tensors. This matters on a
# one-GPU machine, where several ranks share the GPU and talk through gloo.
GLOO_CUDA_COLLECTIVES = frozenset({"all_reduce", "broadcast", "barrier"})


def comm_device(backend: str, device: torch.device, collective: str) -> torch.device:
    """Where ``collective``'s tensors must live: ``device``, or the CPU where gloo has no CUDA version of it."""
    device = torch.device(device)
    if backend == "gloo" and device.type == "cuda" and collective not in GLOO_CUDA_COLLECTIVES:
        return torch.device("cpu")
    return device


def host_staged(collective: str, call: Callable, output: torch.Tensor, input_: torch.Tensor, group=None,
                **kwargs) -> torch.Tensor:
    """``call(output, input_, group=group, **kwargs)``, through host copies when the group's backend cannot
    run ``collective`` on these tensors (gloo on CUDA tensors); returns ``output``.

    The copies cost two device<->host transfers: acceptable for the one-GPU labs, never used with NCCL.
    """
    if comm_device(dist.get_backend(group), output.device, collective) == output.device:
        call(output, input_, group=group, **kwargs)
        return output
    host_out = torch.empty_like(output, device="cpu")
    call(host_out, input_.cpu(), group=group, **kwargs)
    output.copy_(host_out)
    return output


@dataclass(frozen=True)
class Placement:
    backend: str  # "nccl" | "gloo"
    device: str  # "cpu" | "cuda:0" ...
    why: str  # one sentence a learner can read


def select_placement(local_rank: int, local_world_size: int) -> Placement:
    backend = os.environ.get("COURSE_BACKEND")
    device = os.environ.get("COURSE_DEVICE")
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend is None and device is not None and not device.startswith("cuda"):
        backend, why = "gloo", f"COURSE_DEVICE={device} set by the user: gloo"
    elif backend is None:
        if n_gpus >= local_world_size and n_gpus > 0 and dist.is_nccl_available():
            backend, why = "nccl", f"{n_gpus} GPU(s) for {local_world_size} local rank(s): one GPU per rank, NCCL"
        elif n_gpus > 0:
            backend = "gloo"
            why = (f"{local_world_size} local ranks but {n_gpus} GPU(s): NCCL refuses two ranks on one GPU, "
                   "so gloo moves CUDA tensors")
        else:
            backend, why = "gloo", "no GPU: gloo on the CPU"
    else:
        why = f"COURSE_BACKEND={backend} set by the user"
    if device is None:
        device = f"cuda:{local_rank % n_gpus}" if n_gpus > 0 else "cpu"
    elif "COURSE_BACKEND" not in os.environ and "COURSE_DEVICE" not in why:
        why += f"; COURSE_DEVICE={device} set by the user"
    if backend == "nccl" and not device.startswith("cuda"):
        raise RuntimeError(f"COURSE_BACKEND=nccl needs a GPU for every rank, but this rank would run on {device} "
                           f"({n_gpus} GPU(s) visible): unset COURSE_BACKEND to let the course use gloo")
    return Placement(backend, device, why)


def seed_all(seed: int) -> None:
    """Same seed on every rank unless a worker offsets it: DDP-style labs need identical initial weights."""
    random.seed(seed)
    torch.manual_seed(seed)  # seeds CUDA too
    with contextlib.suppress(ImportError):
        import numpy as np

        np.random.seed(seed % 2**32)


class Reporter:
    """Sends results to the notebook, or prints them when the worker runs under a plain ``torchrun``."""

    def __init__(self, rank: int, sock: socket.socket | None):
        self.rank = rank
        self.sock = sock
        self.task: int | None = None
        self._lock = threading.Lock()  # the pool's reader thread answers stack dumps on the same socket

    def send(self, kind: str, data: Any) -> None:
        if self.sock is None:
            self._print(kind, data)
            return
        frame = protocol.encode(kind, data, rank=self.rank, task=self.task)
        with self._lock:
            self.sock.sendall(frame)

    def _print(self, kind: str, data: Any) -> None:
        if kind == "metric":
            print(f"[rank {self.rank}] " + " ".join(f"{k}={_short(v)}" for k, v in data.items()), flush=True)
        elif kind == "log":
            print(f"[rank {self.rank}] {data['text']}", flush=True)
        elif kind == "result":
            for k, v in data.items():
                print(f"[rank {self.rank}] {k} = {_short(v)}", flush=True)
        elif kind == "error":
            print(f"[rank {self.rank}] FAILED\n{data['traceback']}", file=sys.stderr, flush=True)


def _short(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        if v.numel() <= 8:
            return str(v.tolist())
        return f"tensor{tuple(v.shape)} {v.dtype} sum={v.double().sum().item():.6g}"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


@dataclass
class Context:
    """Everything a worker needs to know about where it runs, and how to send things back."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    backend: str
    device: torch.device
    why: str
    reporter: Reporter
    collective_timeout_s: float
    _results: dict = field(default_factory=dict)

    # -- results protocol -------------------------------------------------------------------
    def log(self, *parts: Any) -> None:
        self.reporter.send("log", {"text": " ".join(str(p) for p in parts)})

    def metric(self, step: int, **values: Any) -> None:
        """One point of a per-step stream (loss, grad norm, ...): the notebook draws it live."""
        self.reporter.send("metric", {"step": step, **values})

    def result(self, **values: Any) -> None:
        """Final values of this rank (tensors, numbers, strings, lists, dicts)."""
        self.reporter.send("result", values)

    @contextlib.contextmanager
    def timer(self, name: str):
        """Wall time of a region, synchronising the GPU on both sides so kernels are counted, not launches."""
        self.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            self.synchronize()
            self.reporter.send("result", {"timings": {name: time.perf_counter() - start}})

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def comm_device(self, collective: str) -> torch.device:
        """The device for ``collective``'s tensors on this rank: the CPU for gloo's CPU-only collectives."""
        return comm_device(self.backend, self.device, collective)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def new_group(self, ranks=None, timeout_s: float | None = None):
        """A new process group with its own collective timeout (the hang faults use a short one)."""
        timeout = datetime.timedelta(seconds=timeout_s or self.collective_timeout_s)
        return dist.new_group(ranks=ranks, timeout=timeout, backend=self.backend)


def collective_timeout() -> datetime.timedelta:
    """The collective timeout this rank's world was created with: new groups should wait no longer.

    (``dist.new_group`` without a timeout falls back to torch's default of 30 minutes, not the world's.)
    """
    return datetime.timedelta(seconds=float(os.environ.get("COURSE_COLLECTIVE_TIMEOUT", DEFAULT_COLLECTIVE_TIMEOUT_S)))


def init_distributed(collective_timeout_s: float | None = None, sock: socket.socket | None = None) -> Context:
    """Join the job torchrun started (env:// rendezvous) with a finite collective timeout."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    node_rank = int(os.environ.get("GROUP_RANK", 0))
    if collective_timeout_s is None:
        collective_timeout_s = collective_timeout().total_seconds()
    os.environ["COURSE_COLLECTIVE_TIMEOUT"] = str(collective_timeout_s)  # for groups created later
    placement = select_placement(local_rank, local_world_size)
    device = torch.device(placement.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # Two cores shared by up to eight ranks: one intra-op thread per rank keeps them from fighting.
    if device.type == "cpu":
        torch.set_num_threads(int(os.environ.get("COURSE_THREADS_PER_RANK", 1)))
    if "MASTER_ADDR" not in os.environ:  # run as plain `python worker.py`: a world of one
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if not dist.is_initialized():
        kwargs = {}
        if placement.backend == "nccl":
            kwargs["device_id"] = device  # eager NCCL init: errors surface here, not in the first collective
        dist.init_process_group(
            backend=placement.backend, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout_s), **kwargs,
        )
    return Context(
        rank=rank, local_rank=local_rank, world_size=world_size, local_world_size=local_world_size,
        node_rank=node_rank, backend=placement.backend, device=device, why=placement.why,
        reporter=Reporter(rank, sock), collective_timeout_s=collective_timeout_s,
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS picks it): never a fixed port, so two runs cannot collide."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def error_payload(exc: BaseException) -> dict:
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    }


# -- refusing parameters: the sentences every check_params is made of ---------------------------------------
# A worker's ``check_params(world_size, **params)`` returns one sentence that names what the learner can change,
# or None. These helpers say the recurring rules the same way everywhere; each returns a clause or None, and
# ``refusal`` joins the clauses that apply into the one sentence.

RENAMED = {"tp_size": "tp", "stages": "pp", "n_heads": "heads", "n_kv_heads": "kv_heads", "ffn_hidden": "ffn",
           "chunks": "virtual_stages", "zero_stage": "zero", "num_microbatches": "micro_batches", "drill": "fault"}


def renamed(old: str) -> str:
    """The new name of a renamed parameter, with a warning that the old one goes away after one release."""
    import warnings

    new = RENAMED[old]
    warnings.warn(f"{old}= is now called {new}=; {old}= will stop working in the next release", FutureWarning,
                  stacklevel=3)
    return new


def rename_params(params: dict) -> dict:
    """``params`` with every old name (``RENAMED``) replaced by its new one, each with its warning."""
    return {(renamed(k) if k in RENAMED else k): v for k, v in params.items()}


def choose_divisor(n: int) -> str:
    """The end of a refusal for a size that must divide ``n``: "choose 1, 2 or 4" (the values themselves, not the
    rule, so a learner at a slider sees which positions work; past eight of them, the rule)."""
    divisors = [str(d) for d in range(1, n + 1) if n % d == 0]
    return "choose " + (_either(divisors) if len(divisors) <= 8 else f"a divisor of {n}")


def _either(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def divides(name: str, value, of: str, total: int) -> str | None:
    """``tp=3 does not divide heads=8: choose 1, 2, 4 or 8``, or None when it does."""
    if not isinstance(total, int) or total < 1:
        return at_least(of, total)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1 and total % value == 0:
        return None
    return f"{name}={value} does not divide {of}={total}: {choose_divisor(total)}"


def divides_world(name: str, value, world: int) -> str | None:
    """``tp=3 does not divide the 4 ranks: choose 1, 2 or 4``, or None when it does. The ranks, not
    ``world_size=4``: in a chapter's widget the world is the chapter's, and the learner changes the degree."""
    if not isinstance(world, int) or world < 1:
        return at_least("world_size", world)
    why = divides(name, value, "world_size", world)
    return why and f"{name}={value} does not divide the {world} ranks: {choose_divisor(world)}"


def one_of(name: str, value, choices) -> str | None:
    """``fault='x' is not one of 'none' or 'a'``, or None."""
    if value in choices:
        return None
    return f"{name}={value!r} is not one of {_either([repr(c) for c in choices])}"


def at_least(name: str, value, low: int | float = 1) -> str | None:
    """``steps=0 must be at least 1``, or None (a bool or a non-number is refused too)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= low:
        return None
    return f"{name}={value!r} must be at least {low}"


def batch_over_world(global_batch, world: int, name: str = "global_batch", per: str = "world_size") -> str | None:
    """The batch every data-parallel run splits evenly: ``global_batch=10 does not split over world_size=4 ...``."""
    if isinstance(global_batch, int) and global_batch >= 1 and global_batch % world == 0:
        return None
    return (f"{name}={global_batch} does not split evenly over {per}={world} "
            f"(choose a positive multiple of {world})")


def refusal(*clauses: str | None) -> str | None:
    """The clauses that apply, joined into one sentence (None when none applies)."""
    found = [c for c in clauses if c]
    return "; ".join(found) if found else None


# -- running a worker from a terminal --------------------------------------------------------------

def _cli_params(main: Callable, argv: list[str]) -> dict:
    """``--size 8 --dtype float32`` -> {"size": 8, "dtype": "float32"}, typed from main's defaults."""
    import argparse

    parser = argparse.ArgumentParser(description=(main.__doc__ or "").strip().splitlines()[0] if main.__doc__ else None)
    for name, p in list(inspect.signature(main).parameters.items())[1:]:
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            continue
        default = p.default
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            parser.add_argument(flag, dest=name, type=lambda s: s.lower() in ("1", "true", "yes"), default=default)
        elif isinstance(default, (list, tuple)):
            kind = type(default[0]) if default else str
            parser.add_argument(flag, dest=name, type=kind, nargs="+", default=list(default))
        elif default is inspect.Parameter.empty:
            parser.add_argument(flag, dest=name, required=True)
        else:
            parser.add_argument(flag, dest=name, type=type(default) if default is not None else str, default=default)
    return vars(parser.parse_args(argv))


def entrypoint(main: Callable, argv: list[str] | None = None) -> None:
    """``if __name__ == "__main__": entrypoint(main)`` at the bottom of every worker."""
    params = _cli_params(main, sys.argv[1:] if argv is None else argv)
    # the worker's own refusal, as course_utils.run gives it, before any process group exists
    rule = getattr(sys.modules.get(main.__module__), "check_params", None)
    message = rule(int(os.environ.get("WORLD_SIZE", 1)), **params) if rule is not None else None
    if message:
        print(f"{main.__module__}: {message}", file=sys.stderr, flush=True)
        sys.exit(2)
    # one seed: a worker's own --seed also seeds the generators, as the launcher's seed does
    seed_all(int(params.get("seed", os.environ.get("COURSE_SEED", 0))))
    ctx = init_distributed()
    try:
        out = main(ctx, **params)
        if out:
            ctx.result(**out)
    except BaseException as exc:
        ctx.reporter.send("error", error_payload(exc))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Leave without finalizing the interpreter, as the pool's ranks do (pool.py): a gloo worker thread may
    # still be releasing the last collective's tensors, and when that meets a finalizing interpreter the
    # process aborts after its results were printed ("terminate called without an active exception",
    # SIGABRT; ProcessGroupGloo::runLoop -> decref_pyobject -> PyEval_AcquireThread, about 1 run in 16 of
    # ch11_zero1.py here; the race pytorch/pytorch#179291 describes).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
