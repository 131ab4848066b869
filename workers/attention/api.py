"""One entry point for the course's attention implementations.

    out = flash_attention(q, k, v, causal=True)                 # q, k, v: [B, H, S, D] or [B, S, D]
    out, lse = flash_attention(q, k, v, return_lse=True)       # lse: [B, H, S] (or [B, S]), float32, natural log

The log-sum-exp is what the forward saves for backward (one tensor per call, the queries' leading shape: one
(batch, queries) slice per head, [B, Sq] for 3-D inputs), so ``ctx.saved_tensors`` holds it in the layout returned.

``impl``: "torch" is the tiled PyTorch version (``tiled.py``: readable, runs anywhere); "triton" the Triton
kernels (``triton_kernels.py``: CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``); "auto" picks
Triton for CUDA tensors when Triton is installed and head_dim is 16..128, and the PyTorch version otherwise.
Triton is imported only when a Triton path is taken, so a laptop without it still has the PyTorch path.
"""
from __future__ import annotations

import importlib.util

import torch

from workers.attention.tiled import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, tiled_flash_attention

IMPLS = ("auto", "torch", "triton")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _pick_impl(impl: str, q: torch.Tensor) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    return "triton" if (q.is_cuda and triton_available() and 16 <= q.shape[-1] <= 128) else "torch"


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, impl: str = "auto",
                    softmax_scale: float | None = None, return_lse: bool = False,
                    block_q: int = DEFAULT_BLOCK_Q, block_k: int = DEFAULT_BLOCK_K, configs: dict | str | None = None):
    """softmax(q k^T * scale [+ causal mask]) v without materialising the score matrix; differentiable.

    q: [B, H, Sq, D] or [B, Sq, D]; k, v: [B, H, Sk, D] or [B, Sk, D]. ``scale`` defaults to 1/sqrt(D).
    ``block_q``/``block_k`` tile the PyTorch version; ``configs`` pins the Triton kernels' tiles instead of
    autotuning them: a dict per kernel, or "default" (see ``triton_kernels.triton_flash_attention``).
    """
    if not (q.dim() == k.dim() == v.dim()) or q.dim() not in (3, 4):
        raise ValueError(f"q, k, v must all be 4-D (batch, heads, seq, head_dim) or all 3-D (batch, seq, head_dim), "
                         f"got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must agree in batch, "
                         "heads and head_dim, and k and v in sequence length")
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(f"causal attention needs as many queries as keys, got {q.shape[-2]} and {k.shape[-2]}")

    chosen = _pick_impl(impl, q)  # both versions take 3-D (one head) as it is and save lse as [B, Sq] then
    if chosen == "triton":
        try:
            from workers.attention.triton_kernels import triton_flash_attention  # imports triton: only here
        except ImportError as exc:
            raise ImportError(f"impl='triton' needs the triton package ({exc}); install it or use impl='torch'") \
                from exc
        out, lse = triton_flash_attention(q, k, v, causal, softmax_scale, configs)
    else:
        out, lse = tiled_flash_attention(q, k, v, causal, softmax_scale, block_q, block_k)
    return (out, lse) if return_lse else out


def online_softmax_merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """Combine attention over two disjoint sets of keys into attention over their union.

    Each part is normalised on its own: out_x = sum_{j in x} exp(s_j - lse_x) v_j with lse_x = log sum_{j in x}
    exp(s_j). Over the union, lse = log(exp(lse_a) + exp(lse_b)) and each part is reweighted by its share of
    the total mass, exp(lse_x - lse). This is the step that lets a ring of ranks (context parallelism) or two
    tiles combine partial results. Shapes: out [..., S, D], lse [..., S]; returns ``(out, lse)``.
    A part with lse = -inf (it saw no keys) gets weight 0; if both are empty the output is 0, not nan.
    """
    cdt = torch.promote_types(torch.promote_types(out_a.dtype, lse_a.dtype), torch.float32)  # fp32, or fp64
    lse_a, lse_b = lse_a.to(cdt), lse_b.to(cdt)
    lse = torch.logaddexp(lse_a, lse_b)  # [..., S]
    lse_safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)  # avoid -inf - -inf = nan
    weight_a = torch.exp(lse_a - lse_safe)[..., None]  # [..., S, 1]  share of the softmax mass from part a
    weight_b = torch.exp(lse_b - lse_safe)[..., None]  # [..., S, 1]
    out = weight_a * out_a.to(cdt) + weight_b * out_b.to(cdt)  # [..., S, D]
    return out.to(out_a.dtype), lse
