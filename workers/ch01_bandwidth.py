"""A small nccl-tests: time a collective at several message sizes, the way NVIDIA/nccl-tests does.

    torchrun --nproc-per-node 4 workers/ch01_bandwidth.py --collective all_reduce --sizes 4096 1048576 16777216

``sizes`` are nccl-tests' S in bytes: the whole array (for all_gather the gathered output, for
reduce_scatter the unreduced input), in float32. For each size: ``warmup`` untimed runs, then ``iters``
back-to-back runs between two clock reads (synchronised on GPU), averaged; each rank's average is then
reduced with MAX, because a collective is finished only when its slowest rank is. Bandwidths are computed
in the notebook (``algbw = S / t``, ``busbw = algbw * factor``): this worker only measures time.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from workers.runtime import all_gather_single, at_least, entrypoint, one_of, reduce_scatter_single, refusal

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce")
MAX_BYTES = 1 << 30


def check_params(world_size, collective, sizes, iters, warmup, **_):
    bad_sizes = not sizes or any((not isinstance(s, int)) or s < 4 or s > MAX_BYTES for s in sizes)
    return refusal(one_of("collective", collective, COLLECTIVES),
                   f"sizes must be whole numbers of bytes from 4 to {MAX_BYTES} (1 GiB), not {sizes!r}" if bad_sizes
                   else None,
                   at_least("iters", iters), at_least("warmup", warmup, 0))


def element_count(collective: str, nbytes: int, world_size: int) -> int:
    """float32 elements of the full array S, rounded down to a multiple of world_size (at least one per rank)."""
    per_rank = max(nbytes // 4 // world_size, 1)
    return per_rank * world_size


def _op(collective: str, total: int, n: int, dev):
    """Buffers and a zero-argument callable that runs the collective once."""
    if collective == "all_reduce":
        x = torch.ones(total, device=dev)
        return lambda: dist.all_reduce(x)
    if collective == "broadcast":
        x = torch.ones(total, device=dev)
        return lambda: dist.broadcast(x, src=0)
    if collective == "reduce":
        x = torch.ones(total, device=dev)
        return lambda: dist.reduce(x, dst=0)
    if collective == "all_gather":
        out, inp = torch.empty(total, device=dev), torch.ones(total // n, device=dev)
        return lambda: all_gather_single(out, inp)
    if collective == "reduce_scatter":
        out, inp = torch.empty(total // n, device=dev), torch.ones(total, device=dev)
        return lambda: reduce_scatter_single(out, inp)
    if collective == "all_to_all":
        out, inp = torch.empty(total, device=dev), torch.ones(total, device=dev)
        return lambda: dist.all_to_all_single(out, inp)
    raise ValueError(f"unknown collective {collective!r}")


def main(ctx, collective: str = "all_reduce", sizes: list = [4096, 65536, 1048576, 4194304, 16777216],  # noqa: B006
         iters: int = 5, warmup: int = 2):
    """Time ``collective`` at each size in ``sizes`` (bytes); report seconds per call, max over ranks."""
    n, dev = ctx.world_size, ctx.comm_device(collective)
    out_bytes, seconds = [], []
    for step, nbytes in enumerate(sizes):
        total = element_count(collective, int(nbytes), n)
        run_once = _op(collective, total, n, dev)
        for _ in range(warmup):
            run_once()
        ctx.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            run_once()
        ctx.synchronize()
        mine = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=dev)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the slowest rank decides
        out_bytes.append(total * 4)
        seconds.append(mine.item())
        ctx.metric(step=step, bytes=total * 4, seconds=mine.item())
    return {"collective": collective, "bytes": out_bytes, "seconds": seconds, "world_size": n,
            "iters": iters, "backend": ctx.backend, "device": str(dev)}


if __name__ == "__main__":
    entrypoint(main)
