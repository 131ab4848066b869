"""The GPT's training data for the equivalence checks and its loss over valid tokens (chapters 06 and 15).

A ragged batch of random tokens, the same on every rank and in the one-process reference (drawn from a seed per
step): samples hold different numbers of valid targets, so micro-batches hold different numbers of tokens and a
loss averaged per micro-batch is not the batch's mean (chapter 15's ``per_microbatch_mean`` fault). The loss sums
the valid tokens' cross-entropy; the caller divides by the batch's count of valid tokens.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.model.gpt import GPTConfig


def token_losses(logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over the valid tokens. ``logits [s, b, V]``, ``targets`` and ``valid [b, s]``."""
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.t().reshape(-1), reduction="none")  # [s*b]
    return (ce * valid.t().reshape(-1).to(ce.dtype)).sum()


def make_batch(cfg: GPTConfig, global_batch: int, step: int, seed: int = 1):
    """Step ``step``'s global batch: ``tokens [B, seq + 1]`` and ``valid [B, seq]``.

    Ragged: sample i has a random number of valid targets (at least a quarter of seq), the rest is padding. So
    micro-batches hold different numbers of tokens, and a loss averaged per micro-batch is not the batch's mean.
    """
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    tokens = torch.randint(cfg.vocab, (global_batch, cfg.seq + 1), generator=g)
    lengths = torch.randint(max(1, cfg.seq // 4), cfg.seq + 1, (global_batch,), generator=g)
    valid = torch.arange(cfg.seq)[None, :] < lengths[:, None]  # [B, seq]
    return tokens, valid
