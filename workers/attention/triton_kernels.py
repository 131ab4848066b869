"""FlashAttention forward and backward as Triton kernels: the fast twin of ``tiled.py``.

Same algorithm (FlashAttention-2 loop order: one program per query tile in forward, one program per key tile
for dK/dV and one per query tile for dQ in backward, so no atomics), written for the GPU:

- Scores live in base 2: we fold log2(e) into the softmax scale once (``qk_scale = scale * log2(e)``) and use
  ``exp2``, which is the hardware's native instruction (``exp`` would be exp2 plus a multiply per element).
  The LSE we store is in natural log units, the same as ``tiled.py`` and the reference.
- Each loop over tiles is split into an unmasked part and a masked part (the causal diagonal, the ragged last
  tile), so most iterations carry no mask arithmetic, and causal programs skip the tiles above the diagonal.
- Head dims that are not a power of two are padded inside the kernel (masked loads), never in HBM.
- q, k, v are read through their strides, so a (B, S, H, D) tensor viewed as (B, H, S, D) needs no copy.

Runs compiled on a CUDA GPU, or on CPU tensors under the Triton interpreter: set ``TRITON_INTERPRET=1``
*before* this module is imported (``@triton.jit`` decides at import time). Under the interpreter we launch
one small fixed configuration instead of autotuning (there is nothing to time), and upcast bf16 operands of
``tl.dot`` to fp32, because the interpreter multiplies bf16 bit patterns as integers
(triton-lang/triton#11584; the products of bf16 values are exact in fp32, so the result is unchanged).

Precision: fp16/bf16 inputs multiply on tensor cores with fp32 accumulation. For fp32 inputs, ``tl.dot``
defaults to TF32 on NVIDIA GPUs (10-bit mantissa); we follow PyTorch's own switch instead:
TF32 only if ``torch.backends.cuda.matmul.allow_tf32`` is True, IEEE fp32 otherwise (the PyTorch default).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * log2(e)); inside kernels it appears as a literal

MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 128


def is_interpreter() -> bool:
    """True when this module's kernels were built for the Triton interpreter (they then run on CPU tensors)."""
    return not isinstance(_attn_fwd, triton.runtime.JITFunction)


# ----------------------------------------------------------------------------------------------------------
# Device helpers
# ----------------------------------------------------------------------------------------------------------

@triton.jit
def _mm(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """a @ b with an fp32 result. UPCAST is only set under the interpreter with bf16 inputs (see module doc)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _load_tile(base, offs_row, offs_d, stride_row, n_rows,
               HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr, MASK_ROWS: tl.constexpr):
    """Load a [rows, HEAD_DIM_PAD] tile; masks only what can be out of bounds (zero-filled)."""
    ptrs = base + offs_row[:, None] * stride_row + offs_d[None, :]
    if MASK_ROWS:
        if EVEN_D:
            tile = tl.load(ptrs, mask=offs_row[:, None] < n_rows, other=0.0)
        else:
            tile = tl.load(ptrs, mask=(offs_row[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    else:
        if EVEN_D:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return tile


@triton.jit
def _store_tile(base, tile, offs_row, offs_d, stride_row, n_rows, HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr):
    ptrs = base + offs_row[:, None] * stride_row + offs_d[None, :]
    if EVEN_D:
        tl.store(ptrs, tile, mask=offs_row[:, None] < n_rows)
    else:
        tl.store(ptrs, tile, mask=(offs_row[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM))


# Masking modes of an inner loop (compile-time constants, so each loop body carries only its own checks).
NO_MASK = tl.constexpr(0)  # every tile fully in bounds and fully visible
CAUSAL_MASK = tl.constexpr(1)  # tiles on the diagonal: key <= query, and bounds
BOUNDS_MASK = tl.constexpr(2)  # the ragged last tile: bounds only


# ----------------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------------

@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, lo, hi, n_kv, qk_scale,
                    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr, MODE: tl.constexpr,
                    UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Online softmax over key tiles [lo, hi): the loop of ``tiled.tiled_attention_forward``."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(k_base, offs_n, offs_d, stride_kn, n_kv, HEAD_DIM, EVEN_D, MODE != NO_MASK)  # [BN, Dp]
        v = _load_tile(v_base, offs_n, offs_d, stride_vn, n_kv, HEAD_DIM, EVEN_D, MODE != NO_MASK)  # [BN, Dp]
        qk = _mm(q, tl.trans(k), UPCAST, PRECISION)  # [BM, BN] raw scores, fp32
        if MODE == CAUSAL_MASK:
            visible = (offs_n[None, :] <= offs_m[:, None]) & (offs_n[None, :] < n_kv)
            qk = tl.where(visible, qk, float("-inf"))
        elif MODE == BOUNDS_MASK:
            qk = tl.where(offs_n[None, :] < n_kv, qk, float("-inf"))
        # Base-2 online softmax: m_i is the running max of qk * qk_scale.
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # [BM]
        p = tl.math.exp2(qk * qk_scale - m_ij[:, None])  # [BM, BN]
        alpha = tl.math.exp2(m_i - m_ij)  # [BM] rescale for what was accumulated under the old max
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc += _mm(p.to(v.dtype), v, UPCAST, PRECISION)  # [BM, Dp]
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(Q, K, V, Out, Lse, qk_scale,
              stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
              stride_vz, stride_vh, stride_vn, stride_oz, stride_oh, stride_om,
              H, N_Q, N_KV, N_TUNE,
              HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, CAUSAL: tl.constexpr,
              UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    EVEN_D: tl.constexpr = HEAD_DIM == HEAD_DIM_PAD
    pid_m = tl.program_id(0)
    if CAUSAL:
        # Programs near the bottom of the causal triangle have the most tiles; launch them first so the
        # last wave is made of short programs (better tail balance).
        pid_m = tl.num_programs(0) - 1 - pid_m
    off_hz = tl.program_id(1)
    off_z = (off_hz // H).to(tl.int64)
    off_h = (off_hz % H).to(tl.int64)
    q_base = Q + off_z * stride_qz + off_h * stride_qh
    k_base = K + off_z * stride_kz + off_h * stride_kh
    v_base = V + off_z * stride_vz + off_h * stride_vh
    o_base = Out + off_z * stride_oz + off_h * stride_oh

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q = _load_tile(q_base, offs_m, offs_d, stride_qm, N_Q, HEAD_DIM, EVEN_D, True)  # [BM, Dp]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

    if CAUSAL:
        # Tiles left of the diagonal: all keys < start_m <= every query of this tile, all in bounds.
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d,
                                        0, start_m, N_KV, qk_scale, BLOCK_N, HEAD_DIM, EVEN_D, NO_MASK,
                                        UPCAST, PRECISION)
        # The diagonal block: keys start_m .. start_m + BLOCK_M - 1 (clipped to the sequence), masked.
        diag_hi = tl.minimum(start_m + BLOCK_M, N_KV)
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d,
                                        start_m, diag_hi, N_KV, qk_scale, BLOCK_N, HEAD_DIM, EVEN_D, CAUSAL_MASK,
                                        UPCAST, PRECISION)
    else:
        full_hi = (N_KV // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d,
                                        0, full_hi, N_KV, qk_scale, BLOCK_N, HEAD_DIM, EVEN_D, NO_MASK,
                                        UPCAST, PRECISION)
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d,
                                        full_hi, N_KV, N_KV, qk_scale, BLOCK_N, HEAD_DIM, EVEN_D, BOUNDS_MASK,
                                        UPCAST, PRECISION)

    acc = acc / l_i[:, None]
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453  # back to natural-log units
    _store_tile(o_base, acc.to(Out.dtype.element_ty), offs_m, offs_d, stride_om, N_Q, HEAD_DIM, EVEN_D)
    tl.store(Lse + off_hz.to(tl.int64) * N_Q + offs_m, lse, mask=offs_m < N_Q)


# ----------------------------------------------------------------------------------------------------------
# Backward: delta = rowsum(dO * O), then dK/dV per key tile, then dQ per query tile
# ----------------------------------------------------------------------------------------------------------

@triton.jit
def _attn_bwd_preprocess(Out, DO, Delta, stride_oz, stride_oh, stride_om, stride_dz, stride_dh, stride_dm,
                         H, N_Q, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    EVEN_D: tl.constexpr = HEAD_DIM == HEAD_DIM_PAD
    off_hz = tl.program_id(1)
    off_z = (off_hz // H).to(tl.int64)
    off_h = (off_hz % H).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    o = _load_tile(Out + off_z * stride_oz + off_h * stride_oh, offs_m, offs_d, stride_om, N_Q,
                   HEAD_DIM, EVEN_D, True).to(tl.float32)
    do = _load_tile(DO + off_z * stride_dz + off_h * stride_dh, offs_m, offs_d, stride_dm, N_Q,
                    HEAD_DIM, EVEN_D, True).to(tl.float32)
    delta = tl.sum(o * do, axis=1)  # [BM]
    tl.store(Delta + off_hz.to(tl.int64) * N_Q + offs_m, delta, mask=offs_m < N_Q)


@triton.jit
def _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qm, stride_dm,
                         offs_n, offs_d, lo, hi, n_q, qk_scale,
                         BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr, MODE: tl.constexpr,
                         UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Accumulate dK, dV of one key tile over query tiles [lo, hi); works on transposed tiles [BN, BM]."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load_tile(q_base, offs_m, offs_d, stride_qm, n_q, HEAD_DIM, EVEN_D, MODE != NO_MASK)  # [BM, Dp]
        do = _load_tile(do_base, offs_m, offs_d, stride_dm, n_q, HEAD_DIM, EVEN_D, MODE != NO_MASK)  # [BM, Dp]
        if MODE == NO_MASK:
            lse2 = tl.load(lse_base + offs_m) * 1.4426950408889634  # [BM] in base 2
            delta = tl.load(delta_base + offs_m)  # [BM]
        else:
            lse2 = tl.load(lse_base + offs_m, mask=offs_m < n_q, other=0.0) * 1.4426950408889634
            delta = tl.load(delta_base + offs_m, mask=offs_m < n_q, other=0.0)
        qkT = _mm(k, tl.trans(q), UPCAST, PRECISION)  # [BN, BM]
        pT = tl.math.exp2(qkT * qk_scale - lse2[None, :])  # [BN, BM]  P^T rebuilt from the saved LSE
        if MODE == CAUSAL_MASK:
            pT = tl.where((offs_m[None, :] >= offs_n[:, None]) & (offs_m[None, :] < n_q), pT, 0.0)
        elif MODE == BOUNDS_MASK:
            pT = tl.where(offs_m[None, :] < n_q, pT, 0.0)
        dv += _mm(pT.to(do.dtype), do, UPCAST, PRECISION)  # [BN, Dp]
        dpT = _mm(v, tl.trans(do), UPCAST, PRECISION)  # [BN, BM]
        dsT = pT * (dpT - delta[None, :])  # [BN, BM]
        dk += _mm(dsT.to(q.dtype), q, UPCAST, PRECISION)  # [BN, Dp]  (times the scale, applied once at the end)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, DK, DV, Lse, Delta, softmax_scale, qk_scale,
                   stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
                   stride_vz, stride_vh, stride_vn, stride_dz, stride_dh, stride_dm,
                   stride_dkz, stride_dkh, stride_dkn, stride_dvz, stride_dvh, stride_dvn,
                   H, N_Q, N_KV, N_TUNE,
                   HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, CAUSAL: tl.constexpr,
                   UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    EVEN_D: tl.constexpr = HEAD_DIM == HEAD_DIM_PAD
    off_hz = tl.program_id(1)
    off_z = (off_hz // H).to(tl.int64)
    off_h = (off_hz % H).to(tl.int64)
    start_n = tl.program_id(0) * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_base = Q + off_z * stride_qz + off_h * stride_qh
    do_base = DO + off_z * stride_dz + off_h * stride_dh
    lse_base = Lse + off_hz.to(tl.int64) * N_Q
    delta_base = Delta + off_hz.to(tl.int64) * N_Q
    k = _load_tile(K + off_z * stride_kz + off_h * stride_kh, offs_n, offs_d, stride_kn, N_KV,
                   HEAD_DIM, EVEN_D, True)  # [BN, Dp]
    v = _load_tile(V + off_z * stride_vz + off_h * stride_vh, offs_n, offs_d, stride_vn, N_KV,
                   HEAD_DIM, EVEN_D, True)  # [BN, Dp]
    dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)

    full_hi = (N_Q // BLOCK_M) * BLOCK_M  # query tiles below this are entirely in bounds
    if CAUSAL:
        # Queries before start_n never see these keys: start at the diagonal. The diagonal block
        # (queries start_n .. start_n + BLOCK_N - 1) needs the causal mask; below it, only the ragged tail.
        diag_hi = tl.minimum(start_n + BLOCK_N, N_Q)
        dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qm, stride_dm,
                                      offs_n, offs_d, start_n, diag_hi, N_Q, qk_scale, BLOCK_M, HEAD_DIM, EVEN_D,
                                      CAUSAL_MASK, UPCAST, PRECISION)
        lo = start_n + BLOCK_N
        tail_lo = tl.maximum(lo, full_hi)  # both multiples of BLOCK_M: if lo > full_hi, lo >= N_Q (no tail)
    else:
        lo = 0
        tail_lo = full_hi
    dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qm, stride_dm,
                                  offs_n, offs_d, lo, full_hi, N_Q, qk_scale, BLOCK_M, HEAD_DIM, EVEN_D,
                                  NO_MASK, UPCAST, PRECISION)
    dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qm, stride_dm,
                                  offs_n, offs_d, tail_lo, N_Q, N_Q, qk_scale, BLOCK_M, HEAD_DIM,
                                  EVEN_D, BOUNDS_MASK, UPCAST, PRECISION)
    dk = dk * softmax_scale  # S = scale * Q K^T: dK = scale * dS^T Q
    _store_tile(DK + off_z * stride_dkz + off_h * stride_dkh, dk.to(DK.dtype.element_ty), offs_n, offs_d,
                stride_dkn, N_KV, HEAD_DIM, EVEN_D)
    _store_tile(DV + off_z * stride_dvz + off_h * stride_dvh, dv.to(DV.dtype.element_ty), offs_n, offs_d,
                stride_dvn, N_KV, HEAD_DIM, EVEN_D)


@triton.jit
def _attn_bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, lo, hi, n_kv,
                       qk_scale, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr,
                       MODE: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Accumulate dQ of one query tile over key tiles [lo, hi)."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(k_base, offs_n, offs_d, stride_kn, n_kv, HEAD_DIM, EVEN_D, MODE != NO_MASK)  # [BN, Dp]
        v = _load_tile(v_base, offs_n, offs_d, stride_vn, n_kv, HEAD_DIM, EVEN_D, MODE != NO_MASK)  # [BN, Dp]
        qk = _mm(q, tl.trans(k), UPCAST, PRECISION)  # [BM, BN]
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])  # [BM, BN]
        if MODE == CAUSAL_MASK:
            p = tl.where((offs_n[None, :] <= offs_m[:, None]) & (offs_n[None, :] < n_kv), p, 0.0)
        elif MODE == BOUNDS_MASK:
            p = tl.where(offs_n[None, :] < n_kv, p, 0.0)
        dp = _mm(do, tl.trans(v), UPCAST, PRECISION)  # [BM, BN]
        ds = p * (dp - delta[:, None])  # [BM, BN]
        dq += _mm(ds.to(k.dtype), k, UPCAST, PRECISION)  # [BM, Dp]
    return dq


@triton.jit
def _attn_bwd_dq(Q, K, V, DO, DQ, Lse, Delta, softmax_scale, qk_scale,
                 stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
                 stride_vz, stride_vh, stride_vn, stride_dz, stride_dh, stride_dm,
                 stride_dqz, stride_dqh, stride_dqm,
                 H, N_Q, N_KV, N_TUNE,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, CAUSAL: tl.constexpr,
                 UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    EVEN_D: tl.constexpr = HEAD_DIM == HEAD_DIM_PAD
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m  # longest programs first, as in forward
    off_hz = tl.program_id(1)
    off_z = (off_hz // H).to(tl.int64)
    off_h = (off_hz % H).to(tl.int64)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    k_base = K + off_z * stride_kz + off_h * stride_kh
    v_base = V + off_z * stride_vz + off_h * stride_vh
    q = _load_tile(Q + off_z * stride_qz + off_h * stride_qh, offs_m, offs_d, stride_qm, N_Q,
                   HEAD_DIM, EVEN_D, True)  # [BM, Dp]
    do = _load_tile(DO + off_z * stride_dz + off_h * stride_dh, offs_m, offs_d, stride_dm, N_Q,
                    HEAD_DIM, EVEN_D, True)  # [BM, Dp]
    lse2 = tl.load(Lse + off_hz.to(tl.int64) * N_Q + offs_m, mask=offs_m < N_Q, other=0.0) * 1.4426950408889634
    delta = tl.load(Delta + off_hz.to(tl.int64) * N_Q + offs_m, mask=offs_m < N_Q, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    if CAUSAL:
        dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d,
                                0, start_m, N_KV, qk_scale, BLOCK_N, HEAD_DIM, EVEN_D, NO_MASK, UPCAST, PRECISION)
        diag_hi = tl.minimum(start_m + BLOCK_M, N_KV)
        dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d,
                                start_m, diag_hi, N_KV, qk_scale, BLOCK_N, HEAD_DIM, EVEN_D, CAUSAL_MASK,
                                UPCAST, PRECISION)
    else:
        full_hi = (N_KV // BLOCK_N) * BLOCK_N
        dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d,
                                0, full_hi, N_KV, qk_scale, BLOCK_N, HEAD_DIM, EVEN_D, NO_MASK, UPCAST, PRECISION)
        dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d,
                                full_hi, N_KV, N_KV, qk_scale, BLOCK_N, HEAD_DIM, EVEN_D, BOUNDS_MASK,
                                UPCAST, PRECISION)
    dq = dq * softmax_scale  # S = scale * Q K^T: dQ = scale * dS K
    _store_tile(DQ + off_z * stride_dqz + off_h * stride_dqh, dq.to(DQ.dtype.element_ty), offs_m, offs_d,
                stride_dqm, N_Q, HEAD_DIM, EVEN_D)


# ----------------------------------------------------------------------------------------------------------
# Launch configurations
# ----------------------------------------------------------------------------------------------------------
# GPU: a short autotune list per kernel, aimed at Hopper (H100/H200: 228 KB shared memory per SM, wgmma wants
# 64-row warpgroup tiles, so BLOCK_M = 128 with 8 warps gives two warpgroups). A config that does not fit
# (e.g. 128x128 tiles, head dim 128, 3 stages) fails to compile and the autotuner skips it.
# Constraints the loops rely on: forward and dQ walk the causal diagonal in BLOCK_N steps inside one BLOCK_M
# tile (BLOCK_M % BLOCK_N == 0); dK/dV walk it in BLOCK_M steps inside one BLOCK_N tile (BLOCK_N % BLOCK_M == 0).

def _cfg(block_m, block_n, num_warps, num_stages):
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": num_warps, "num_stages": num_stages}


# The lists are short on purpose: every config is compiled (5-40 s each on a CPU core) for every head dim and
# causal flag before the first timing, so the first autotuned call of a sweep pays for all of them.
# The first entry of each list is the default when autotuning is off (``configs="default"``); each default
# compiles for sm_90 without register spills at head dims 64 and 128, causal or not, under Triton 3.6 and 3.9
# (``resource_usage``; tests/test_attention_triton_compile.py). dK/dV keeps two [BLOCK_N, d] fp32 accumulators
# in registers: at d = 128 with 4 warps that is 256 registers a thread before anything else, so 32x128 with
# 4 warps (the Triton tutorial's shape) spills about 3 KB a thread there; 8 warps halve it.
GPU_CONFIGS = {
    "fwd": [_cfg(128, 64, 8, 3), _cfg(128, 64, 4, 3), _cfg(128, 128, 8, 2), _cfg(64, 64, 4, 4)],
    "dkdv": [_cfg(32, 128, 8, 3), _cfg(64, 128, 8, 3), _cfg(32, 128, 4, 5)],
    "dq": [_cfg(128, 64, 8, 3), _cfg(128, 32, 4, 5), _cfg(64, 64, 4, 3)],
}
# Interpreter: one small config per kernel. Small tiles make short test sequences span several tiles, so the
# diagonal, the skipped tiles and the ragged tail are all exercised; BLOCK_M != BLOCK_N makes the diagonal
# take more than one inner step.
INTERPRETER_CONFIGS = {"fwd": _cfg(32, 16, 4, 1), "dkdv": _cfg(16, 32, 4, 1), "dq": _cfg(32, 16, 4, 1)}
PREPROCESS_BLOCK_M = 64

# N_TUNE is the sequence length rounded to a power of two in [1024, 16384], an argument the kernels never
# read: it makes the autotuner tune once per length bucket instead of once per exact length (each tuning
# runs every config). Triton adds the tensors' dtypes to the key itself.
_AUTOTUNE_KEY = ["N_TUNE", "HEAD_DIM_PAD", "CAUSAL", "PRECISION"]


def tuning_bucket(n: int) -> int:
    return min(16384, max(1024, triton.next_power_of_2(n)))


_tuned = {}


def _autotuned(name):
    """The autotuned wrapper of kernel ``name`` (built on first use, so the interpreter never builds one)."""
    if name not in _tuned:
        kernel = {"fwd": _attn_fwd, "dkdv": _attn_bwd_dkdv, "dq": _attn_bwd_dq}[name]
        configs = [triton.Config({"BLOCK_M": c["BLOCK_M"], "BLOCK_N": c["BLOCK_N"]}, num_warps=c["num_warps"],
                                 num_stages=c["num_stages"]) for c in GPU_CONFIGS[name]]
        _tuned[name] = triton.autotune(configs=configs, key=_AUTOTUNE_KEY)(kernel)
    return _tuned[name]


def check_config(name: str, config: dict) -> None:
    bm, bn = config["BLOCK_M"], config["BLOCK_N"]
    if name in ("fwd", "dq") and bm % bn:
        raise ValueError(f"{name} needs BLOCK_M divisible by BLOCK_N, got {bm} and {bn}")
    if name == "dkdv" and bn % bm:
        raise ValueError(f"dkdv needs BLOCK_N divisible by BLOCK_M, got {bm} and {bn}")


def _launch(name, grid_rows, batch_heads, args, kwargs, configs):
    """Run kernel ``name``: with ``configs[name]`` if given, the interpreter's fixed config, or autotuned."""
    kernel = {"fwd": _attn_fwd, "dkdv": _attn_bwd_dkdv, "dq": _attn_bwd_dq}[name]
    if configs == "default":
        configs = {key: value[0] for key, value in GPU_CONFIGS.items()}
    config = (configs or {}).get(name) or (INTERPRETER_CONFIGS[name] if is_interpreter() else None)
    if config is None:
        tuned = _autotuned(name)
        def grid(meta):
            return triton.cdiv(grid_rows, meta["BLOCK_M" if name != "dkdv" else "BLOCK_N"]), batch_heads

        tuned[grid](*args, **kwargs)
        return tuned.best_config
    check_config(name, config)
    tile = config["BLOCK_M" if name != "dkdv" else "BLOCK_N"]
    kernel[(triton.cdiv(grid_rows, tile), batch_heads)](*args, **kwargs, **config)
    return config


# ----------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs: TF32 only where PyTorch itself allows it for matmuls; 16-bit inputs: ignored by Triton."""
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The kernels take any batch/head/sequence strides but need the head dim to be contiguous."""
    return t if t.stride(-1) == 1 else t.contiguous()


def check_inputs(q, k, v, causal):
    """Raise a one-sentence error for inputs the kernels do not handle."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"the Triton kernels take 4-D (batch, heads, seq, head_dim) tensors, got {tuple(q.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q, k and v must share one dtype among fp16, bf16 and fp32, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must agree in batch, "
                         "heads and head_dim, and k and v in sequence length")
    if not MIN_HEAD_DIM <= q.shape[-1] <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {q.shape[-1]} is outside the {MIN_HEAD_DIM}..{MAX_HEAD_DIM} the Triton kernels "
                         "support; use impl='torch' for other sizes")
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"causal attention needs as many queries as keys, got {q.shape[2]} and {k.shape[2]}")
    if not (q.is_cuda or is_interpreter()):
        raise RuntimeError("the Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 set before triton is "
                           "imported to run on CPU; use impl='torch' otherwise")


def _meta(q, causal):
    head_dim = q.shape[-1]
    upcast = is_interpreter() and q.dtype == torch.bfloat16  # triton-lang/triton#11584, see module docstring
    return dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)), CAUSAL=bool(causal),
                UPCAST=upcast, PRECISION=_dot_precision(q.dtype))


def attention_forward(q, k, v, causal=False, softmax_scale=None, configs=None):
    """``(out, lse, config)``: out [B, H, Sq, D] in q's dtype, lse [B, H, Sq] float32 (natural log)."""
    check_inputs(q, k, v, causal)
    q, k, v = _strided(q), _strided(k), _strided(v)
    batch, heads, n_q, head_dim = q.shape
    n_kv = k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, n_q), dtype=torch.float32, device=q.device)
    args = (q, k, v, out, lse, scale * LOG2E,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
            heads, n_q, n_kv, tuning_bucket(max(n_q, n_kv)))
    config = _launch("fwd", n_q, batch * heads, args, _meta(q, causal), configs)
    return out, lse, config


def attention_backward(q, k, v, out, lse, dout, causal=False, softmax_scale=None, configs=None):
    """``(dq, dk, dv)`` from the saved ``out`` and ``lse``: P is recomputed tile by tile, never stored."""
    q, k, v, out, dout = _strided(q), _strided(k), _strided(v), _strided(out), _strided(dout)
    batch, heads, n_q, head_dim = q.shape
    n_kv = k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    meta = _meta(q, causal)
    delta = torch.empty_like(lse)  # [B, H, Sq] rowsum(dO * O)
    _attn_bwd_preprocess[(triton.cdiv(n_q, PREPROCESS_BLOCK_M), batch * heads)](
        out, dout, delta, out.stride(0), out.stride(1), out.stride(2), dout.stride(0), dout.stride(1),
        dout.stride(2), heads, n_q, HEAD_DIM=meta["HEAD_DIM"], HEAD_DIM_PAD=meta["HEAD_DIM_PAD"],
        BLOCK_M=PREPROCESS_BLOCK_M)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    common = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
              v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2))
    _launch("dkdv", n_kv, batch * heads,
            (q, k, v, dout, dk, dv, lse, delta, scale, scale * LOG2E, *common,
             dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2), heads, n_q, n_kv,
             tuning_bucket(max(n_q, n_kv))),
            meta, configs)
    _launch("dq", n_q, batch * heads,
            (q, k, v, dout, dq, lse, delta, scale, scale * LOG2E, *common,
             dq.stride(0), dq.stride(1), dq.stride(2), heads, n_q, n_kv, tuning_bucket(max(n_q, n_kv))),
            meta, configs)
    return dq, dk, dv


class TritonFlashAttention(torch.autograd.Function):
    """Forward saves (q, k, v, O, LSE); backward runs the preprocess, dK/dV and dQ kernels.

    The log-sum-exp is saved, and returned, in the queries' leading shape: [B, H, Sq] for 4-D inputs, [B, Sq] for
    3-D ones (one head: the kernels run on a [B, 1, S, D] view, and the [B, 1, Sq] statistics are saved as [B, Sq]),
    the layout the backward reads and the tiled version saves."""

    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, configs):
        one_head = q.dim() == 3
        if one_head:  # [B, S, D] -> [B, 1, S, D]: views, no copy
            q4, k4, v4 = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
        else:
            q4, k4, v4 = q, k, v
        out, lse, _ = attention_forward(q4, k4, v4, causal, softmax_scale, configs)  # [B, H, Sq, D], [B, H, Sq]
        if one_head:
            out, lse = out.squeeze(1), lse.squeeze(1)  # [B, Sq, D], [B, Sq]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.softmax_scale, ctx.configs = causal, softmax_scale, configs
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if q.dim() == 3:
            q, k, v, out, lse, dout = (t.unsqueeze(1) for t in (q, k, v, out, lse, dout))
        dq, dk, dv = attention_backward(q, k, v, out, lse, dout, ctx.causal, ctx.softmax_scale, ctx.configs)
        if ctx.saved_tensors[0].dim() == 3:
            dq, dk, dv = dq.squeeze(1), dk.squeeze(1), dv.squeeze(1)
        return dq, dk, dv, None, None, None


def triton_flash_attention(q, k, v, causal=False, softmax_scale=None, configs=None):
    """``(out, lse)`` for q, k, v [B, H, S, D] (lse [B, H, S]) or [B, S, D] (lse [B, S]); differentiable in q, k, v.

    ``configs`` (optional) maps "fwd", "dkdv", "dq" to {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"} and
    bypasses autotuning: tests use it to walk other tile shapes, benchmarks to pin a version. ``"default"``
    means the first GPU config of each kernel (no autotuning: one compile per kernel instead of several).
    """
    return TritonFlashAttention.apply(q, k, v, causal, softmax_scale, configs)


# ----------------------------------------------------------------------------------------------------------
# Ahead-of-time compilation, no GPU needed (Triton ships ptxas): catches what the interpreter cannot
# (type errors in compiled control flow, shared memory overflow) and shows the generated code.
# ----------------------------------------------------------------------------------------------------------

_POINTER_ARGS = {"Q", "K", "V", "Out", "DO", "DQ", "DK", "DV"}
_FP32_POINTER_ARGS = {"Lse", "Delta"}
_FLOAT_ARGS = {"qk_scale", "softmax_scale"}


def compile_for_gpu(name: str, config: dict, head_dim: int = 128, causal: bool = True, dtype: str = "bf16",
                    arch: int = 90, n: int = 4096, heads: int = 16):
    """Compile kernel ``name`` ("fwd", "dkdv", "dq", "preprocess") for an NVIDIA GPU of capability ``arch``.

    Arguments are specialised as a launch on contiguous [2, heads, n, head_dim] tensors would specialise them
    (16-byte aligned pointers; integers divisible by 16 marked so), which is what lets Triton vectorise and
    pipeline the loads. Returns Triton's compiled kernel: ``.asm["ttgir"]``, ``.asm["ptx"]``,
    ``.metadata.shared`` (bytes of shared memory). Needs a Triton build with the NVIDIA backend, not a GPU.
    """
    if is_interpreter():
        raise RuntimeError("compile_for_gpu needs the compiled kernels: import this module without "
                           "TRITON_INTERPRET=1")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = {"fwd": _attn_fwd, "dkdv": _attn_bwd_dkdv, "dq": _attn_bwd_dq, "preprocess": _attn_bwd_preprocess}[name]
    if name != "preprocess":
        check_config(name, config)
    pad = max(16, triton.next_power_of_2(head_dim))
    constexprs = {"HEAD_DIM": head_dim, "HEAD_DIM_PAD": pad, "CAUSAL": causal, "UPCAST": False,
                  "PRECISION": "ieee", "BLOCK_M": config["BLOCK_M"], "BLOCK_N": config.get("BLOCK_N")}
    constexprs = {key: value for key, value in constexprs.items() if key in kernel.arg_names}
    ints = {"H": heads, "N_Q": n, "N_KV": n, "N_TUNE": tuning_bucket(n)}
    signature, attrs = {}, {}
    for i, arg in enumerate(kernel.arg_names):
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg in _POINTER_ARGS or arg in _FP32_POINTER_ARGS:
            signature[arg] = "*fp32" if arg in _FP32_POINTER_ARGS else f"*{dtype}"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif arg in _FLOAT_ARGS:
            signature[arg] = "fp32"
        else:  # strides of a contiguous [B, H, n, D] tensor, and the sizes
            value = ints.get(arg, {"z": heads * n * head_dim, "h": n * head_dim}.get(arg[-1], head_dim))
            signature[arg] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": config["num_warps"], "num_stages": config["num_stages"]})


def resource_usage(compiled) -> dict:
    """Registers per thread, spill stack and shared memory of a kernel from ``compile_for_gpu``, without a GPU.

    Read from the cubin Triton built, with the ``cuobjdump -res-usage`` that Triton ships. These kernels call
    nothing and keep no local arrays, so any stack frame holds registers that did not fit in the 255 a thread
    may use: ptxas parks them in local memory (off-chip, slow). Checked once against ``ptxas -v``: dK/dV
    32x128, 4 warps, d = 128, causal had a 936-byte stack frame and 3008 bytes of spill stores.
    """
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    from triton.backends.nvidia.compiler import get_ptxas

    cuobjdump = Path(get_ptxas(80).path).with_name("cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        text = subprocess.run([str(cuobjdump), "-res-usage", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    fields = {key: int(value) for key, value in re.findall(r"\b(REG|STACK|LOCAL):(\d+)", text)}
    return {"registers": fields["REG"], "spill_stack_bytes": fields["STACK"] + fields.get("LOCAL", 0),
            "shared_bytes": compiled.metadata.shared}
