"""Chapter 14, without ranks: the splits cover the sequence, the block rule, and the work balance it implies.

These are properties of the token layout alone; the rank tests (``test_ch14_ring_attention.py``) check that
the ranks really do this work and get full attention from it.
"""
import pytest

from workers.context_parallel.blocks import block_kind, block_plan, work_per_rank
from workers.context_parallel.split import chunk_ranges, local_positions, split_problem


@pytest.mark.parametrize("split", ["contiguous", "zigzag"])
@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_every_token_is_held_by_exactly_one_rank(split, cp):
    seq = 16 * cp
    held = sorted(p for r in range(cp) for p in local_positions(seq, cp, r, split).tolist())
    assert held == list(range(seq))  # a gap or an overlap would drop or double-count queries
    assert {len(local_positions(seq, cp, r, split)) for r in range(cp)} == {seq // cp}  # seq/cp rows each


def test_zigzag_pairs_chunk_r_with_its_mirror():
    # Megatron's split at cp = 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2 (chunks of seq / 4)
    assert chunk_ranges(8, 2, 0, "zigzag") == [(0, 2), (6, 8)]
    assert chunk_ranges(8, 2, 1, "zigzag") == [(2, 4), (4, 6)]


def test_block_rule():
    assert block_kind(3, 1) == "full"  # every key earlier than every query
    assert block_kind(2, 2) == "diagonal"  # same positions: mask inside the block
    assert block_kind(1, 3) == "skip"  # every key later: a causal query sees none of them
    assert block_kind(1, 3, causal=False) == "full"


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_causal_contiguous_is_imbalanced_and_zigzag_is_not(cp):
    seq = 4 * cp
    contiguous = [w["score_entries"] for w in work_per_rank(seq, cp, "contiguous", True)]
    zigzag = [w["score_entries"] for w in work_per_rank(seq, cp, "zigzag", True)]
    # contiguous: rank r computes r full blocks + its diagonal, so rank cp-1 does cp times rank 0's work
    assert contiguous == [(r + 1) * contiguous[0] for r in range(cp)]
    # zigzag: chunk r sees r+1 chunks, chunk 2cp-1-r sees 2cp-r: 2cp+1 blocks on every rank
    assert len(set(zigzag)) == 1 and work_per_rank(seq, cp, "zigzag", True)[0]["blocks"] == 2 * cp + 1
    # and the balanced split does no more work in total: the same lower triangle, cut finer
    assert sum(zigzag) <= sum(contiguous)


@pytest.mark.parametrize("split", ["contiguous", "zigzag"])
def test_every_visible_block_is_met_exactly_once_over_the_ring(split):
    cp = 4
    met = [(qc, kc) for steps in block_plan(cp, split, True) for blocks in steps for qc, kc, _ in blocks]
    assert len(met) == len(set(met))  # each (q chunk, k chunk) pair at one rank, one step: merged once
    n = 2 * cp if split == "zigzag" else cp
    assert sorted(met) == [(a, b) for a in range(n) for b in range(n)]


def test_seq_that_does_not_split_is_named():
    assert "divisible by 8" in split_problem(12, 4, "zigzag")  # zigzag needs 2*cp chunks
    assert split_problem(12, 4, "contiguous") is None
    assert "divisible by 4" in split_problem(10, 4, "contiguous")
