"""Chapter 14 on real ranks (gloo, CPU): ring attention is full attention, forward and backward; the ranks
do the work the block rule says; and each sends 2*(cp-1) K/V chunks in forward.

Ground truth: ``workers/attention/reference.attention_reference_grads`` in float64 on the whole sequence.
The ranks run in float64 too (every block is the float64 reference, merged in float64), so the bound is the
reference's own float64 tolerance, ``RELATIVE_TOLERANCE[float64]`` = 1e-10 (measured ~1e-15): a dropped
rescale in the merge, a wrong mask or a wrong-way ring is off by 1e-2 or more (``test_ch14_split.py``
injects each into the one-process ring). One world of 4 warm ranks;
cp = 1 and 2 run as 4 and 2 identical rings inside it (every copy is checked).
"""
import pytest
import torch

import course_utils as cu
from course_utils import ch14 as cpu
from course_utils.results import InvalidParameter
from workers.attention.reference import RELATIVE_TOLERANCE
from workers.context_parallel.attention import ring_attention_backward, ring_attention_forward
from workers.context_parallel.blocks import block_kind, work_per_rank
from workers.context_parallel.ring import Exchange, Ring
from workers.context_parallel.split import chunk_ids, num_chunks

WORKER, WORLD, LIMITS = "workers.ch14_ring_attention", 4, {"timeout": 60}
pytestmark = pytest.mark.ranks
TOL = RELATIVE_TOLERANCE[torch.float64]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("split", ["contiguous", "zigzag"])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_ring_attention_equals_full_attention(cp, split, causal):
    seed = 100 + 10 * cp + 2 * (split == "zigzag") + causal  # fresh random inputs for every case
    res = cu.run(WORKER, world_size=WORLD, cp=cp, split=split, causal=causal, seq=32, seed=seed, **LIMITS)
    c = cpu.compare_to_reference(res)
    # The online-softmax merge is exact: out and lse over the union of key chunks are those of full attention,
    # and the ring backward (P rebuilt from the final lse, dK/dV carried home) gives the same gradients.
    assert set(c["errors"]) == {"out", "lse", "dq", "dk", "dv"}
    assert c["within_tol"] and c["max_error"] < TOL, c
    # the rows really are split: each rank returned seq/cp of them
    assert {d["out"].shape[-2] for d in res.ranks} == {32 // cp}


def test_float32_inputs_meet_the_float32_tolerance():
    res = cu.run(WORKER, world_size=WORLD, cp=4, dtype="float32", seed=7, **LIMITS)
    c = cpu.compare_to_reference(res)
    assert c["tolerance"] == RELATIVE_TOLERANCE[torch.float32] and c["within_tol"], c


@pytest.mark.parametrize("split", ["contiguous", "zigzag"])
def test_ranks_compute_the_blocks_the_rule_allows(split):
    res = cu.run(WORKER, world_size=WORLD, cp=4, split=split, causal=True, seq=64, backward=False, **LIMITS)
    measured = [d["score_entries"] for d in cpu.ring_ranks(res)]
    # what the ranks counted in their loops is what the block rule predicts ...
    assert measured == [w["score_entries"] for w in work_per_rank(64, 4, split, True)]
    if split == "contiguous":  # ... rank cp-1 does cp times rank 0's work,
        assert measured[-1] == 4 * measured[0] and measured == sorted(measured)
    else:  # ... while zigzag gives every rank the same
        assert len(set(measured)) == 1
    # and no rank meets a (q, k) chunk pair twice, nor misses one: every rank met each of its query chunks
    # against every chunk's K/V, and computed exactly the blocks the rule leaves visible, as the rule says
    n = num_chunks(4, split)
    for d in cpu.ring_ranks(res):
        own = chunk_ids(4, d["ring_index"], split)
        met = [(qc, kc) for _, qc, kc, _ in d["blocks"]]
        assert len(set(met)) == len(met) and set(met) == {(qc, kc) for qc in own for kc in range(n)}
        assert all(kind == block_kind(qc, kc) for _, qc, kc, kind in d["blocks"])


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_each_rank_sends_two_kv_chunks_per_ring_step(cp):
    res = cu.run(WORKER, world_size=WORLD, cp=cp, seq=32, **LIMITS)
    for d in res.ranks:
        chunk = d["kv_chunk_bytes"]  # one of K or V: [b, h, seq/cp, d] float64
        assert chunk == 1 * 2 * (32 // cp) * 16 * 8
        # forward: K and V passed on at each of the cp-1 steps (the last chunk is used, not forwarded)
        assert d["sent_bytes"]["forward"] == 2 * (cp - 1) * chunk
        # backward: K/V again for cp-1 steps, plus a dK/dV accumulator at each of the cp steps (the last hop home)
        assert d["sent_bytes"]["backward"] == (2 * (cp - 1) + 2 * cp * (cp > 1)) * chunk


# Refused in the words of the course's one rule set (workers/layout/rules.py: problem), every offending value named.
@pytest.mark.parametrize("params, fragment", [
    ({"seq": 36, "split": "zigzag"}, r"cp=4 cuts seq=36 into 8 chunks \(zigzag\)"),  # zigzag at cp 4: 2*4 chunks
    ({"seq": 30, "split": "contiguous"}, r"cp=4 cuts seq=30 into 4 chunks \(contiguous\)"),
    ({"cp": 3}, "cp=3 does not divide the 4 ranks: choose 1, 2 or 4"),
    ({"cp": -1}, r"cp=-1 must be at least 0 \(0: the whole world\)"),
    ({"split": "striped"}, "split='striped' is not one of 'contiguous' or 'zigzag'"),
    ({"heads": 0, "dtype": "int8"}, "heads=0 must be at least 1; dtype='int8' is not one of 'float64' or 'float32'"),
])
def test_invalid_input_is_refused_before_launching(params, fragment):
    with pytest.raises(InvalidParameter, match=fragment):
        cu.run(WORKER, world_size=WORLD, **params, **LIMITS)


# -- local lengths are checked before the first send (no ranks needed: the ring's links are recorded) ----------

class LoopbackRing(Ring):
    """Ring position 0 of 2 whose exchanges never reach a network: each is recorded, and "receives" what it sent."""

    def __init__(self):
        super().__init__(0, [0, 1], torch.device("cpu"), torch.device("cpu"))
        self.posted = []

    def exchange(self, tensor, phase, tag=0):
        self.posted.append((phase, tuple(tensor.shape)))
        return Exchange([], tensor, tensor.detach().clone(), self.device)


def _rows(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, n, 4, generator=gen, dtype=torch.float64)  # [b, h, rows, d]


def test_zigzag_ring_refuses_an_odd_local_length_before_sending():
    # A zigzag rank holds two equal chunks; 3 rows would be cut 2 + 1 by chunk(2) and the ring would start
    # passing K/V of the wrong chunk sizes. The check must fire before the first exchange is posted.
    q = _rows(3)
    ring = LoopbackRing()
    with pytest.raises(ValueError, match=r"this rank holds 3 rows, which do not cut into the 2 equal chunks of the "
                                         r"zigzag split: take them with take_local from a seq divisible by 4"):
        ring_attention_forward(q, q, q, ring, "zigzag", causal=True)
    lse = torch.zeros(1, 2, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="this rank holds 3 rows"):
        ring_attention_backward(q, q, q, q, lse, q, ring, "zigzag", causal=True)
    assert ring.posted == []  # nothing went on the wire


def test_ring_refuses_q_k_v_of_different_lengths_before_sending():
    ring = LoopbackRing()
    with pytest.raises(ValueError, match=r"this rank's tensors hold different numbers of rows \({'q': 4, 'k': 6, "
                                         r"'v': 4}\)"):
        ring_attention_forward(_rows(4), _rows(6), _rows(4), ring, "zigzag", causal=True)
    q = _rows(4)
    with pytest.raises(ValueError, match=r"different numbers of rows \(.*'lse': 2}\)"):
        ring_attention_backward(q, q, q, q, torch.zeros(1, 2, 2, dtype=torch.float64), q, ring, "zigzag", causal=True)
    assert ring.posted == []
    ring_attention_forward(q, q, q, ring, "zigzag", causal=True)  # 4 rows: two chunks of 2, accepted
    assert ring.posted == [("forward", (2, 1, 2, 4, 4))]  # K and V, one message, at the one step before the last
