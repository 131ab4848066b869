"""Every collective of torch.distributed, once, with each rank's tensor before and after.

    torchrun --nproc-per-node 4 workers/ch01_collectives.py --collective all_to_all

Inputs are chosen so that you can read where each number came from: element j of rank r's input is
``10 * (r + 1) + j``; the tens digit names the source rank, the units digit the position. After an
``all_to_all`` at world 4, rank 1 holds [11, 21, 31, 41]: element 1 of every rank.

``workers/collectives/reference.py: reference(...)`` computes, in one process and without any communication,
what every rank must hold afterwards; the notebook and the tests compare the ranks' tensors with it.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from workers.collectives.reference import COLLECTIVES, DTYPES, OPS, REDUCING, input_for
from workers.runtime import at_least, entrypoint, one_of, refusal

BARRIER_DELAY_S = 0.1  # rank r arrives at the barrier r * 100 ms late


def check_params(world_size, collective, op, chunk, root, dtype="float32", **_):
    rounds = dtype == "int64" and op == "avg" and collective in REDUCING
    return refusal(one_of("collective", collective, COLLECTIVES), one_of("op", op, OPS), one_of("dtype", dtype, DTYPES),
                   "op=avg on int64 tensors would have to round: use dtype=float32 for an average" if rounds else None,
                   (why := at_least("chunk", chunk)) and f"{why} element per rank per block",
                   None if 0 <= root < world_size else
                   f"root={root} is not a rank of a world of {world_size}: use 0 to {world_size - 1}")


def _op(op: str):
    return getattr(dist.ReduceOp, op.upper())


def _barrier_demo(ctx) -> dict:
    """Rank r arrives r * 100 ms late (``BARRIER_DELAY_S``); nobody leaves before the last one has arrived.

    Each rank times itself (clocks of different machines are not comparable): how late it arrived after
    a first barrier, and how long it then waited inside the second one. Late + waited is about the same
    on every rank: the arrival time of the last rank.
    """
    dist.barrier()
    start = time.perf_counter()
    time.sleep(BARRIER_DELAY_S * ctx.rank)
    arrived = time.perf_counter()
    dist.barrier()
    left = time.perf_counter()
    return {"before": torch.tensor([(arrived - start) * 1e3]), "after": torch.tensor([(left - arrived) * 1e3]),
            "defined": True, "call": "dist.barrier()",
            "units": "ms: how late this rank arrived (before), how long it waited inside the barrier (after)"}


def main(ctx, collective: str = "all_reduce", op: str = "sum", chunk: int = 1, root: int = 0, dtype: str = "float32"):
    """Run one collective on inputs whose values name their source rank and position."""
    n, r, dev = ctx.world_size, ctx.rank, ctx.comm_device(collective)
    if collective == "barrier":
        return _barrier_demo(ctx)
    x_in = input_for(collective, r, n, chunk, root, dtype)
    like = {"device": dev, "dtype": DTYPES[dtype]}  # outputs of the gathering collectives
    before = None if x_in is None else x_in.to(dev)
    defined = True
    opname = f"ReduceOp.{op.upper()}"
    try:
        if collective == "broadcast":
            after = before.clone()
            dist.broadcast(after, src=root)
            call = f"dist.broadcast(x, src={root})"
        elif collective == "reduce":
            after = before.clone()
            dist.reduce(after, dst=root, op=_op(op))
            defined = r == root  # other ranks' buffers are scratch space: their contents are unspecified
            call = f"dist.reduce(x, dst={root}, op={opname})"
        elif collective == "all_reduce":
            after = before.clone()
            dist.all_reduce(after, op=_op(op))
            call = f"dist.all_reduce(x, op={opname})"
        elif collective == "all_gather":
            after = torch.empty(n * chunk, **like)
            dist.all_gather(list(after.split(chunk)), before)
            call = "dist.all_gather(outs, x)"
        elif collective == "gather":
            after = torch.empty(n * chunk, **like) if r == root else None
            dist.gather(before, list(after.split(chunk)) if r == root else None, dst=root)
            defined = r == root
            call = f"dist.gather(x, outs if rank == {root} else None, dst={root})"
        elif collective == "reduce_scatter":
            after = torch.empty(chunk, **like)
            dist.reduce_scatter(after, list(before.split(chunk)), op=_op(op))
            call = f"dist.reduce_scatter(out, chunks, op={opname})"
        elif collective == "scatter":
            after = torch.empty(chunk, **like)
            dist.scatter(after, list(before.split(chunk)) if r == root else None, src=root)
            call = f"dist.scatter(out, chunks if rank == {root} else None, src={root})"
        elif collective == "all_to_all":
            after = torch.empty(n * chunk, **like)
            dist.all_to_all(list(after.split(chunk)), list(before.split(chunk)))
            call = "dist.all_to_all(out_chunks, chunks)"
        else:
            raise ValueError(f"unknown collective {collective!r}")
    except (RuntimeError, TypeError, ValueError) as exc:
        # A backend that lacks an operation (AVG on gloo before torch 2.8, bitwise ops on floats) refuses it
        # on every rank before sending anything, so the group is still usable: report the refusal itself.
        if "ReduceOp" not in str(exc) and "support" not in str(exc).lower():
            raise
        return {"unsupported": f"{type(exc).__name__}: {str(exc).splitlines()[0]}", "call": collective,
                "backend": ctx.backend}
    return {"before": before, "after": after, "defined": defined, "call": call, "backend": ctx.backend,
            "device": str(dev)}


if __name__ == "__main__":
    entrypoint(main)
