"""Chapter 14, without ranks: the splits cover the sequence, the block rule, the work balance it implies, and
what each classic mistake does to the one-process ring.

These are properties of the token layout and the merge alone; the rank tests (``test_ch14_ring_attention.py``)
check that the ranks really do this work and get full attention from it.
"""
import re

import pytest
import torch

from workers.attention.reference import attention_reference, relative_error
from workers.context_parallel.blocks import block_kind, block_plan, work_per_rank
from workers.context_parallel.inputs import make_inputs
from workers.context_parallel.simulate import MISTAKES, one_process_ring
from workers.context_parallel.split import chunk_ranges, local_positions, split_problem, take_local


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
    # the layout's rule (workers/layout/rules.py: problem), the sentence chapter 14's worker refuses with
    assert split_problem(12, 4, "zigzag") == ("cp=4 cuts seq=12 into 8 chunks (zigzag), which does not divide it: "
                                             "choose seq divisible by 8")
    assert split_problem(12, 4, "contiguous") is None
    assert "cp=4 cuts seq=10 into 4 chunks (contiguous)" in split_problem(10, 4, "contiguous")
    assert "split='striped' is not one of" in split_problem(8, 2, "striped")


@pytest.mark.parametrize("seq, cp, split", [
    (10, 4, "contiguous"),  # 10 // 4 = 2 tokens a rank: rows 8 and 9 held by no rank
    (6, 2, "zigzag"),  # zigzag cuts 2*cp = 4 chunks: 6 // 4 = 1 token each, rows 4 and 5 held by no rank
    (4, 4, "zigzag"),  # 4 // 8 = 0 tokens a chunk: no rank holds anything
])
def test_a_seq_that_does_not_split_is_refused_not_truncated(seq, cp, split):
    # Rounding seq / chunks down would silently leave the last tokens out of every rank, so the loss and the
    # gradients would cover a shorter sequence than the learner passed. Each entry point refuses it with
    # split_problem's sentence instead.
    sentence = re.escape(split_problem(seq, cp, split))
    x = torch.arange(float(seq)).view(1, 1, seq, 1)  # [b, h, seq, d]
    for rank in range(cp):
        with pytest.raises(ValueError, match=f"^{sentence}$"):
            chunk_ranges(seq, cp, rank, split)
        with pytest.raises(ValueError, match=f"^{sentence}$"):
            local_positions(seq, cp, rank, split)
        with pytest.raises(ValueError, match=f"^{sentence}$"):
            take_local(x, seq, cp, rank, split)
    with pytest.raises(ValueError, match=f"^{sentence}$"):  # the work counts and the one-process ring too
        work_per_rank(seq, cp, split, True)
    with pytest.raises(ValueError, match=f"^{sentence}$"):
        one_process_ring(x, x, x, cp, split)


def test_take_local_refuses_a_tensor_that_is_not_the_whole_sequence():
    # seq says where the chunk boundaries are; x of another length would be cut at the wrong places (a shorter
    # x raises an index error, a longer one silently loses its tail).
    x = torch.zeros(1, 2, 12, 4)  # [b, h, 12, d]
    with pytest.raises(ValueError, match=r"x of shape \(1, 2, 12, 4\) does not hold seq=8 tokens along dim 2"):
        take_local(x, 8, 2, 0, "zigzag")
    assert take_local(x, 12, 2, 0, "contiguous").shape == (1, 2, 6, 4)


@pytest.mark.parametrize("split", ["contiguous", "zigzag"])
def test_each_classic_mistake_is_off_by_order_one(split):
    # The ranks' rule and merge in one process, with each mistake injected: the right ring meets the float64
    # tolerance, every mistake misses it by more than 1e-2 (so the rank tests' tolerance cannot let one through).
    q, k, v, _ = make_inputs(1, 2, 32, 16, seed=3)
    truth, truth_lse = attention_reference(q, k, v, causal=True)
    out, lse = one_process_ring(q, k, v, 4, split)
    assert relative_error(out, truth) < 1e-13 and relative_error(lse, truth_lse) < 1e-13
    assert set(MISTAKES) == {"merge without the rescale", "mask left off the diagonal", "K/V sent to the wrong neighbour"}
    for name, mistake in MISTAKES.items():
        wrong, _ = one_process_ring(q, k, v, 4, split, **mistake)
        assert relative_error(wrong, truth) > 1e-2, name


def test_a_wrong_way_ring_only_matters_under_a_mask():
    # without a mask every rank still meets every chunk once, and the merge is order-free
    q, k, v, _ = make_inputs(1, 2, 32, 16, seed=4)
    truth, _ = attention_reference(q, k, v, causal=False)
    out, _ = one_process_ring(q, k, v, 4, "contiguous", causal=False, **MISTAKES["K/V sent to the wrong neighbour"])
    assert relative_error(out, truth) < 1e-13


def test_memory_vs_communication_by_hand():
    from course_utils import ch14 as cpx

    # seq 1024 at cp 4, 4 query heads and 2 KV heads of 8, bf16: 256 tokens per rank
    m = cpx.memory_vs_communication(1024, 4, heads=4, kv_heads=2, head_dim=8)
    chunk = 256 * 2 * 8 * 2  # one of K or V: tokens x kv_heads x head_dim x 2 bytes
    assert m["kv_held_bytes"] == 2 * chunk and m["kv_sent_bytes"] == 6 * chunk and m["kv_chunks_sent"] == 6
    assert m["step_flops"] == 4 * 256 * 256 * 4 * 8  # QK^T and PV over the *query* heads
    assert m["flops_per_byte"] == m["step_flops"] / (2 * chunk)
    assert cpx.memory_vs_communication(1024, 1, 4, 2, 8)["flops_per_byte"] is None  # nothing is sent at cp 1
    # hiding: t >= F kv_heads b / (2 heads B); F/B = 1000 -> 1000 * 2 * 2 / 8 = 500 tokens, causal twice that
    assert cpx.min_tokens_to_hide(4, 2, 8, 1e12, 1e9) == pytest.approx(500)
    assert cpx.min_tokens_to_hide(4, 2, 8, 1e12, 1e9, causal=True) == pytest.approx(1000)
    # seq 8192: cp 8 leaves 1024 tokens >= 1000, cp 16 leaves 512 < 1000
    assert cpx.largest_hidden_cp(8192, 4, 2, 8, 1e12, 1e9, causal=True) == 8


def test_a_rank_outside_the_ring_is_refused():
    # zigzag "rank 2" of cp=2 would get chunks 2 and 1: rank 1's chunks, held twice and merged twice
    with pytest.raises(ValueError, match=r"rank=2 is not a position in a ring of cp=2 ranks: choose 0 <= rank < 2"):
        chunk_ranges(8, 2, 2, "zigzag")
