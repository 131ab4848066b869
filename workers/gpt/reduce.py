"""The gradient all-reduce, by hand (what DDP does, without its hooks), and the communication fault.

One flat buffer per step: copy every gradient in, all-reduce (a sum over ranks), divide by the world
size, copy back. The fault ``sum_not_average`` is a rank that skips the division (an old code version on
one node, a world size read as 1): its gradient is n times everyone else's, so from that step on its
weights part company with the other ranks', silently; the loss on that rank may even look fine.

Before and after the reduction each rank also notes the float64 sum of its gradient. Summation is linear,
so after a correct average every rank's reduced sum equals the mean of the ranks' local sums (up to
rounding): a rank whose reduced sum is off names itself (``reduction_culprits``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def average_gradients(params, *, divide: bool = True) -> dict:
    """Average ``.grad`` over the ranks in place; ``divide=False`` is the fault (sum, no division).

    Returns {"local_sum", "reduced_sum"}: float64 sums of this rank's gradient before and after.
    """
    params = [p for p in params if p.grad is not None]
    flat = torch.cat([p.grad.reshape(-1) for p in params])  # [P]
    local_sum = float(flat.double().sum())
    if distributed():
        dist.all_reduce(flat)  # SUM over ranks
        if divide:
            flat /= dist.get_world_size()
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
        offset += p.numel()
    return {"local_sum": local_sum, "reduced_sum": float(flat.double().sum())}


def gather_objects(value) -> list:
    """Every rank's ``value``, by rank (a list of one at world size 1)."""
    if not distributed():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def reduction_culprits(sums: list[dict], rtol: float = 1e-3) -> list[int]:
    """Ranks whose reduced gradient sum is not the mean of the local sums.

    The tolerance is relative to the total magnitude of the local sums: reordered fp32 additions move
    the sum by ~1e-7 of that, a rank that forgot to divide by n = 2 moves it by 100%.
    """
    mean_local = sum(s["local_sum"] for s in sums) / len(sums)
    scale = max(sum(abs(s["local_sum"]) for s in sums), 1e-12)
    return [r for r, s in enumerate(sums) if abs(s["reduced_sum"] - mean_local) > rtol * scale]
