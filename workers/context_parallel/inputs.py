"""The attention inputs of one run, derived from a seed, so every rank and the notebook's reference agree.

Chapter 14 rings attention alone, on random q, k, v (not the course's GPT, which chapter 15 rings): what it teaches,
the blocks of the ring, their causal work and the online-softmax merge, lives in one attention call, and its
float64 reference is exact attention on the same tensors.
"""
from __future__ import annotations

import torch

DTYPES = {"float64": torch.float64, "float32": torch.float32}


def make_inputs(batch: int, heads: int, seq: int, head_dim: int, seed: int = 0, dtype: str = "float64"):
    """``(q, k, v, dout)``, each ``[b, h, seq, d]``, on the CPU: the whole sequence (each rank then takes its rows)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, heads, seq, head_dim)
    return tuple(torch.randn(shape, generator=gen, dtype=torch.float64).to(DTYPES[dtype]) for _ in range(4))
