"""Attention on one GPU, side by side: every SDPA backend, flash_attn if installed, and the course's kernels.

    python -m workers.attention.bench --out results.json            # the full sweep (chapter 07)
    python -m workers.attention.bench --out quick.json --quick      # N in {1024, 4096, 16384}, head dim 128

For each head dim, causal flag and sequence length (bf16, batch 2, 16 heads by default) and each
implementation: median forward and forward+backward latency over CUDA events, TFLOP/s, and the peak memory
the call allocated on top of its inputs (``torch.cuda.max_memory_allocated`` delta), plus the largest
difference of its output from SDPA's flash backend on the same inputs.

FLOPs follow the convention of ``shared/reference/h200_attention_baseline.json``: 4 * B * H * N^2 * D for the
forward (two matmuls), halved when causal, and 3.5x that for forward+backward.

Implementations: ``sdpa_math``, ``sdpa_efficient``, ``sdpa_flash``, ``sdpa_cudnn`` (through
``torch.nn.attention.sdpa_kernel``), ``flash_attn`` (the flash-attn package, only if it is installed; it takes
(B, S, H, D) and gets strided views of the same tensors, no copies), ``course_torch`` (``workers/attention/tiled.py``
with 1024-wide tiles: a Python loop of PyTorch ops, there to show what the fused kernel buys) and
``course_triton`` (``workers/attention/triton_kernels.py``, autotuned; the chosen tile config is recorded).
The math backend materialises N x N matrices; it is skipped where its estimated footprint exceeds
``--math-max-gib``. Everything that fails (out of memory, no kernel for these inputs) is recorded, not fatal.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import sys
import time

import torch

from workers.provenance import record
from workers.timing.cuda import reps_for, times_ms

DEFAULT_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_SEQLENS = (1024, 4096, 16384)
SDPA_IMPLS = ("sdpa_math", "sdpa_efficient", "sdpa_flash", "sdpa_cudnn")
ALL_IMPLS = SDPA_IMPLS + ("flash_attn", "course_torch", "course_triton")
MODES = ("fwd", "fwdbwd")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
COURSE_TORCH_BLOCK = 1024
# The math backend upcasts bf16/fp16 to fp32 and keeps several N x N matrices: one H200 run peaked at about
# 3.6 fp32 N x N copies in forward. Budget 5 copies for forward+backward.
MATH_SCORE_COPIES = 5

NO_GPU_MESSAGE = ("the attention benchmark needs a CUDA GPU and none is visible here, so nothing was measured "
                  "(run it on a GPU machine; the committed results can be plotted anywhere).")


# ----------------------------------------------------------------------------------------------------------
# CPU-safe helpers (tested without a GPU)
# ----------------------------------------------------------------------------------------------------------

def attention_flops(batch: int, heads: int, n: int, head_dim: int, causal: bool, mode: str) -> float:
    """4 B H N^2 D forward, halved when causal, x3.5 for forward+backward."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    flops = 4.0 * batch * heads * n * n * head_dim
    if causal:
        flops /= 2
    return flops * 3.5 if mode == "fwdbwd" else flops


def tflops(flops: float, ms: float | None) -> float | None:
    return None if ms is None or ms <= 0 else flops / (ms * 1e-3) / 1e12


def math_footprint_bytes(batch: int, heads: int, n: int) -> int:
    """Estimated peak of the SDPA math backend: MATH_SCORE_COPIES fp32 N x N matrices per head."""
    return MATH_SCORE_COPIES * batch * heads * n * n * 4


def plan_cases(seqlens, head_dims, causal_flags, impls, batch: int, heads: int, math_max_gib: float) -> list[dict]:
    """Every (head_dim, causal, n, impl) to run, with ``skip`` set to a reason where it will not run."""
    cases = []
    for head_dim in head_dims:
        for causal in causal_flags:
            for n in seqlens:
                for impl in impls:
                    skip = None
                    if impl == "sdpa_math" and math_footprint_bytes(batch, heads, n) > math_max_gib * 2**30:
                        skip = (f"math would hold about {math_footprint_bytes(batch, heads, n) / 2**30:.0f} GiB of "
                                f"N x N matrices (limit --math-max-gib {math_max_gib:g})")
                    cases.append({"head_dim": head_dim, "causal": causal, "n": n, "impl": impl, "skip": skip})
    return cases


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment_info(argv: list[str] | None = None) -> dict:
    """What a result needs to be read later: ``provenance`` (``workers.provenance.record``: device, versions,
    date, command line) and the benchmark's own ``environment`` (flash_attn, cuDNN, the GPU's memory)."""
    env = {
        "flash_attn": _version("flash-attn") or _version("flash_attn"),
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "gpu_memory_gib": None,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   compute_capability=f"{props.major}.{props.minor}")
    command = "python -m workers.attention.bench " + " ".join(sys.argv[1:] if argv is None else argv)
    return {"provenance": record(command.strip()), "environment": env}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m workers.attention.bench", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="where to write the JSON results")
    p.add_argument("--seqlens", default=",".join(map(str, DEFAULT_SEQLENS)))
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--causal", default="both", choices=("both", "true", "false"))
    p.add_argument("--impls", default=",".join(ALL_IMPLS))
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--math-max-gib", type=float, default=48.0)
    p.add_argument("--target-ms", type=float, default=200.0, help="time spent per measurement (sets repetitions)")
    p.add_argument("--quick", action="store_true", help="N in 1024, 4096, 16384 and head dim 128 only")
    p.add_argument("--no-autotune", action="store_true",
                   help="run the course's Triton kernels with their first config (saves the autotuning compiles)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.seqlens, args.head_dims = ",".join(map(str, QUICK_SEQLENS)), "128"
    args.seqlens = [int(x) for x in str(args.seqlens).split(",") if x]
    args.head_dims = [int(x) for x in str(args.head_dims).split(",") if x]
    args.causal_flags = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
    args.impls = [x for x in args.impls.split(",") if x]
    unknown = sorted(set(args.impls) - set(ALL_IMPLS))
    if unknown:
        p.error(f"unknown implementation(s) {unknown}; choose from {list(ALL_IMPLS)}")
    return args


# ----------------------------------------------------------------------------------------------------------
# GPU side
# ----------------------------------------------------------------------------------------------------------

def _sdpa_runner(backend_name: str, q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"sdpa_math": SDPBackend.MATH, "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
               "sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[backend_name]

    def run(q=q, k=k, v=v):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def make_runner(impl: str, q, k, v, causal, triton_configs=None):
    """A callable ``run(q, k, v) -> out [B, H, N, D]`` for one implementation (q, k, v are [B, H, N, D]).

    ``triton_configs``: None to autotune the course's Triton kernels, "default" to pin their first configs.
    """
    if impl in SDPA_IMPLS:
        return _sdpa_runner(impl, q, k, v, causal)
    if impl == "flash_attn":
        from flash_attn import flash_attn_func  # optional: only imported when asked for

        def run(q=q, k=k, v=v):
            # flash_attn takes (B, S, H, D); the transposes are views, .contiguous() copies.
            out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)
            return out.transpose(1, 2)
        return run
    from workers.attention import flash_attention
    if impl == "course_torch":
        return lambda q=q, k=k, v=v: flash_attention(q, k, v, causal=causal, impl="torch",
                                                     block_q=COURSE_TORCH_BLOCK, block_k=COURSE_TORCH_BLOCK)
    if impl == "course_triton":
        return lambda q=q, k=k, v=v: flash_attention(q, k, v, causal=causal, impl="triton", configs=triton_configs)
    raise ValueError(f"unknown implementation {impl!r}")


def time_ms(fn, target_ms: float, min_reps: int = 5, max_reps: int = 100) -> list[float]:
    """Per-call times in ms, CUDA events around each call (``workers/timing/cuda.py``): one warm-up call (the first
    call compiles/tunes), one timed call to size the run, then as many calls as fill ``target_ms``."""
    one_call = times_ms(fn, 1, warmup=1)[0]
    return times_ms(fn, reps_for(target_ms, one_call, min_reps, max_reps))


def peak_mib(fn) -> float:
    """MiB allocated by one call above what was allocated before it (its output included)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del result
    return peak / 2**20


def _triton_config():
    """The configs the autotuner picked last for each course kernel (None where not tuned yet)."""
    try:
        from workers.attention import triton_kernels
    except ImportError:
        return None
    return {name: (str(k.best_config) if getattr(k, "best_config", None) else None)
            for name, k in triton_kernels._tuned.items()}


def measure(impl, q, k, v, dout, causal, flops_fwd, reference, target_ms, triton_configs=None) -> dict:
    row = {}
    run = make_runner(impl, q, k, v, causal, triton_configs)
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))

    def fwd():
        with torch.no_grad():
            return run(q, k, v)

    def fwdbwd():
        out = run(qg, kg, vg)
        return torch.autograd.grad(out, (qg, kg, vg), dout)

    for mode, fn, flops in (("fwd", fwd, flops_fwd), ("fwdbwd", fwdbwd, flops_fwd * 3.5)):
        try:
            times = time_ms(fn, target_ms)
            ms = statistics.median(times)
            row[f"{mode}_ms"] = ms
            row[f"{mode}_tflops"] = tflops(flops, ms)
            row[f"{mode}_reps"] = len(times)
            row[f"{mode}_peak_mib"] = peak_mib(fn)
        except Exception as exc:  # OOM, "no available kernel", compile failure: record and go on
            row[f"{mode}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            torch.cuda.empty_cache()
    if "fwd_ms" in row:
        out = fwd()
        row["out_finite"] = bool(torch.isfinite(out).all())
        if reference is not None:
            row["maxerr_vs_sdpa_flash"] = (out.float() - reference.float()).abs().max().item()
    return row


def run_benchmark(args) -> dict:
    dtype = DTYPES[args.dtype]
    results = {**environment_info(), "config": {
        "batch": args.batch, "heads": args.heads, "dtype": args.dtype, "seqlens": args.seqlens,
        "head_dims": args.head_dims, "causal": args.causal_flags, "impls": args.impls,
        "flops": "4*B*H*N^2*D forward, /2 causal, x3.5 forward+backward",
        "peak": "torch.cuda.max_memory_allocated delta over one call, output included",
        "course_torch_block": COURSE_TORCH_BLOCK, "math_max_gib": args.math_max_gib,
        "triton_autotune": not args.no_autotune}, "rows": []}
    cases = plan_cases(args.seqlens, args.head_dims, args.causal_flags, args.impls, args.batch, args.heads,
                       args.math_max_gib)
    shapes = sorted({(c["head_dim"], c["causal"], c["n"]) for c in cases}, key=lambda s: (s[0], s[1], s[2]))
    for head_dim, causal, n in shapes:
        gen = torch.Generator(device="cuda").manual_seed(args.seed + n + 7 * head_dim + int(causal))
        shape = (args.batch, args.heads, n, head_dim)
        q, k, v, dout = (torch.randn(shape, device="cuda", dtype=dtype, generator=gen) for _ in range(4))
        reference = None
        try:
            with torch.no_grad():
                reference = make_runner("sdpa_flash", q, k, v, causal)()
        except Exception:
            pass
        flops_fwd = attention_flops(args.batch, args.heads, n, head_dim, causal, "fwd")
        for case in [c for c in cases if (c["head_dim"], c["causal"], c["n"]) == (head_dim, causal, n)]:
            row = {"impl": case["impl"], "n": n, "head_dim": head_dim, "causal": causal,
                   "batch": args.batch, "heads": args.heads, "dtype": args.dtype}
            if case["skip"]:
                row["skipped"] = case["skip"]
            elif case["impl"] == "flash_attn" and not results["environment"]["flash_attn"]:
                row["skipped"] = "flash_attn is not installed"
            else:
                t0 = time.perf_counter()
                row.update(measure(case["impl"], q, k, v, dout, causal, flops_fwd, reference, args.target_ms,
                                   "default" if args.no_autotune else None))
                row["wall_s"] = round(time.perf_counter() - t0, 2)
                if case["impl"] == "course_triton":
                    row["triton_configs"] = "default (first GPU config)" if args.no_autotune else _triton_config()
            results["rows"].append(row)
            print(_summary(row), flush=True)
        del q, k, v, dout, reference
        torch.cuda.empty_cache()
    return results


def _summary(row: dict) -> str:
    head = f"{row['impl']:>15} N={row['n']:>6} D={row['head_dim']:>3} causal={row['causal']!s:>5}"
    if "skipped" in row:
        return f"{head}  skipped: {row['skipped']}"
    parts = []
    for mode in MODES:
        if f"{mode}_ms" in row:
            parts.append(f"{mode} {row[f'{mode}_ms']:.3f} ms {row[f'{mode}_tflops']:.0f} TFLOP/s "
                         f"{row[f'{mode}_peak_mib']:.0f} MiB")
        elif f"{mode}_error" in row:
            parts.append(f"{mode} failed ({row[f'{mode}_error']})")
    return f"{head}  " + " | ".join(parts)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_GPU_MESSAGE, file=sys.stderr)
        return 2
    results = run_benchmark(args)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {len(results['rows'])} rows to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
