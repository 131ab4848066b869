"""Async collectives and how to time them: ``async_op=True`` returns a handle; ``wait()`` is the promise.

    torchrun --nproc-per-node 2 workers/ch01_async.py --size-mb 8

What each measurement means (all in milliseconds, medians over ``iters`` repetitions):

* ``blocking_host``: a host timer around ``dist.all_reduce(x)`` with no synchronisation. With gloo on the
  CPU the call returns when the data has arrived, so this is the real time. With NCCL the call returns
  as soon as the kernel is queued on the GPU: this number is the *launch*, not the communication.
* ``blocking_synced``: the same with ``torch.cuda.synchronize()`` before reading the clock (identical to
  ``blocking_host`` on the CPU).
* ``async_launch``: how long ``dist.all_reduce(x, async_op=True)`` takes to return a Work handle.
* ``async_wait``: from that return until ``work.wait()`` returns (plus a synchronize on GPU).
* ``compute``: ``matmuls`` matrix products alone; ``overlapped``: the same products issued between
  ``async_op=True`` and ``wait()``; ``sequential`` = all_reduce then products.
* ``cuda_event`` (GPU only): the all_reduce timed with CUDA events recorded on the current stream.

Timings move with the machine's load; one fact does not (``pending_at_launch``): rank 0 launches an async
all_reduce while every other rank is held back until that call has returned, so at that moment the sum cannot
exist yet and ``work.is_completed()`` must be False. A blocking call could not return there at all.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from workers.runtime import at_least, entrypoint, refusal


def check_params(world_size, size_mb, iters, matmuls, matmul_n, **_):
    size = None if 0 < size_mb <= 256 else (f"size_mb={size_mb} is outside 0 to 256 MB: pick a size that fits in "
                                            "memory on every rank")
    return refusal(size, at_least("iters", iters), at_least("matmuls", matmuls, 0), at_least("matmul_n", matmul_n))


def main(ctx, size_mb: float = 8.0, iters: int = 5, matmuls: int = 4, matmul_n: int = 256):
    """Time blocking vs async all_reduce, and compute overlapped with communication."""
    dev = ctx.device
    numel = int(size_mb * 2**20) // 4
    x = torch.ones(numel, device=dev)
    a = torch.randn(matmul_n, matmul_n, device=dev)
    n = ctx.world_size

    def compute():
        y = a
        for _ in range(matmuls):
            y = (y @ a) * (1.0 / matmul_n)  # scaled so values stay finite
        return y

    dist.all_reduce(x)  # warm-up: the first collective pays for connection setup
    compute()
    t: dict[str, list[float]] = {k: [] for k in ("blocking_host", "blocking_synced", "async_launch", "async_wait",
                                                 "compute", "sequential", "overlapped", "cuda_event")}
    stale_at_launch = []
    for _ in range(iters):
        x.fill_(1.0)
        ctx.synchronize()
        dist.barrier()  # all ranks start together, or a rank's time includes waiting for a late peer

        t0 = time.perf_counter()
        dist.all_reduce(x)
        t1 = time.perf_counter()  # on GPU: the kernel was queued, maybe not run
        ctx.synchronize()
        t2 = time.perf_counter()
        t["blocking_host"].append(t1 - t0)
        t["blocking_synced"].append(t2 - t0)

        x.fill_(1.0)
        ctx.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        work = dist.all_reduce(x, async_op=True)
        t1 = time.perf_counter()
        # Reading x now is a race: the sum may not have landed. (On GPU, .item() would also synchronise.)
        if not ctx.is_cuda:
            stale_at_launch.append(float(x[-1]) != float(n))
        work.wait()  # CPU: blocks until done. NCCL: makes the current stream wait; the host moves on.
        ctx.synchronize()
        t2 = time.perf_counter()
        t["async_launch"].append(t1 - t0)
        t["async_wait"].append(t2 - t1)
        if float(x[-1]) != float(n):
            raise RuntimeError(f"after wait() x[-1] = {float(x[-1])}, expected {n}: the all_reduce did not finish")

        ctx.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        compute()
        ctx.synchronize()
        t["compute"].append(time.perf_counter() - t0)

        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        compute()
        ctx.synchronize()
        t["sequential"].append(time.perf_counter() - t0)

        dist.barrier()
        t0 = time.perf_counter()
        work = dist.all_reduce(x, async_op=True)
        compute()  # independent of x: safe to run while x is in flight
        work.wait()
        ctx.synchronize()
        t["overlapped"].append(time.perf_counter() - t0)

        if ctx.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            dist.barrier()
            start.record()
            dist.all_reduce(x)
            end.record()
            end.synchronize()
            t["cuda_event"].append(start.elapsed_time(end) / 1e3)

    ms = {k: statistics.median(v) * 1e3 for k, v in t.items() if v}
    return {"ms": ms, "bytes": numel * 4, "stale_at_launch": sum(stale_at_launch), "iters": iters,
            "pending_at_launch": pending_at_launch(ctx, x), "device": str(dev), "backend": ctx.backend}


def pending_at_launch(ctx, x: torch.Tensor) -> bool | None:
    """Rank 0: was its async all_reduce still unfinished when the call returned? None on other ranks, or alone.

    The other ranks join the all_reduce only after rank 0 tells them its call returned, over a group of its own
    (a separate channel: that message cannot queue behind the pending all_reduce). Until they join, no sum exists,
    so the answer does not depend on timing or load.
    """
    if ctx.world_size == 1:
        return None
    signal = dist.new_group(backend="gloo")
    go = torch.zeros(1)
    if ctx.rank == 0:
        work = dist.all_reduce(x, async_op=True)
        pending = not work.is_completed()
        dist.broadcast(go, src=0, group=signal)  # "my call has returned: join now"
        work.wait()
    else:
        dist.broadcast(go, src=0, group=signal)
        dist.all_reduce(x)
        pending = None
    dist.destroy_process_group(signal)
    return pending


if __name__ == "__main__":
    entrypoint(main)
