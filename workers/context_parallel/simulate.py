"""Ring attention in one process: the same blocks, rule and merge as the ranks, without the ranks.

Used to grade a learner's block rule (``course_utils/catalogue/ch14.py``), and to show (notebook and
``tests/test_ch14_split.py``) what each classic mistake does to the output: ``MISTAKES`` injects a merge
without the rescale, a mask left off the diagonal blocks, or K/V sent to the wrong neighbour.
"""
from __future__ import annotations

import torch

from workers.attention.api import online_softmax_merge
from workers.attention.reference import attention_reference
from workers.context_parallel.blocks import block_kind, ring_source
from workers.context_parallel.split import check_split, chunk_ids, num_chunks


def one_process_ring(q, k, v, cp: int, split: str, causal: bool = True, rule=block_kind,
                     merge=online_softmax_merge, arrived=ring_source):
    """``(out, lse)`` ``[b, h, s, d]`` / ``[b, h, s]``: every rank's ring loop, with ``rule(q_chunk, k_chunk)``
    ("full", "diagonal" or "skip") deciding each block (a causal rule; non-causal uses "full" throughout).
    ``merge`` folds a block into the running (out, lse); ``arrived(rank, step, cp)`` is the rank whose K/V
    really reached ``rank`` at ``step``, while the rank believes it holds ``ring_source``'s (they differ when
    the ring sends the wrong way)."""
    check_split(q.shape[-2], cp, split)  # an uneven cut would leave the last rows out of every block
    size = q.shape[-2] // num_chunks(cp, split)
    part = lambda t, c: t[:, :, c * size:(c + 1) * size]  # noqa: E731 - chunk c of [b, h, s, d]
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float64)
    for rank in range(cp):
        for step in range(cp):
            for qc in chunk_ids(cp, rank, split):
                believed = chunk_ids(cp, ring_source(rank, step, cp), split)
                for kc, data in zip(believed, chunk_ids(cp, arrived(rank, step, cp), split)):
                    kind = rule(qc, kc) if causal else "full"
                    if kind == "skip":
                        continue
                    o_blk, l_blk = attention_reference(part(q, qc), part(k, data), part(v, data),
                                                       causal=kind == "diagonal")
                    rows = slice(qc * size, (qc + 1) * size)
                    out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], o_blk, l_blk)
    return out, lse


def merge_without_rescale(out, lse, o_blk, l_blk):
    """The mistake: add the block's output as it is, as if each block's softmax were over all keys."""
    return out + o_blk, torch.logaddexp(lse, l_blk)


def mask_left_off(q_chunk: int, k_chunk: int) -> str:
    """The mistake: skip future blocks but forget the causal mask inside the diagonal ones."""
    return "skip" if block_kind(q_chunk, k_chunk) == "skip" else "full"


def wrong_neighbour(rank: int, step: int, cp: int) -> int:
    """The mistake: K/V passed to rank - 1 instead of rank + 1, so step t brings rank + t's chunk."""
    return (rank + step) % cp


MISTAKES = {  # name -> keyword arguments of one_process_ring that inject it
    "merge without the rescale": {"merge": merge_without_rescale},
    "mask left off the diagonal": {"rule": mask_left_off},
    "K/V sent to the wrong neighbour": {"arrived": wrong_neighbour},
}
