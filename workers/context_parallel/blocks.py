"""Which (query chunk, key chunk) blocks attention must compute, and how much work each rank does.

Causal attention at chunk granularity (queries and keys cut at the same boundaries):

    q_chunk >  k_chunk   "full"       every key is earlier than every query: no mask
    q_chunk == k_chunk   "diagonal"   the same positions: the causal (lower-triangular) mask inside the block
    q_chunk <  k_chunk   "skip"       every key is later than every query: nothing to compute, nothing to merge

Without a mask every block is "full". The work of a rank is the number of blocks it does not skip, and the
score entries those blocks compute (block area): FLOPs are proportional to the second.
"""
from __future__ import annotations

from workers.context_parallel.split import check_split, chunk_ids, num_chunks

KINDS = ("full", "diagonal", "skip")


def block_kind(q_chunk: int, k_chunk: int, causal: bool = True) -> str:
    """"full", "diagonal" or "skip" for the block of query chunk ``q_chunk`` against key chunk ``k_chunk``."""
    if not causal or q_chunk > k_chunk:
        return "full"
    return "diagonal" if q_chunk == k_chunk else "skip"


def ring_source(rank: int, step: int, cp: int) -> int:
    """Whose K/V chunk rank ``rank`` holds at ring step ``step``: K/V travel to rank + 1, so it came from rank - step."""
    return (rank - step) % cp


def block_plan(cp: int, split: str, causal: bool) -> list[list[list[tuple[int, int, str]]]]:
    """``plan[rank][step]`` = the (q_chunk, k_chunk, kind) blocks that rank meets at that ring step."""
    plan = []
    for rank in range(cp):
        steps = []
        for step in range(cp):
            src = ring_source(rank, step, cp)
            steps.append([(qc, kc, block_kind(qc, kc, causal))
                          for qc in chunk_ids(cp, rank, split) for kc in chunk_ids(cp, src, split)])
        plan.append(steps)
    return plan


def work_per_rank(seq: int, cp: int, split: str, causal: bool) -> list[dict]:
    """Per rank: blocks computed (not skipped), of which diagonal, and the score entries computed."""
    check_split(seq, cp, split)  # seq // chunks would round down and count work for fewer tokens than seq
    size = seq // num_chunks(cp, split)  # tokens per chunk
    rows = []
    for steps in block_plan(cp, split, causal):
        kinds = [kind for blocks in steps for _, _, kind in blocks]
        done = sum(kind != "skip" for kind in kinds)
        rows.append({"blocks": done, "diagonal": kinds.count("diagonal"), "skipped": kinds.count("skip"),
                     "score_entries": done * size * size})
    return rows
