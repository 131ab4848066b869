"""The attention inputs of one run, derived from a seed, so every rank and the notebook's reference agree.

Chapter 14 rings attention alone, on random q, k, v (not the course's GPT, which chapter 15 rings): what it teaches,
the blocks of the ring, their causal work and the online-softmax merge, lives in one attention call, and its
float64 reference is exact attention on the same tensors.
"""
from __future__ import annotations

import torch

DTYPES = {"float64": torch.float64, "float32": torch.float32}


def make_inputs(batch: int, heads: int, seq: int, head_dim: int, seed: int = 0, dtype: str = "float64",
                kv_heads: int = 0):
    """``(q, k, v, dout)`` on the CPU: the whole sequence (each rank then takes its rows). q and dout are
    ``[b, heads, seq, d]``, k and v ``[b, kv_heads, seq, d]`` (``kv_heads`` 0: as many as ``heads``, the same draws
    as before grouped-query attention was added, so a seed gives the ring chapter's tensors unchanged)."""
    gen = torch.Generator().manual_seed(seed)
    heads_of = (heads, kv_heads or heads, kv_heads or heads, heads)  # q, k, v, dout: drawn in this order
    return tuple(torch.randn((batch, h, seq, head_dim), generator=gen, dtype=torch.float64).to(DTYPES[dtype])
                 for h in heads_of)
