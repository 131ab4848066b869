"""Chapter 01's collectives, in one process: the inputs every rank starts from and what each must hold afterwards.

Inputs are chosen so that you can read where each number came from: element j of rank r's input is
``10 * (r + 1) + j``; the tens digit names the source rank, the units digit the position. After an
``all_to_all`` at world 4, rank 1 holds [11, 21, 31, 41]: element 1 of every rank.

``reference(...)`` computes, without any communication, what every rank must hold after a collective; the
worker (``workers/ch01_collectives.py``) runs the real one, and the notebook and the tests compare the two.
"""
from __future__ import annotations

import torch

COLLECTIVES = ("broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter", "all_to_all",
               "scatter", "gather", "barrier")
OPS = ("sum", "product", "min", "max", "avg", "band", "bor", "bxor")
BITWISE = ("band", "bor", "bxor")  # bitwise AND, OR, XOR: defined for integer tensors only
DTYPES = {"float32": torch.float32, "int64": torch.int64}
REDUCING = ("reduce", "all_reduce", "reduce_scatter")
ROOTED = ("broadcast", "reduce", "scatter", "gather")


def rank_input(collective: str, rank: int, world_size: int, chunk: int = 1, dtype: str = "float32"):
    """What rank ``rank`` holds before the collective; None for a barrier, which moves no data.

    Whole numbers in float32 (or int64, for the bitwise operators), so every result can be read exactly.
    """
    if collective == "barrier":
        return None
    length = chunk if collective in ("all_gather", "gather") else world_size * chunk
    return (10 * (rank + 1) + torch.arange(length)).to(DTYPES[dtype])


def input_for(collective: str, rank: int, world_size: int, chunk: int, root: int, dtype: str = "float32"):
    """What rank ``rank`` holds before ``collective`` rooted at ``root`` (a scatter's input is on the root only)."""
    if collective == "scatter":  # the root holds the list to scatter, whoever the root is
        return rank_input(collective, rank, world_size, chunk, dtype) if rank == root else None
    return rank_input(collective, rank, world_size, chunk, dtype)


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
    inputs = [input_for(collective, r, n, chunk, root) for r in range(n)]
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
