"""Ring attention: each rank keeps its queries, the K/V chunks travel around the ring, and the partial
results are combined with FlashAttention's online-softmax merge (chapter 07).

Why it is exact: attention of a query over the keys of chunks a and b, each normalised on its own with
its log-sum-exp, combines into attention over a and b by weighting each part by exp(lse_part - lse_union)
(``workers.attention.api.online_softmax_merge``). After cp ring steps every query has merged every key
chunk it may see, in some order; the merge is associative and commutative, so the result is full attention.

Each block is the float64 reference (``workers.attention.reference.attention_reference``), with the causal
mask only on diagonal blocks; skipped blocks cost nothing. Backward is hand-written (FlashAttention-2's
backward, ``workers.attention.tiled.tiled_attention_backward``, per block, from the *final* out and lse):
dQ stays home, and each K/V chunk's dK/dV accumulator travels around the ring with it, collecting every
rank's contribution, and takes one last hop home.
"""
from __future__ import annotations

import torch

from workers.attention.api import online_softmax_merge
from workers.attention.reference import attention_reference
from workers.attention.tiled import tiled_attention_backward
from workers.context_parallel.blocks import block_kind, ring_source
from workers.context_parallel.ring import GRAD_TAG, KV_TAG, Ring
from workers.context_parallel.split import chunk_ids, num_chunks


def _local_chunks(ring: Ring, split: str, rows: dict, lse=None) -> int:
    """How many chunks this rank's rows hold (1 contiguous, 2 zigzag), after checking that they cut into them.

    Checked before the first send: ``chunk(2)`` of an odd length makes two unequal parts without complaint,
    so a zigzag rank holding 2k+1 rows would compute wrong blocks and pass wrongly sized K/V around the ring.
    ``rows`` names the tensors ``[b, h, s/cp, d]`` that must all hold the same rows.
    """
    n = len(chunk_ids(ring.cp, ring.index, split))
    lengths = {name: t.shape[-2] for name, t in rows.items()}
    if lse is not None:
        lengths["lse"] = lse.shape[-1]  # [b, h, s/cp]
    if len(set(lengths.values())) > 1:
        raise ValueError(f"this rank's tensors hold different numbers of rows ({lengths}): take each with "
                         "take_local from the same sequence")
    local = lengths["q"]
    if local < n or local % n:
        raise ValueError(f"this rank holds {local} rows, which do not cut into the {n} equal chunks of the {split} "
                         f"split: take them with take_local from a seq divisible by {num_chunks(ring.cp, split)}")
    return n


def _blocks(ring: Ring, step: int, split: str, causal: bool):
    """(local q index, q chunk, local k index, k chunk, kind) of the blocks this rank meets at ``step``."""
    mine = chunk_ids(ring.cp, ring.index, split)
    theirs = chunk_ids(ring.cp, ring_source(ring.index, step, ring.cp), split)
    return [(i, qc, j, kc, block_kind(qc, kc, causal)) for i, qc in enumerate(mine) for j, kc in enumerate(theirs)]


def ring_attention_forward(q, k, v, ring: Ring, split: str, causal: bool, softmax_scale=None):
    """``(out [b, h, s/cp, d], lse [b, h, s/cp] float64, log)`` for this rank's q, k, v ``[b, h, s/cp, d]``.

    ``log``: one ``(step, q_chunk, k_chunk, kind)`` per block met, skipped ones included (what was computed).
    """
    n = _local_chunks(ring, split, {"q": q, "k": k, "v": v})  # local chunks: 1 (contiguous) or 2 (zigzag)
    q_parts = q.chunk(n, dim=-2)  # n x [b, h, s/(n cp), d]
    out = [torch.zeros(p.shape, dtype=torch.float64, device=q.device) for p in q_parts]  # merged so far
    lse = [torch.full(p.shape[:-1], float("-inf"), dtype=torch.float64, device=q.device) for p in q_parts]
    kv, log = torch.stack([k, v]), []  # [2, b, h, s/cp, d]: one message per step carries both
    for step in range(ring.cp):
        # Post the next transfer *before* computing on the chunk we hold: the wire and the math overlap.
        pending = ring.exchange(kv, "forward", KV_TAG) if step < ring.cp - 1 else None
        k_parts, v_parts = kv[0].chunk(n, dim=-2), kv[1].chunk(n, dim=-2)
        for i, qc, j, kc, kind in _blocks(ring, step, split, causal):
            log.append((step, qc, kc, kind))
            if kind == "skip":  # every key is in this query chunk's future: no work, nothing to merge
                continue
            o_blk, l_blk = attention_reference(q_parts[i], k_parts[j], v_parts[j], causal=kind == "diagonal",
                                               softmax_scale=softmax_scale)  # [b, h, c, d], [b, h, c]
            out[i], lse[i] = online_softmax_merge(out[i], lse[i], o_blk, l_blk)  # rescale both parts, add
        if pending is not None:
            kv = pending.wait()  # the chunk of rank - (step + 1)
    return torch.cat(out, dim=-2).to(q.dtype), torch.cat(lse, dim=-1), log


def ring_attention_backward(q, k, v, out, lse, dout, ring: Ring, split: str, causal: bool, softmax_scale=None):
    """``(dq, dk, dv)``, each ``[b, h, s/cp, d]``, for this rank's chunks, from the forward's out and lse."""
    n = _local_chunks(ring, split, {"q": q, "k": k, "v": v, "out": out, "dout": dout}, lse)
    f64 = lambda t: t.to(torch.float64)  # noqa: E731 - blocks in float64, like the forward
    q_parts, o_parts, do_parts = (f64(t).chunk(n, dim=-2) for t in (q, out, dout))
    l_parts = f64(lse).chunk(n, dim=-1)  # the *final* lse: P of every block is exp(S - lse), already normalised
    dq = [torch.zeros_like(p) for p in q_parts]
    kv = torch.stack([k, v])  # [2, b, h, s/cp, d]  travels as in forward
    dkv = torch.zeros((2, *k.shape), dtype=k.dtype, device=k.device)  # [2, b, h, s/cp, d]  travels with it
    for step in range(ring.cp):
        pending_kv = ring.exchange(kv, "backward", KV_TAG) if step < ring.cp - 1 else None  # overlaps compute
        k_parts, v_parts = f64(kv[0]).chunk(n, dim=-2), f64(kv[1]).chunk(n, dim=-2)
        dk_parts = list(f64(dkv[0]).chunk(n, dim=-2))
        dv_parts = list(f64(dkv[1]).chunk(n, dim=-2))
        for i, _, j, _, kind in _blocks(ring, step, split, causal):
            if kind == "skip":
                continue
            dq_b, dk_b, dv_b = tiled_attention_backward(q_parts[i], k_parts[j], v_parts[j], o_parts[i], l_parts[i],
                                                        do_parts[i], causal=kind == "diagonal",
                                                        softmax_scale=softmax_scale)
            dq[i] = dq[i] + dq_b
            dk_parts[j], dv_parts[j] = dk_parts[j] + dk_b, dv_parts[j] + dv_b
        dkv = torch.stack([torch.cat(dk_parts, dim=-2), torch.cat(dv_parts, dim=-2)]).to(k.dtype)
        if ring.cp > 1:
            # The accumulator goes where its K/V goes next; after the last step that is the chunk's owner.
            dkv = ring.exchange(dkv, "backward", GRAD_TAG).wait()
        if pending_kv is not None:
            kv = pending_kv.wait()
    return torch.cat(dq, dim=-2).to(q.dtype), dkv[0], dkv[1]


class RingAttention(torch.autograd.Function):
    """Ring attention as an autograd op, for models that call it inside their forward (chapter 15).

    ``ring_attention(q, k, v, ring, split, causal)``: forward is ``ring_attention_forward``, backward
    ``ring_attention_backward`` from the saved out and lse, so a transformer layer can put it where its local
    attention was and let autograd call the ring backward at the right moment of the pipeline's schedule.
    """

    @staticmethod
    def forward(ctx, q, k, v, ring, split, causal):
        out, lse, log = ring_attention_forward(q, k, v, ring, split, causal)  # [b, h, s/cp, d], [b, h, s/cp]
        chunk = q.shape[-2] // len(chunk_ids(ring.cp, ring.index, split))  # tokens per chunk
        ring.score_entries += sum(kind != "skip" for *_, kind in log) * chunk * chunk  # the work, as chapter 14 counts it
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.split, ctx.causal = ring, split, causal
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_attention_backward(q, k, v, out, lse, dout.contiguous(), ctx.ring, ctx.split, ctx.causal)
        return dq, dk, dv, None, None, None


def ring_attention(q, k, v, ring: Ring, split: str, causal: bool = True) -> torch.Tensor:
    """Differentiable ring attention of this rank's ``q, k, v [b, h, s/cp, d]`` -> ``[b, h, s/cp, d]``."""
    return RingAttention.apply(q, k, v, ring, split, causal)
