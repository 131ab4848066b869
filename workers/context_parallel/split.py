"""Which tokens each context-parallel rank holds.

``contiguous``: the sequence cut into cp equal chunks, rank r holds chunk r. With a causal mask the last
rank's queries see the whole sequence and the first rank's only their own chunk: rank cp-1 does about cp
times the work of rank 0.

``zigzag``: the sequence cut into 2*cp chunks, rank r holds chunk r and chunk 2*cp-1-r (an early chunk and
its mirror from the end), so every rank has the same number of visible (query, key) pairs. This is the split
of Megatron-LM's ``get_batch_on_this_cp_rank`` ("we split sequence into 2*CP ranks. Assuming CP=2, we then
get 4 chunks, chunk_0 and chunk_3 are assigned to GPU0, chunk_1 and chunk_2 are assigned to GPU1").
"""
from __future__ import annotations

import torch

from workers.layout.rules import SPLITS, Layout, num_chunks, problem  # the layout's rules: how cp cuts a sequence


def chunk_ids(cp: int, rank: int, split: str) -> list[int]:
    """The global chunk indices rank ``rank`` holds, in the order its local tensors store them."""
    if split == "zigzag":
        return [rank, 2 * cp - 1 - rank]  # an early chunk and its mirror: little causal work + much causal work
    num_chunks(cp, split)  # validates the name
    return [rank]


def check_split(seq: int, cp: int, split: str) -> None:
    """Raise ``split_problem``'s sentence as a ValueError when ``seq`` does not cut into equal chunks.

    Every function that turns a sequence into chunks calls it: ``seq // chunks`` would otherwise round down
    and drop the last ``seq % chunks`` tokens without a word (seq=10 at cp=4 loses rows 8 and 9).
    """
    problem = split_problem(seq, cp, split)
    n = num_chunks(cp, split) if split in SPLITS else 1
    if not problem and seq % n:  # one rank (cp = 1) may hold any sequence, but not cut it into 2 chunks
        problem = f"seq={seq} does not cut into {n} chunks ({split}): choose seq divisible by {n}"
    if problem:
        raise ValueError(problem)


def chunk_ranges(seq: int, cp: int, rank: int, split: str) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` token ranges of this rank's chunks, in local storage order."""
    check_split(seq, cp, split)
    if not 0 <= rank < cp:
        raise ValueError(f"rank={rank} is not a position in a ring of cp={cp} ranks: choose 0 <= rank < {cp}")
    size = seq // num_chunks(cp, split)
    return [(c * size, (c + 1) * size) for c in chunk_ids(cp, rank, split)]


def local_positions(seq: int, cp: int, rank: int, split: str) -> torch.Tensor:
    """Global token index of every local row, ``[seq/cp]``: how to put the ranks' outputs back in order. Without
    context parallelism (cp = 1) the one rank holds the whole sequence in order, whatever its length and split."""
    if cp == 1:
        return torch.arange(seq)
    return torch.cat([torch.arange(a, b) for a, b in chunk_ranges(seq, cp, rank, split)])


def take_local(x: torch.Tensor, seq: int, cp: int, rank: int, split: str) -> torch.Tensor:
    """This rank's rows of ``x`` [b, h, seq, d] along the sequence dim: ``[b, h, seq/cp, d]``."""
    if x.dim() < 3 or x.shape[2] != seq:
        raise ValueError(f"x of shape {tuple(x.shape)} does not hold seq={seq} tokens along dim 2 ([b, h, seq, d]): "
                         "pass the whole sequence, and its length as seq")
    return x[:, :, local_positions(seq, cp, rank, split).to(x.device)].contiguous()  # [b, h, s/cp, d]


def split_problem(seq: int, cp: int, split: str) -> str | None:
    """One sentence saying what to change when ``seq`` cannot be split, else None: the layout's rule
    (``workers/layout/rules.py: problem``, the one chapter 14's worker and chapter 15's trainer refuse with)."""
    return problem(Layout(cp=cp, split=split, seq=seq), cp)
