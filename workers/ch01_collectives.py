"""Every collective of torch.distributed, once, with each rank's tensor before and after.

    torchrun --nproc-per-node 4 workers/ch01_collectives.py --collective all_to_all

Inputs are chosen so that you can read where each number came from: element j of rank r's input is
``10 * (r + 1) + j``; the tens digit names the source rank, the units digit the position. After an
``all_to_all`` at world 4, rank 1 holds [11, 21, 31, 41]: element 1 of every rank.

``reference(...)`` computes, in one process and without any communication, what every rank must hold
afterwards; the notebook and the tests compare the ranks' tensors with it.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from workers.runtime import entrypoint

COLLECTIVES = ("broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter", "all_to_all",
               "scatter", "gather", "barrier")
OPS = ("sum", "product", "min", "max", "avg", "band", "bor", "bxor")
BITWISE = ("band", "bor", "bxor")  # bitwise AND, OR, XOR: defined for integer tensors only
DTYPES = {"float32": torch.float32, "int64": torch.int64}
REDUCING = ("reduce", "all_reduce", "reduce_scatter")
BARRIER_DELAY_S = 0.1  # rank r arrives at the barrier r * 100 ms late
ROOTED = ("broadcast", "reduce", "scatter", "gather")


def check_params(world_size, collective, op, chunk, root, dtype="float32", **_):
    if collective not in COLLECTIVES:
        return f"collective={collective!r} is not one of {', '.join(COLLECTIVES)}"
    if op not in OPS:
        return f"op={op!r} is not a reduction this chapter runs: choose one of {', '.join(OPS)}"
    if dtype not in DTYPES:
        return f"dtype={dtype!r} is not one this chapter runs: choose one of {', '.join(DTYPES)}"
    if dtype == "int64" and op == "avg" and collective in REDUCING:
        return "op=avg on int64 tensors would have to round: use dtype=float32 for an average"
    if chunk < 1:
        return f"chunk={chunk} elements per rank per block is too few: use 1 or more"
    if not 0 <= root < world_size:
        return f"root={root} is not a rank of a world of {world_size}: use 0 to {world_size - 1}"
    return None


def rank_input(collective: str, rank: int, world_size: int, chunk: int = 1, dtype: str = "float32"):
    """What rank ``rank`` holds before the collective; None for a barrier, which moves no data.

    Whole numbers in float32 (or int64, for the bitwise operators), so every result can be read exactly.
    """
    if collective == "barrier":
        return None
    length = chunk if collective in ("all_gather", "gather") else world_size * chunk
    return (10 * (rank + 1) + torch.arange(length)).to(DTYPES[dtype])


def _reduce(stack: torch.Tensor, op: str) -> torch.Tensor:
    if op == "sum":
        return stack.sum(0)
    if op == "product":
        return stack.prod(0)
    if op == "min":
        return stack.min(0).values
    if op == "max":
        return stack.max(0).values
    if op == "avg":
        return stack.mean(0)
    if op in BITWISE:
        combine = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}[op]
        out = stack[0].long()
        for row in stack[1:]:
            out = combine(out, row.long())
        return out.to(stack.dtype)
    raise ValueError(f"unknown op {op!r}")


def reference(collective: str, world_size: int, op: str = "sum", chunk: int = 1, root: int = 0) -> list:
    """Single-process answer: what each rank holds afterwards (None where the result is undefined).

    Computed in float64 from the same inputs the ranks use, so the comparison tests the collective,
    not float32 rounding order. A barrier moves no data, so it has no reference: every entry is None
    (its invariant, nobody leaves before the last rank arrives, is checked by timing it instead).
    """
    n = world_size
    inputs = [_input_for(collective, r, n, chunk, root) for r in range(n)]
    ins = [None if t is None else t.double() for t in inputs]
    if collective == "broadcast":
        return [ins[root].clone() for _ in range(n)]
    if collective == "reduce":
        return [_reduce(torch.stack(ins), op) if r == root else None for r in range(n)]
    if collective == "all_reduce":
        return [_reduce(torch.stack(ins), op) for _ in range(n)]
    if collective == "all_gather":
        return [torch.cat(ins) for _ in range(n)]
    if collective == "gather":
        return [torch.cat(ins) if r == root else None for r in range(n)]
    if collective == "reduce_scatter":
        total = _reduce(torch.stack(ins), op)
        return list(total.split(chunk))
    if collective == "scatter":
        return list(ins[root].split(chunk))
    if collective == "all_to_all":
        return [torch.cat([ins[src].split(chunk)[dst] for src in range(n)]) for dst in range(n)]
    if collective == "barrier":
        return [None for _ in range(n)]
    raise ValueError(f"unknown collective {collective!r}")


def _input_for(collective: str, rank: int, world_size: int, chunk: int, root: int, dtype: str = "float32"):
    if collective == "scatter":  # the root holds the list to scatter, whoever the root is
        return rank_input(collective, rank, world_size, chunk, dtype) if rank == root else None
    return rank_input(collective, rank, world_size, chunk, dtype)


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
    x_in = _input_for(collective, r, n, chunk, root, dtype)
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
