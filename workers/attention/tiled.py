"""FlashAttention in plain PyTorch: tiling, the online softmax, and recomputation in backward.

This is the readable version (Dao et al. 2022, "FlashAttention", Algorithm 1, in the loop order of
Dao 2023, "FlashAttention-2": the outer loop runs over query tiles, so each output tile is finished in one
pass and written once). Every line here has a twin in ``triton_kernels.py``, which is the fast version.

The point of the algorithm: the [Sq, Sk] score matrix S and the probabilities P are never materialised.
We walk over key/value tiles and keep, per query row, three running quantities:

    m    the largest score seen so far           [B, H, Bq]
    l    sum_j exp(S_ij - m) over keys seen       [B, H, Bq]
    acc  sum_j exp(S_ij - m) * V_j                 [B, H, Bq, D]

When a new tile raises the running max from m to m_new, everything accumulated so far was scaled by
exp(-m) and must be rescaled by exp(m - m_new) (the *online softmax*, Milakov & Gimelshein 2018).
At the end O = acc / l and LSE = m + log(l). Forward saves only O and LSE (O(N) memory); backward
rebuilds each P tile from Q, K and the saved LSE: P_ij = exp(S_ij - LSE_i), with no max or sum needed.

Tiles are computed in float32 (float64 if the inputs are float64, so ``gradcheck`` can check this file
exactly), like the kernel's fp32 accumulators; inputs and outputs keep their dtype.
"""
from __future__ import annotations

import math

import torch

DEFAULT_BLOCK_Q = 64
DEFAULT_BLOCK_K = 64


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def tile_causal_mask(q_start: int, q_len: int, k_start: int, k_len: int, device) -> torch.Tensor | None:
    """Mask for one [Bq, Bk] tile, True where key <= query; None when the whole tile is visible."""
    if k_start + k_len - 1 <= q_start:  # the tile's last key is at or before its first query: no masking
        return None
    rows = torch.arange(q_start, q_start + q_len, device=device)[:, None]  # absolute query positions
    cols = torch.arange(k_start, k_start + k_len, device=device)[None, :]  # absolute key positions
    return cols <= rows  # [Bq, Bk]


def online_softmax_update(m, l, acc, scores, v_tile):
    """Fold one tile of scores into the running (m, l, acc) state; returns the new state.

    m, l: [B, H, Bq]; acc: [B, H, Bq, D]; scores: [B, H, Bq, Bk] (masked entries are -inf); v_tile: [B, H, Bk, D].
    """
    m_new = torch.maximum(m, scores.amax(dim=-1))  # [B, H, Bq]
    # A row that has seen only masked keys keeps m = -inf; subtracting 0 instead of -inf avoids
    # exp(-inf - (-inf)) = nan there, and changes nothing elsewhere.
    m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
    alpha = torch.exp(m - m_safe)  # [B, H, Bq]  how much the old max overstated the new one: rescale old sums
    p = torch.exp(scores - m_safe[..., None])  # [B, H, Bq, Bk]  unnormalised probabilities of this tile
    l_new = alpha * l + p.sum(dim=-1)  # [B, H, Bq]
    acc_new = alpha[..., None] * acc + p @ v_tile  # [B, H, Bq, D]
    return m_new, l_new, acc_new


def tiled_attention_forward(q, k, v, causal=False, softmax_scale=None,
                            block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K):
    """Return ``(out, lse)`` for q [B, H, Sq, D], k and v [B, H, Sk, D]; out in q's dtype, lse in float32/64."""
    batch, heads, n_q, head_dim = q.shape
    n_k = k.shape[-2]
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    cdt = _compute_dtype(q.dtype)
    out = torch.empty_like(q)  # [B, H, Sq, D]
    lse = torch.empty(batch, heads, n_q, dtype=cdt, device=q.device)  # [B, H, Sq]

    for q_start in range(0, n_q, block_q):
        q_tile = q[:, :, q_start:q_start + block_q].to(cdt)  # [B, H, Bq, D]   (the last tile may be shorter)
        q_len = q_tile.shape[-2]
        m = torch.full((batch, heads, q_len), float("-inf"), dtype=cdt, device=q.device)  # [B, H, Bq]
        l = torch.zeros((batch, heads, q_len), dtype=cdt, device=q.device)  # [B, H, Bq]
        acc = torch.zeros((batch, heads, q_len, head_dim), dtype=cdt, device=q.device)  # [B, H, Bq, D]
        # Causal: keys after this tile's last query are invisible to every row, so those tiles are skipped
        # entirely (about half the work): this, not the mask, is where causal attention saves time.
        k_end = min(n_k, q_start + q_len) if causal else n_k
        for k_start in range(0, k_end, block_k):
            k_tile = k[:, :, k_start:k_start + block_k].to(cdt)  # [B, H, Bk, D]
            v_tile = v[:, :, k_start:k_start + block_k].to(cdt)  # [B, H, Bk, D]
            scores = (q_tile @ k_tile.transpose(-1, -2)) * scale  # [B, H, Bq, Bk]
            if causal:
                mask = tile_causal_mask(q_start, q_len, k_start, k_tile.shape[-2], q.device)
                if mask is not None:
                    scores = scores.masked_fill(~mask, float("-inf"))
            m, l, acc = online_softmax_update(m, l, acc, scores, v_tile)
        out[:, :, q_start:q_start + q_len] = (acc / l[..., None]).to(q.dtype)  # normalise once, at the end
        lse[:, :, q_start:q_start + q_len] = m + torch.log(l)
    return out, lse


def tiled_attention_backward(q, k, v, out, lse, dout, causal=False, softmax_scale=None,
                             block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K):
    """Return ``(dq, dk, dv)`` by recomputing P tile by tile from the saved LSE (FlashAttention-2, Alg. 2).

    With dP = dO V^T and the softmax Jacobian, dS = P * (dP - delta) where delta_i = sum_j P_ij dP_ij
    = rowsum(dO_i * O_i): one number per row, computed once up front, so no tile needs a whole row of P.
    """
    batch, heads, n_q, head_dim = q.shape
    n_k = k.shape[-2]
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    cdt = _compute_dtype(q.dtype)
    delta = (dout.to(cdt) * out.to(cdt)).sum(dim=-1)  # [B, H, Sq]
    lse = lse.to(cdt)
    dq = torch.zeros(q.shape, dtype=cdt, device=q.device)  # [B, H, Sq, D]   accumulated over key tiles
    dk = torch.zeros(k.shape, dtype=cdt, device=q.device)  # [B, H, Sk, D]
    dv = torch.zeros(v.shape, dtype=cdt, device=q.device)  # [B, H, Sk, D]

    # Outer loop over key tiles (each dK_j, dV_j finished in one pass, as in the kernel's dkdv program).
    for k_start in range(0, n_k, block_k):
        k_tile = k[:, :, k_start:k_start + block_k].to(cdt)  # [B, H, Bk, D]
        v_tile = v[:, :, k_start:k_start + block_k].to(cdt)  # [B, H, Bk, D]
        k_len = k_tile.shape[-2]
        # Causal: queries before this key tile's first key never see it; start at the tile holding k_start.
        q_first = (k_start // block_q) * block_q if causal else 0
        for q_start in range(q_first, n_q, block_q):
            q_tile = q[:, :, q_start:q_start + block_q].to(cdt)  # [B, H, Bq, D]
            do_tile = dout[:, :, q_start:q_start + block_q].to(cdt)  # [B, H, Bq, D]
            q_len = q_tile.shape[-2]
            scores = (q_tile @ k_tile.transpose(-1, -2)) * scale  # [B, H, Bq, Bk]
            p = torch.exp(scores - lse[:, :, q_start:q_start + q_len, None])  # [B, H, Bq, Bk]  exact P, rebuilt
            if causal:
                mask = tile_causal_mask(q_start, q_len, k_start, k_len, q.device)
                if mask is not None:
                    p = p.masked_fill(~mask, 0.0)
            dv[:, :, k_start:k_start + k_len] += p.transpose(-1, -2) @ do_tile  # [B, H, Bk, D]
            dp = do_tile @ v_tile.transpose(-1, -2)  # [B, H, Bq, Bk]
            ds = p * (dp - delta[:, :, q_start:q_start + q_len, None])  # [B, H, Bq, Bk]  dL/dS
            # S = scale * Q K^T, so the scale comes back in both dQ and dK.
            dq[:, :, q_start:q_start + q_len] += (ds @ k_tile) * scale  # [B, H, Bq, D]
            dk[:, :, k_start:k_start + k_len] += (ds.transpose(-1, -2) @ q_tile) * scale  # [B, H, Bk, D]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class TiledFlashAttention(torch.autograd.Function):
    """Tiled attention whose forward saves only (q, k, v, O, LSE): O(N) extra memory instead of O(N^2).

    The saved log-sum-exp is one tensor per call in the queries' own leading shape, the layout the backward reads
    row by row: ``[B, Sq]`` for 3-D q [B, Sq, D] (one head), ``[B, H, Sq]`` for 4-D q (one (batch, queries) slice
    per head), float32 (float64 for float64 inputs), natural log: lse[b, i] = log sum_j exp(scale q_i . k_j) over
    the keys row i sees. q, k, v and O are saved as they came (no copies); the kernels below see 4-D views.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, block_q, block_k):
        one_head = q.dim() == 3
        q4, k4, v4 = (t.unsqueeze(1) for t in (q, k, v)) if one_head else (q, k, v)  # [B, H, S, D] views
        out, lse = tiled_attention_forward(q4, k4, v4, causal, softmax_scale, block_q, block_k)
        out, lse = out.view(q.shape), lse.view(q.shape[:-1])  # [..., Sq, D], [..., Sq]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.softmax_scale, ctx.block_q, ctx.block_k = causal, softmax_scale, block_q, block_k
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        one_head = q.dim() == 3
        if one_head:  # [B, S, ...] -> [B, 1, S, ...] views for the 4-D kernels
            q, k, v, out, lse, dout = (t.unsqueeze(1) for t in (q, k, v, out, lse, dout))
        dq, dk, dv = tiled_attention_backward(q, k, v, out, lse, dout.contiguous(), ctx.causal, ctx.softmax_scale,
                                              ctx.block_q, ctx.block_k)
        if one_head:
            dq, dk, dv = dq.squeeze(1), dk.squeeze(1), dv.squeeze(1)
        return dq, dk, dv, None, None, None, None


def tiled_flash_attention(q, k, v, causal=False, softmax_scale=None,
                          block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K):
    """``(out, lse)`` for q, k, v [B, H, S, D] (lse [B, H, Sq]) or [B, S, D] (lse [B, Sq]); differentiable in q, k,
    v. The lse returned is the one saved for backward."""
    return TiledFlashAttention.apply(q, k, v, causal, softmax_scale, block_q, block_k)
