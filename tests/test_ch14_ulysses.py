"""Chapter 14 on real ranks (gloo, CPU), the second way to split a sequence: DeepSpeed-Ulysses is full attention,
forward and backward, with multi-head and grouped-query heads; so is Ulysses x ring (USP); each rank sends the bytes
the formulas of ``workers/context_parallel/ulysses.py`` say; and a layout that cannot give every rank whole heads is
refused before any rank starts.

Start here: ``workers/ch14_ulysses.py`` is the worker, ``context_parallel.reference.compare_to_reference`` the ground
truth (float64 attention over the whole sequence in one process, KV heads expanded inside autograd so dk and dv are
summed over the query heads that read them). The ranks run in float64, so the bound is the reference's own float64
tolerance, ``RELATIVE_TOLERANCE[float64]`` = 1e-10 (measured: 0 for Ulysses alone, whose local attention is the
reference's own arithmetic on whole heads; ~1e-15 with the ring, whose merge reorders the sums). A misrouted
all-to-all piece, a KV head copied with ``repeat`` instead of ``repeat_interleave`` or a backward that is not the
reverse all-to-all gives rows of other heads or positions: errors of order 1. One world of 4 warm ranks; cp = 1
and 2 run as 4 and 2 identical copies inside it (every copy is checked).
"""
import pytest
import torch

import course_utils as cu
from course_utils.results import InvalidParameter
from workers.attention.reference import RELATIVE_TOLERANCE
from workers.context_parallel.reference import compare_to_reference
from workers.context_parallel.ulysses import Ulysses, ring_bytes, ulysses_attention, usp_bytes, usp_positions

WORKER, WORLD, LIMITS = "workers.ch14_ulysses", 4, {"timeout": 60}
SHAPE = {"seq": 32, "heads": 8, "head_dim": 16}  # batch 1, float64: one head's rows on one rank = 32/cp x 16 x 8 bytes
TOL = RELATIVE_TOLERANCE[torch.float64]
pytestmark = pytest.mark.ranks


def _run(**params):
    return cu.run(WORKER, world_size=WORLD, **{**SHAPE, **params}, **LIMITS)


def _equals_full_attention(res, cp):
    c = compare_to_reference(res.ranks)
    assert set(c["errors"]) == {"out", "dq", "dk", "dv"}  # the backward ran, through both all-to-alls
    assert c["within_tol"] and c["tolerance"] == TOL, c
    assert c["copies"] == WORLD // cp  # every copy side by side was assembled and checked
    assert {d["out"].shape[-2] for d in res.ranks} == {SHAPE["seq"] // cp}  # each rank really held seq/cp rows


# kv_heads 8: multi-head; 4: split over cp (4 % cp == 0); 2: split at cp 2, repeated at cp 4 (each KV head on 2 ranks)
@pytest.mark.parametrize("kv_heads", [8, 4, 2])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_ulysses_equals_full_attention(cp, causal, kv_heads):
    seed = 200 + 10 * cp + 2 * kv_heads + causal  # fresh random inputs for every case
    _equals_full_attention(_run(cp=cp, causal=causal, kv_heads=kv_heads, seed=seed), cp)


def test_one_kv_head_is_repeated_on_every_rank():
    # multi-query attention at cp 4: the one KV head travels to all four ranks, and its gradient is the sum of
    # the four copies' (repeat_interleave's backward)
    _equals_full_attention(_run(cp=4, kv_heads=1, seed=5), 4)


def test_float32_inputs_meet_the_float32_tolerance():
    res = _run(cp=4, kv_heads=2, dtype="float32", seed=7)
    c = compare_to_reference(res.ranks)
    assert c["tolerance"] == RELATIVE_TOLERANCE[torch.float32] and c["within_tol"], c


# USP: cp 4 = 2 Ulysses ranks (consecutive) x a ring of 2; the ring's split decides which chunks a ring position holds
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("split", ["contiguous", "zigzag"])
def test_ulysses_times_ring_equals_full_attention(split, causal):
    res = _run(cp=4, ring=2, split=split, causal=causal, seed=300 + 2 * (split == "zigzag") + causal)
    _equals_full_attention(res, 4)
    for d in res.ranks:  # both halves talked: two all-to-alls' worth and one ring's worth of traffic
        assert d["ulysses_sent_bytes"]["forward"] > 0 and d["ring_sent_bytes"]["forward"] > 0


@pytest.mark.parametrize("kv_heads", [2, 1])  # 2: one KV head per Ulysses rank; 1: repeated on both
def test_ulysses_times_ring_with_grouped_query_heads(kv_heads):
    _equals_full_attention(_run(cp=4, ring=2, split="zigzag", kv_heads=kv_heads, seed=310 + kv_heads), 4)


# -- bytes ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cp, ring, kv_heads, forward", [
    # Ulysses: (cp-1)/cp of q, k, v and out leave each rank; one head's rows on one rank is H = 32/cp x 16 x 8 bytes
    (2, 1, 8, 1 * (8 + 8 + 8 + 8) * 2048 // 2),  # H = 2048: 32 heads' rows, half of them sent
    (4, 1, 8, 3 * (8 + 8 + 8 + 8) * 1024 // 4),  # H = 1024: 3/4 of 32 heads' rows
    (4, 1, 4, 3 * (8 + 4 + 4 + 8) * 1024 // 4),  # 4 KV heads split: one per rank
    (4, 1, 2, 3 * (8 + 4 + 4 + 8) * 1024 // 4),  # 2 KV heads repeated to 4: the same bytes as 4 KV heads
    # USP 2 x 2: the all-to-alls move half of the 32 heads' rows (H = 1024), then the ring passes one chunk of K and V
    # of 4 heads x 16 rows (4 x 16 x 16 x 8 = 8192 bytes each) once
    (4, 2, 8, 1 * (8 + 8 + 8 + 8) * 1024 // 2 + 2 * 8192),
    (4, 4, 8, 2 * 3 * 8 * 8 * 16 * 8),  # the ring alone: 2 (cp-1) chunks of 8 heads x 8 rows
])
def test_each_rank_sends_the_bytes_of_the_formula(cp, ring, kv_heads, forward):
    res = _run(cp=cp, ring=ring, kv_heads=kv_heads, seed=1)
    formula = usp_bytes(1, 8, kv_heads, 32, 16, cp // ring, ring, 8)
    assert formula["forward"] == forward  # the formula, against the arithmetic written out above
    for d in res.ranks:
        assert d["sent_bytes"] == formula == d["formula_bytes"]  # what every rank counted on the wire
        if cp > ring:  # q, stacked k and v, out in forward; dout, dq, stacked dk and dv in backward
            assert d["messages"]["all_to_all"] == {"forward": 3, "backward": 3}
    if ring == 1:  # Ulysses' backward moves the gradients of the same tensors: the same bytes
        assert formula["backward"] == formula["forward"]


def test_the_ring_formula_is_what_the_ring_worker_sends():
    # ``ring_bytes`` (which the Ulysses worker reports as what the ring alone would send) counted against the
    # chapter's ring worker at the same shape: forward 2 (cp-1) chunks, backward 2 (cp-1) + 2 cp
    res = cu.run("workers.ch14_ring_attention", world_size=WORLD, cp=4, seq=32, heads=8, head_dim=16, **LIMITS)
    expected = ring_bytes(1, 8, 32, 16, 4, 8)
    assert all(d["sent_bytes"] == expected for d in res.ranks)
    ulysses = _run(cp=4, seed=1)
    assert all(d["ring_alone_bytes"] == expected for d in ulysses.ranks)
    # at cp 4 with as many KV heads as heads, Ulysses sends 4 (cp-1)/cp = 3 chunks where the ring sends 2 (cp-1) = 6
    assert ulysses[0]["sent_bytes"]["forward"] * 2 == expected["forward"]


# -- refusals, before any rank starts --------------------------------------------------------------------------

@pytest.mark.parametrize("params, fragment", [
    ({"heads": 6, "cp": 4}, r"^cp=4 does not divide heads=6 \(Ulysses gives each rank whole heads\): choose cp 1 or 2, "
                            r"or heads a multiple of 4$"),
    ({"heads": 6, "cp": 4, "ring": 1}, r"cp=4 does not divide heads=6"),
    ({"heads": 12, "kv_heads": 3, "cp": 4}, r"^cp=4 and kv_heads=3 do not divide one another \(each rank holds whole "
                                            r"KV heads, or a copy of one\): choose kv_heads 1, 2, 4 or 12$"),
    ({"heads": 6, "cp": 4, "ring": 2, "kv_heads": 3},
     r"^cp / ring = 4 / 2 = 2 and kv_heads=3 do not divide one another"),
    ({"heads": 8, "kv_heads": 3}, r"^kv_heads=3 does not divide heads=8: choose 1, 2, 4 or 8$"),
    ({"ring": 3}, r"^ring=3 does not divide cp=4: choose 1, 2 or 4$"),
    ({"cp": 3}, r"^cp=3 does not divide the 4 ranks: choose 1, 2 or 4$"),
    ({"cp": -1}, r"^cp=-1 must be at least 0 \(0: the whole world\)$"),
    ({"seq": 30}, r"^cp=4 cuts seq=30 into 4 chunks \(contiguous\), which does not divide it: choose seq divisible by 4$"),
    ({"seq": 36, "ring": 4}, r"^ring=4 cuts seq=36 into 8 chunks \(zigzag\), which does not divide it"),
    ({"seq": 34, "ring": 2}, r"^cp=4 as 2 Ulysses ranks x ring=2 \(zigzag\) cuts seq=34 into unequal pieces: choose "
                             r"seq divisible by 4$"),
    ({"split": "striped", "dtype": "int8"}, r"^split='striped' is not one of 'contiguous' or 'zigzag'; "
                                            r"dtype='int8' is not one of 'float64' or 'float32'$"),
])
def test_invalid_input_is_refused_before_launching(params, fragment):
    with pytest.raises(InvalidParameter, match=fragment):
        cu.run(WORKER, world_size=WORLD, **params, **LIMITS)


def test_what_refuses_lets_the_values_it_names_run():
    # the refusal's suggestions are layouts that run: heads 6 over cp 2 (3 heads and 1 KV head a rank), and 2 x 2 USP
    _equals_full_attention(_run(cp=2, heads=6, kv_heads=2, seed=11), 2)
    _equals_full_attention(_run(cp=4, ring=2, heads=6, kv_heads=2, seed=12), 4)


# -- no ranks: the token layout, and heads checked before anything is sent ------------------------------------

@pytest.mark.parametrize("ulysses, ring, split", [(4, 1, "zigzag"), (2, 2, "zigzag"), (2, 2, "contiguous"),
                                                  (1, 4, "zigzag"), (3, 2, "zigzag")])
def test_every_token_is_held_once_and_a_ulysses_group_gathers_its_ring_rows(ulysses, ring, split):
    from workers.context_parallel.split import local_positions

    seq, cp = 24, ulysses * ring
    held = [usp_positions(seq, ulysses, ring, i, split) for i in range(cp)]
    assert sorted(torch.cat(held).tolist()) == list(range(seq))  # no gap, no overlap
    for position in range(ring):  # the all-to-all concatenates a group's pieces in member order
        gathered = torch.cat(held[position * ulysses:(position + 1) * ulysses])
        assert torch.equal(gathered, local_positions(seq, ring, position, split))


class RecordingUlysses(Ulysses):
    """Place 0 of a Ulysses group of 4 that records its all-to-alls and never reaches a network."""

    def __init__(self):
        super().__init__(0, [0, 1, 2, 3], None, torch.device("cpu"), torch.device("cpu"))
        self.posted = []

    def all_to_all(self, pieces, phase):
        self.posted.append((phase, tuple(pieces.shape)))
        return pieces


def test_heads_that_do_not_split_are_refused_before_sending():
    x = torch.zeros(1, 6, 4, 2, dtype=torch.float64)  # [b, 6 heads, rows, d]
    ulysses = RecordingUlysses()
    with pytest.raises(ValueError, match=r"q of shape \(1, 6, 4, 2\) is not \[b, heads, rows, d\] with heads divisible "
                                         r"by cp=4"):
        ulysses_attention(x, x, x, ulysses)
    kv = torch.zeros(1, 3, 4, 2, dtype=torch.float64)  # 3 KV heads for 12 query heads: neither divides cp=4
    with pytest.raises(ValueError, match=r"cp=4 and kv_heads=3 do not divide one another"):
        ulysses_attention(torch.zeros(1, 12, 4, 2, dtype=torch.float64), kv, kv, ulysses)
    assert ulysses.posted == []  # nothing went on the wire
