"""Ring attention in one process: the same blocks, rule and merge as the ranks, without the ranks.

Used to grade a learner's block rule (``course_utils/catalogue/ch14.py``) and to show, in the notebook, what
a wrong rule does to the output before any message is sent.
"""
from __future__ import annotations

import torch

from workers.attention.api import online_softmax_merge
from workers.attention.reference import attention_reference
from workers.context_parallel.blocks import block_kind, ring_source
from workers.context_parallel.split import chunk_ids, num_chunks


def one_process_ring(q, k, v, cp: int, split: str, causal: bool = True, rule=block_kind):
    """``(out, lse)`` ``[b, h, s, d]`` / ``[b, h, s]``: every rank's ring loop, with ``rule(q_chunk, k_chunk)``
    ("full", "diagonal" or "skip") deciding each block (a causal rule; non-causal uses "full" throughout)."""
    size = q.shape[-2] // num_chunks(cp, split)
    part = lambda t, c: t[:, :, c * size:(c + 1) * size]  # noqa: E731 - chunk c of [b, h, s, d]
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float64)
    for rank in range(cp):
        for step in range(cp):
            for qc in chunk_ids(cp, rank, split):
                for kc in chunk_ids(cp, ring_source(rank, step, cp), split):
                    kind = rule(qc, kc) if causal else "full"
                    if kind == "skip":
                        continue
                    o_blk, l_blk = attention_reference(part(q, qc), part(k, kc), part(v, kc), causal=kind == "diagonal")
                    rows = slice(qc * size, (qc + 1) * size)
                    out[:, :, rows], lse[:, :, rows] = online_softmax_merge(out[:, :, rows], lse[:, :, rows], o_blk, l_blk)
    return out, lse
