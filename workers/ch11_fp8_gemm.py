"""An FP8 GEMM against bf16 on one GPU: time and error, both against an fp32 reference.

    torchrun --nproc-per-node 1 workers/ch11_fp8_gemm.py --size 8192

FP8 inputs are E4M3 with one scale per tensor (current scaling: scale = 448 / amax), multiplied by
``torch._scaled_mm`` (the cuBLASLt FP8 path, tensor cores with fp32 accumulation, bf16 output); the same GEMM in
bf16 is ``a @ b``. The error of each is measured against ``a.float() @ b.float()``, the relative Frobenius norm.
Without a GPU there is nothing to time: the worker says so and returns, and the notebook shows the FP8 error
emulated on the CPU instead (``course_utils.fp8``), labelled as such.
"""
from __future__ import annotations

import torch

from workers.provenance import record
from workers.runtime import entrypoint
from workers.timing.cuda import median_ms

E4M3_MAX = 448.0  # Micikevicius et al. 2022, Table 1


def _to_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor current scaling: (fp8 data, dequantisation scale = amax / 448)."""
    amax = x.abs().amax().float().clamp(min=1e-12)
    scale = E4M3_MAX / amax
    return (x.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), (1.0 / scale).reshape(())


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref).norm() / ref.norm())


def main(ctx, size: int = 8192, repeats: int = 20, warmup: int = 3):
    if ctx.device.type != "cuda":
        return {"available": False,
                "reason": "no GPU on this rank: an FP8 GEMM needs tensor cores (H100/H200/Ada or newer)"}
    if not hasattr(torch, "_scaled_mm"):
        return {"available": False, "reason": f"torch {torch.__version__} has no torch._scaled_mm"}
    g = torch.Generator(device=ctx.device).manual_seed(0)
    a = torch.randn(size, size, device=ctx.device, generator=g, dtype=torch.bfloat16)  # [M, K]
    b = torch.randn(size, size, device=ctx.device, generator=g, dtype=torch.bfloat16)  # [K, N]
    reference = a.float() @ b.float()  # [M, N]
    flops = 2.0 * size**3

    a8, sa = _to_e4m3(a)  # [M, K] row-major
    bt8, sb = _to_e4m3(b.t().contiguous())  # [N, K] row-major, so bt8.t() is the column-major [K, N] cuBLASLt wants

    def fp8():
        out = torch._scaled_mm(a8, bt8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
        return out[0] if isinstance(out, tuple) else out

    def bf16():
        return a @ b

    out = {"available": True, "size": size, "provenance": record("workers.ch11_fp8_gemm", device=ctx.device)}
    for name, fn in (("bf16", bf16), ("fp8_e4m3_per_tensor", fp8)):
        try:
            result = fn()
            ms = median_ms(fn, repeats, warmup=warmup)  # CUDA events around each call (workers/timing/cuda.py)
            out[name] = {"ms": ms, "tflops": flops / (ms * 1e-3) / 1e12, "rel_error": _rel_err(result, reference)}
        except Exception as exc:  # noqa: BLE001 - an unsupported GPU or torch build: report it, do not crash
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    out["quantisation_only_rel_error"] = _rel_err((a8.float() * sa) @ (bt8.float() * sb).t(), reference)
    return out


if __name__ == "__main__":
    entrypoint(main)
