"""DeepSpeed-Ulysses: context parallelism by all-to-all, and its 2D combination with the ring (USP).

Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme Long Sequence
Transformer Models" (arXiv:2309.14509): each of the cp ranks holds seq/cp positions of every head. One all-to-all
of q, k and v turns that into every position of heads/cp heads (it gathers the sequence and scatters the heads);
attention then runs locally, since a head's attention needs no other head; a second all-to-all turns the output
back into seq/cp positions of every head. The ring (``attention.py``) moves keys to the queries; Ulysses moves the
heads apart, so nothing is merged and the local attention is any attention at all.

Bytes each rank sends, per forward and per backward (element size e; ``ring_bytes``, ``ulysses_bytes``)::

    ring      forward   2 (cp-1) C             each rank passes on cp-1 K/V chunks it received, C = b (seq/cp) kv_heads d e
              backward  (2 (cp-1) + 2 cp) C    K/V again, and a dK/dV accumulator at each of the cp steps
    Ulysses   forward   (cp-1)/cp (|q| + |k| + |v| + |out|)    each all-to-all keeps 1/cp of its tensor at home
              backward  (cp-1)/cp (|dout| + |dq| + |dk| + |dv|)   the same tensors' gradients, the other way

with |q| = |out| = b (seq/cp) heads d e and |k| = |v| = b (seq/cp) kv' d e, kv' the KV heads that travel (below).
With as many KV heads as query heads, the ring sends 2 (cp-1) C and Ulysses 4 (cp-1)/cp C in forward: the ring's
traffic per rank grows with cp, Ulysses' stays under 4 C (the paper's point: with seq and cp grown together, the
bytes per link stay constant). The ring has an advantage the table does not show: it overlaps its sends with
compute, while Ulysses waits for each all-to-all. And Ulysses' degree is bounded by the heads (each rank holds
whole heads), the ring's only by the sequence.

The all-to-alls are a conjugate pair, as Megatron's ``all_to_all_sp2hp`` / ``all_to_all_hp2sp``
(``megatron/core/tensor_parallel/mappings.py``) and DeepSpeed's ``_SeqAllToAll``: the backward of sequence-to-heads
is heads-to-sequence and the other way round, so autograd runs the real reverse all-to-all in backward.

USP (Fang and Zhao 2024, "USP: A Unified Sequence Parallelism Approach for Long Context Generative AI",
arXiv:2405.07719): cp = ulysses x ring. The ranks of a Ulysses group are consecutive (the heavier all-to-all on the
closer links); each Ulysses group is one position of the ring, and its all-to-all gathers that position's rows, on
which the ring runs over heads/ulysses heads.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from workers.attention.reference import attention_reference
from workers.context_parallel.attention import ring_attention
from workers.context_parallel.split import local_positions


class Ulysses:
    """Place ``index`` in the Ulysses group of global ranks ``members`` (process group ``group``), bytes counted."""

    def __init__(self, index: int, members: list[int], group, device: torch.device, comm_device: torch.device):
        self.index, self.members, self.cp, self.group = index, list(members), len(members), group
        self.device, self.comm_device = device, comm_device  # gloo has no CUDA all-to-all: through the host there
        self.sent_bytes = {"forward": 0, "backward": 0}
        self.messages = {"forward": 0, "backward": 0}
        self.wait_s = 0.0  # seconds inside the all-to-alls, the slowest rank's lateness included: nothing overlaps them

    def all_to_all(self, pieces: torch.Tensor, phase: str) -> torch.Tensor:
        """``pieces`` ``[cp, ...]``: piece j goes to member j; returns ``[cp, ...]`` whose piece i came from member i."""
        if self.cp == 1:
            return pieces  # one rank: everything stays
        send = pieces.detach().to(self.comm_device).contiguous()
        recv = torch.empty_like(send)
        start = time.perf_counter()
        dist.all_to_all_single(recv, send, group=self.group)
        self.wait_s += time.perf_counter() - start
        # piece ``index`` stays home: (cp-1)/cp of the tensor leaves, exactly (pieces are equal)
        self.sent_bytes[phase] += (self.cp - 1) * send.numel() // self.cp * send.element_size()
        self.messages[phase] += 1
        return recv.to(self.device)


def _check_heads(x: torch.Tensor, cp: int, what: str) -> None:
    if x.dim() != 4 or x.shape[1] % cp:
        raise ValueError(f"{what} of shape {tuple(x.shape)} is not [b, heads, rows, d] with heads divisible by "
                         f"cp={cp}: Ulysses gives each rank whole heads")


def _seq_to_heads(x: torch.Tensor, ulysses: Ulysses, phase: str) -> torch.Tensor:
    """``[b, h, s/cp, d]`` -> ``[b, h/cp, s, d]``: scatter the heads, gather the sequence."""
    cp = ulysses.cp
    b, h, rows, d = x.shape
    pieces = x.reshape(b, cp, h // cp, rows, d).transpose(0, 1)  # [cp, b, h/cp, s/cp, d]: piece j = rank j's heads
    got = ulysses.all_to_all(pieces, phase)  # [cp, b, h/cp, s/cp, d]: piece i = rank i's rows of my heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * rows, d)  # [b, h/cp, s, d], rank i's rows i-th


def _heads_to_seq(x: torch.Tensor, ulysses: Ulysses, phase: str) -> torch.Tensor:
    """``[b, h/cp, s, d]`` -> ``[b, h, s/cp, d]``: scatter the sequence, gather the heads."""
    cp = ulysses.cp
    b, local_heads, seq, d = x.shape
    pieces = x.reshape(b, local_heads, cp, seq // cp, d).permute(2, 0, 1, 3, 4)  # [cp, b, h/cp, s/cp, d]: rank j's rows
    got = ulysses.all_to_all(pieces, phase)  # [cp, b, h/cp, s/cp, d]: piece i = rank i's heads of my rows
    return got.transpose(0, 1).reshape(b, cp * local_heads, seq // cp, d)  # [b, h, s/cp, d], heads in rank order


class _AllToAllSeqToHeads(torch.autograd.Function):
    """Forward: sequence-to-heads. Backward: heads-to-sequence of the gradient (its transpose)."""

    @staticmethod
    def forward(ctx, x, ulysses):
        ctx.ulysses = ulysses
        return _seq_to_heads(x, ulysses, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad.contiguous(), ctx.ulysses, "backward"), None


class _AllToAllHeadsToSeq(torch.autograd.Function):
    """Forward: heads-to-sequence. Backward: sequence-to-heads of the gradient."""

    @staticmethod
    def forward(ctx, x, ulysses):
        ctx.ulysses = ulysses
        return _heads_to_seq(x, ulysses, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad.contiguous(), ctx.ulysses, "backward"), None


def all_to_all_seq_to_heads(x: torch.Tensor, ulysses: Ulysses) -> torch.Tensor:
    """``[b, h, s/cp, d]`` -> ``[b, h/cp, s, d]``, differentiable (Megatron's ``all_to_all_sp2hp``)."""
    _check_heads(x, ulysses.cp, "x")
    return _AllToAllSeqToHeads.apply(x, ulysses)


def all_to_all_heads_to_seq(x: torch.Tensor, ulysses: Ulysses) -> torch.Tensor:
    """``[b, h/cp, s, d]`` -> ``[b, h, s/cp, d]``, differentiable (Megatron's ``all_to_all_hp2sp``)."""
    if x.dim() != 4 or x.shape[2] % ulysses.cp:
        raise ValueError(f"x of shape {tuple(x.shape)} is not [b, heads, seq, d] with seq divisible by cp={ulysses.cp}")
    return _AllToAllHeadsToSeq.apply(x, ulysses)


def kv_heads_sent(kv_heads: int, cp: int) -> int:
    """How many K (and V) heads each rank's all-to-all carries: ``kv_heads``, or ``cp`` when they are repeated.

    A KV head cannot be cut (its d columns are one head), and every query head must find its KV head on its own
    rank after the all-to-all. When cp divides kv_heads, the KV heads are split like the query heads: rank j gets
    KV heads [j kv/cp, (j+1) kv/cp), exactly the ones its query heads [j h/cp, (j+1) h/cp) read (the query heads
    of one KV head are consecutive). When cp is a multiple of kv_heads there are fewer KV heads than ranks, so each
    is repeated cp/kv_heads times in place (``repeat_interleave``, not ``repeat``: copies side by side) and the
    cp/kv_heads consecutive ranks whose query heads read it get one copy each; autograd sums the copies' gradients
    into the one head. The price is in the bytes: cp heads of K and V travel instead of kv_heads. (The same answer
    as tensor parallelism's, chapter 05, where the KV heads are copied onto tp/kv_heads ranks.)
    """
    if kv_heads % cp == 0:
        return kv_heads
    if cp % kv_heads == 0:
        return cp
    raise ValueError(f"cp={cp} and kv_heads={kv_heads} do not divide one another: each rank must hold whole KV heads, "
                     f"or each KV head be repeated on cp / kv_heads ranks")


def _kv_for_all_to_all(t: torch.Tensor, cp: int) -> torch.Tensor:
    """``[b, kv_heads, s/cp, d]`` -> ``[b, kv_heads_sent, s/cp, d]`` (see ``kv_heads_sent``)."""
    copies = kv_heads_sent(t.shape[1], cp) // t.shape[1]
    return t if copies == 1 else t.repeat_interleave(copies, dim=1)  # [b, cp, s/cp, d]: copies side by side


def local_attention(q, k, v, causal: bool) -> torch.Tensor:
    """Attention of ``q [b, h, s, d]`` over ``k, v [b, kv, s, d]`` in float64 (kv divides h), out in q's dtype.

    The reference's arithmetic (it writes the s x s scores of each local head): any attention fits here, and a GPU
    run would call a FlashAttention kernel (chapter 07) on the same tensors.
    """
    group = q.shape[1] // k.shape[1]  # query heads per KV head, the same on every rank
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [b, h, s, d]
    out, _ = attention_reference(q, k, v, causal=causal)  # [b, h, s, d] float64
    return out.to(q.dtype)


def ulysses_attention(q, k, v, ulysses: Ulysses, causal: bool = True, ring=None, split: str = "contiguous"):
    """Differentiable attention of this rank's ``q [b, h, s/cp, d]`` and ``k, v [b, kv, s/cp, d]`` -> ``[b, h, s/cp, d]``.

    The rows of the cp ranks, in member order, must make the whole sequence in order (``usp_positions``): the
    all-to-all concatenates them, and the local causal mask is the plain triangle. With ``ring`` (a ``Ring`` over
    the other Ulysses groups of the same cp group), the rows gathered are that ring position's and attention is
    ring attention over them (USP); ``split`` is then the ring's.
    """
    rows = {name: t.shape[-2] for name, t in (("q", q), ("k", k), ("v", v))}
    if len(set(rows.values())) > 1 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[1] % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} are not this rank's rows of "
                         "q [b, heads, rows, d] and k, v [b, kv_heads, rows, d] with kv_heads dividing heads")
    _check_heads(q, ulysses.cp, "q")
    kv_heads_sent(k.shape[1], ulysses.cp)  # refuses KV heads that cannot be placed, before anything is sent
    b = q.shape[0]
    q_heads = all_to_all_seq_to_heads(q, ulysses)  # [b, h/cp, s, d]
    kv = torch.stack([_kv_for_all_to_all(k, ulysses.cp), _kv_for_all_to_all(v, ulysses.cp)])  # [2, b, kv', s/cp, d]
    kv_heads = all_to_all_seq_to_heads(kv.flatten(0, 1), ulysses).unflatten(0, (2, b))  # one message: [2, b, kv'/cp, s, d]
    if ring is None:
        out = local_attention(q_heads, kv_heads[0], kv_heads[1], causal)  # [b, h/cp, s, d]
    else:
        # The ring's blocks want one KV head per query head: expanded here, after the all-to-all (so Ulysses
        # carries kv' heads), which makes the ring carry h/ulysses heads of K and V (a GQA-aware ring would not).
        group = q_heads.shape[1] // kv_heads.shape[2]
        k_ring, v_ring = (t.repeat_interleave(group, dim=1) for t in kv_heads.unbind(0))  # [b, h/u, s/ring, d]
        out = ring_attention(q_heads, k_ring, v_ring, ring, split, causal)  # [b, h/u, s/ring, d]
    return all_to_all_heads_to_seq(out, ulysses)  # [b, h, s/cp, d]


def usp_positions(seq: int, ulysses: int, ring: int, index: int, split: str) -> torch.Tensor:
    """Global token index of each local row ``[seq/cp]`` of place ``index`` in a cp = ulysses x ring group.

    Place ``index`` is Ulysses rank ``index % ulysses`` of ring position ``index // ulysses``. The ring's split
    (``split.py``) gives that ring position its rows, in the ring's local order; Ulysses cuts them into ``ulysses``
    contiguous pieces, so the all-to-all, which concatenates the pieces in member order, gathers exactly the ring's
    rows. With ring = 1 the one position holds the whole sequence and the pieces are contiguous chunks: Ulysses needs
    no balancing split, as every rank attends over every position of its heads (equal causal work on every rank).
    """
    place, position = index % ulysses, index // ulysses
    rows = local_positions(seq, ring, position, split)  # [seq/ring] in the ring's order
    if len(rows) % ulysses:
        raise ValueError(f"the {len(rows)} tokens of each ring position do not cut into ulysses={ulysses} equal pieces: "
                         f"choose seq divisible by {ring * ulysses}")
    size = len(rows) // ulysses
    return rows[place * size:(place + 1) * size]


# -- bytes each rank sends (the formulas of the module docstring) ------------------------------------------------

def ring_bytes(batch: int, kv_heads: int, seq: int, head_dim: int, cp: int, element_size: int) -> dict:
    """``{"forward", "backward"}`` bytes one ring rank sends: K/V chunks ``[b, kv_heads, seq/cp, d]``."""
    chunk = batch * kv_heads * (seq // cp) * head_dim * element_size  # one of K or V on one rank
    return {"forward": 2 * (cp - 1) * chunk, "backward": (2 * (cp - 1) + 2 * cp * (cp > 1)) * chunk}


def ulysses_bytes(batch: int, heads: int, kv_heads: int, seq: int, head_dim: int, cp: int, element_size: int) -> dict:
    """``{"forward", "backward"}`` bytes one Ulysses rank sends: (cp-1)/cp of q, k, v and out (of their gradients)."""
    head_rows = batch * (seq // cp) * head_dim * element_size  # one head's rows on one rank
    moved = (heads + 2 * kv_heads_sent(kv_heads, cp) + heads) * head_rows  # q, k, v, out (dout, dq, dk, dv)
    return {"forward": (cp - 1) * moved // cp, "backward": (cp - 1) * moved // cp}


def usp_bytes(batch: int, heads: int, kv_heads: int, seq: int, head_dim: int, ulysses: int, ring: int,
              element_size: int) -> dict:
    """Bytes one rank of a ulysses x ring group sends: its Ulysses all-to-alls over rows seq/cp, then the ring over
    rows seq/ring of heads/ulysses heads (K/V expanded to the query heads, ``ulysses_attention``)."""
    cp = ulysses * ring
    a2a = ulysses_bytes(batch, heads, kv_heads, seq * ulysses // cp, head_dim, ulysses, element_size)
    ring_part = ring_bytes(batch, heads // ulysses, seq, head_dim, ring, element_size)
    return {phase: a2a[phase] + ring_part[phase] for phase in ("forward", "backward")}
