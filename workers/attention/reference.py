"""Naive attention in float64: the ground truth every other implementation is checked against.

    S = Q K^T * scale            # [B, H, Sq, Sk]   the N x N matrix FlashAttention never writes to HBM
    P = softmax(S)  (row-wise)
    O = P V                      # [B, H, Sq, D]
    LSE = log(sum_j exp(S_ij))   # [B, H, Sq]       the one number per row that backward needs to rebuild P

Everything is computed in float64 on whatever device the inputs live on, so the reference's own rounding
error (about 1e-16 relative) is far below any tolerance we test with.
"""
from __future__ import annotations

import math

import torch


def causal_mask(n_q: int, n_k: int, device=None) -> torch.Tensor:
    """True where query i may look at key j: j <= i (queries and keys aligned at position 0)."""
    rows = torch.arange(n_q, device=device)[:, None]
    cols = torch.arange(n_k, device=device)[None, :]
    return cols <= rows  # [Sq, Sk]


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                        softmax_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(out, lse)`` in float64 for q [..., Sq, D], k and v [..., Sk, D].

    Differentiable: call it on float64 leaves with ``requires_grad`` to get reference gradients.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    q64, k64, v64 = q.double(), k.double(), v.double()
    scores = (q64 @ k64.transpose(-1, -2)) * scale  # [..., Sq, Sk]
    if causal:
        scores = scores.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [..., Sq]
    probs = torch.exp(scores - lse[..., None])  # softmax written through the LSE: the same P backward rebuilds
    out = probs @ v64  # [..., Sq, D]
    return out, lse


def attention_reference_grads(q, k, v, dout, causal=False, softmax_scale=None):
    """Float64 ``(out, lse, dq, dk, dv)`` for the upstream gradient ``dout`` (autograd through the naive graph)."""
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    out, lse = attention_reference(q64, k64, v64, causal=causal, softmax_scale=softmax_scale)
    dq, dk, dv = torch.autograd.grad(out, (q64, k64, v64), dout.double())
    return out.detach(), lse.detach(), dq, dk, dv


# Tolerances for comparing an implementation to this reference, per input dtype, as the largest error
# relative to the largest reference value: max|actual - ref| / max|ref|. Reasons:
# - float32: rounding of fp32 accumulations, ~1e-6 measured on CPU. On a GPU, Triton's tl.dot on fp32 inputs
#   uses TF32 (10-bit mantissa) unless told otherwise; our kernels ask for IEEE fp32 unless
#   torch.backends.cuda.matmul.allow_tf32 is set, and tf32_tolerances() gives the looser bound for that case.
# - float16 (unit roundoff 2^-11 = 4.9e-4): inputs and the output are rounded, and the kernel rounds P and dS
#   to fp16 before their matmuls; ~7e-4 measured.
# - bfloat16 (unit roundoff 2^-8 = 3.9e-3): the same roundings with 3 fewer mantissa bits; ~1.2e-2 measured.
# The LSE is compared in absolute terms (it is a log, and every implementation keeps it in fp32).
# Each bound is 3-5x the worst error measured over shapes 17..100 x head dims 16..128, causal and not.
RELATIVE_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}
LSE_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 1e-4, torch.bfloat16: 1e-4}


def tf32_tolerances() -> tuple[float, float]:
    """(relative, lse) bounds for fp32 inputs multiplied in TF32 on a GPU."""
    return 5e-3, 1e-2


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max|actual - expected| / max|expected|, in float64 (nan if actual has a nan)."""
    diff = (actual.detach().double() - expected.detach().double()).abs().max()
    return (diff / expected.detach().double().abs().max().clamp_min(1e-300)).item()


def assert_close_to_reference(name: str, actual: torch.Tensor, expected: torch.Tensor, tolerance: float,
                              relative: bool = True) -> None:
    """Raise AssertionError naming the tensor and the size of the miss; nan/inf where the reference is finite fail.

    ``relative``: compare ``relative_error`` (outputs, gradients); else the largest absolute error (the LSE).
    """
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} differs from the reference {tuple(expected.shape)}")
    if not torch.isfinite(actual[torch.isfinite(expected)]).all():
        raise AssertionError(f"{name}: contains nan or inf where the reference is finite")
    if relative:
        err, kind = relative_error(actual, expected), "relative"
    else:
        err, kind = (actual.detach().double() - expected.detach().double()).abs().max().item(), "absolute"
    if not err <= tolerance:  # written so that a nan error fails too
        raise AssertionError(f"{name}: {kind} error {err:.3g} exceeds the tolerance {tolerance:.3g}")
