"""The gradient all-reduce, by hand (what DDP does, without its hooks), and the communication fault.

One flat buffer per step: copy every gradient in, all-reduce (a sum over ranks), divide by the world
size, copy back. The fault ``sum_not_average`` is a rank that skips the division (an old code version on
one node, a world size read as 1): its gradient is n times everyone else's, so from that step on its
weights part company with the other ranks', silently; the loss on that rank may even look fine.

The reduction check. Averaging is linear, so for any fixed vector r every rank's r . (reduced gradient)
must equal the mean over ranks of r . (local gradient), up to rounding. With r = (1, ..., 1), the plain
sum of all gradient elements, this check is blind: a model's gradient sums nearly cancel (the softmax
gradient of every position sums to 0 over the vocabulary, LayerNorm's over its features), and a sum near
0 is the same near 0 doubled. So each rank projects its gradient, before and after the reduction, on a
few fixed random Gaussian vectors that every rank draws from the same seed (``projection_probes``): a
projection is about ||g|| in size whatever the gradient's structure, and a rank whose reduced projections
are off names itself (``reduction_culprits``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

PROBES = 4  # random projections per check: a fault slips through only if all of them happen to be ~0
PROBE_SEED = 2024


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def projection_probes(n_elements: int, k: int = PROBES, seed: int = PROBE_SEED, device="cpu") -> torch.Tensor:
    """``k`` fixed random vectors with unit-variance Gaussian entries, [k, n_elements] float64: the same on
    every rank (same seed), so that projections taken on different ranks can be compared."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(k, n_elements, generator=g, dtype=torch.float64).to(device)


def gradient_fingerprint(local: torch.Tensor, reduced: torch.Tensor, probes: torch.Tensor | None = None) -> dict:
    """What the reduction check compares, for one rank: float64 sums of its flat gradient before (``local``)
    and after (``reduced``) the reduction and, given ``probes``, the projections on them and the local norm."""
    out = {"local_sum": float(local.double().sum()), "reduced_sum": float(reduced.double().sum())}
    if probes is not None:
        out["local_proj"] = (probes @ local.double()).tolist()  # [k]
        out["reduced_proj"] = (probes @ reduced.double()).tolist()  # [k]
        out["local_norm"] = float(local.double().norm())
    return out


def average_gradients(params, *, divide: bool = True, probes: torch.Tensor | None = None) -> dict:
    """Average ``.grad`` over the ranks in place; ``divide=False`` is the fault (sum, no division).

    Returns {"local_sum", "reduced_sum"}: float64 sums of this rank's gradient before and after; given
    ``probes`` (``projection_probes``), also the projections the reduction check needs (``gradient_fingerprint``).
    """
    params = [p for p in params if p.grad is not None]
    flat = torch.cat([p.grad.reshape(-1) for p in params])  # [P]
    local = flat.clone() if probes is not None else flat
    local_sum = float(flat.double().sum())
    if distributed():
        dist.all_reduce(flat)  # SUM over ranks
        if divide:
            flat /= dist.get_world_size()
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
        offset += p.numel()
    if probes is None:
        return {"local_sum": local_sum, "reduced_sum": float(flat.double().sum())}
    return gradient_fingerprint(local, flat, probes)


def gather_objects(value) -> list:
    """Every rank's ``value``, by rank (a list of one at world size 1)."""
    if not distributed():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def reduction_culprits(fingerprints: list[dict], rtol: float = 1e-4) -> list[int]:
    """Ranks whose reduced gradient's projections are not the mean of the ranks' local projections.

    ``fingerprints``: every rank's ``gradient_fingerprint`` (with probes). The tolerance is relative to the
    largest local gradient norm, which is the size of a projection on a unit-variance Gaussian vector:
    fp32 rounding in the all-reduce moves a projection by ~1e-7 of that; a rank that forgot to divide by
    n moves it by (n - 1) times the mean gradient's projection, of the order of the gradients themselves.
    """
    n = len(fingerprints)
    k = len(fingerprints[0]["local_proj"])
    mean_local = [sum(f["local_proj"][j] for f in fingerprints) / n for j in range(k)]
    scale = max(max(f["local_norm"] for f in fingerprints), 1e-30)
    # "not <=": a NaN projection (a rank whose reduction produced NaN) is a culprit, not a pass (NaN > x is False)
    return [r for r, f in enumerate(fingerprints)
            if not all(abs(f["reduced_proj"][j] - mean_local[j]) <= rtol * scale for j in range(k))]
