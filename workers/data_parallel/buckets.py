"""How DDP packs gradients into buckets (chapter 02): the rule, the limits it uses, and a prediction per model.

``bucket_assignment`` is DDP's packing rule; ``ddp_bucket_limits`` the limits it applies once it has rebuilt its
buckets; ``predict_ddp_buckets`` what one backward all-reduces for a chain of layers. ``workers/ch02_internals.py``
records what DDP really all-reduces next to this prediction.
"""
from __future__ import annotations

import torch.nn as nn

MIB = 1024 * 1024
DDP_FIRST_BUCKET_BYTES = 1 * MIB  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES, used with the default cap
DDP_DEFAULT_BUCKET_CAP_MB = 25


def bucket_assignment(sizes_bytes: list[int], limits_bytes: list[int]) -> list[list[int]]:
    """DDP's rule for packing gradients into buckets (``compute_bucket_assignment_by_size`` in reducer.cpp).

    Walk the gradients in the order they become ready; add each to the open bucket; as soon as the bucket
    holds *at least* the current limit, close it. ``limits_bytes`` gives the limit of the first bucket, the
    second, ...; the last limit applies to all the rest. Returns the indices (into ``sizes_bytes``) per bucket.
    """
    if not limits_bytes:
        raise ValueError("give at least one bucket limit in bytes")
    buckets, current, filled, k = [], [], 0, 0
    for i, size in enumerate(sizes_bytes):
        current.append(i)
        filled += size
        if filled >= limits_bytes[min(k, len(limits_bytes) - 1)]:
            buckets.append(current)
            current, filled, k = [], 0, k + 1
    if current:
        buckets.append(current)
    return buckets


def ddp_bucket_limits(bucket_cap_mb: float | None) -> list[int]:
    """The limits DDP uses once it has rebuilt its buckets (from the second iteration on).

    With ``bucket_cap_mb`` left at its default (None: 25 MiB), the first bucket is capped at 1 MiB so that
    the first all-reduce can start early; an explicit ``bucket_cap_mb`` caps every bucket, the first included.
    """
    if bucket_cap_mb is None:
        return [DDP_FIRST_BUCKET_BYTES, DDP_DEFAULT_BUCKET_CAP_MB * MIB]
    return [int(bucket_cap_mb * MIB)]


def predict_ddp_buckets(model: nn.Module, bucket_cap_mb: float | None) -> dict:
    """What DDP will all-reduce per backward for ``model`` (a chain of layers: gradients ready last layer first).

    Iteration 1: a single bucket holding every gradient (DDP does not know the real backward order yet, so
    since PyTorch 2.0 it does not bucket at all before it has seen one backward). Iteration 2 on: buckets
    rebuilt in the order gradients became ready, with ``ddp_bucket_limits``.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    ready = list(reversed(range(len(params))))  # a chain: the last layer's gradients are ready first
    sizes = [params[i].numel() * params[i].element_size() for i in ready]
    buckets = bucket_assignment(sizes, ddp_bucket_limits(bucket_cap_mb))
    return {
        "first_iteration": [sum(sizes)],
        "rebuilt": [sum(sizes[j] for j in b) for b in buckets],
        "rebuilt_params": [[ready[j] for j in b] for b in buckets],
    }
