"""Issue 5's GPU benchmark, for a session with the H200 (run through the device tool; never in CI).

    python tools/gpu/tp_block_bench.py --out "$OUT/tp_block_h200.json" --trace-dir "$OUT/traces"

In one run, on one GPU, bf16, h=4096, 32 heads, s in {1024, 4096} (batch 8 and 2: 8192 tokens each):

* the course's Megatron block at TP 1 (``workers/parallel/block.py: ParallelBlock``, a world of one rank),
  forward + backward: median time and TFLOP/s;
* a plain PyTorch pre-LN block of the same shape (LayerNorm, fused QKV Linear, causal SDPA, GeLU MLP,
  batch-first), with the same weights: the bar to meet (issue 5: within 10%);
* a bf16 8192^3 matmul: the machine's practical peak in the same run;
* activation memory kept for backward by the course block, with and without full recomputation
  (``torch.utils.checkpoint``), next to Korthikanti et al.'s sbh(34 + 5as/h) and 2sbh
  (``course_utils.ledger.activation_bytes_per_layer``);
* optionally (``--profile``) the chapter 06 per-segment profile on the GPU (CUDA events) with a
  ``torch.profiler`` trace per sequence length.

FLOPs are counted as 3 x (24bsh^2 + 2bs^2h) per layer (forward + backward = 3x forward; causal attention
computes half of the s^2 terms), the convention of the shared H200 baseline; the non-causal count
3 x (24bsh^2 + 4bs^2h) is stored too. Writes JSON with device, versions, date and the command.
``--device cpu`` with a tiny shape runs the same code on the CPU: that is what the tests do.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from workers.provenance import record  # noqa: E402
from workers.timing.cuda import times_ms  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def block_flops(batch: int, seq: int, hidden: int, *, causal: bool = True) -> float:
    """Forward + backward FLOPs of one layer: 3 x (24bsh^2 + 4bs^2h), the s^2 terms halved when causal."""
    b, s, h = batch, seq, hidden
    return 3.0 * (24 * b * s * h * h + (2 if causal else 4) * b * s * s * h)


class PlainBlock(nn.Module):
    """The bar: a pre-LN block written the obvious way, batch-first, one fused QKV Linear, causal SDPA, GeLU MLP."""

    def __init__(self, hidden: int, heads: int, device=None, dtype=None):
        super().__init__()
        self.heads, self.d = heads, hidden // heads
        kw = dict(device=device, dtype=dtype)
        self.ln1, self.ln2 = nn.LayerNorm(hidden, **kw), nn.LayerNorm(hidden, **kw)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden, **kw), nn.Linear(hidden, hidden, **kw)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden, **kw), nn.Linear(4 * hidden, hidden, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, s, h]
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, self.d).permute(2, 0, 3, 1, 4)  # [3, b, H, s, d]
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    def load_course(self, block) -> None:
        """Copy the weights of a course block (``ParallelBlock`` at TP 1 or ``DenseBlock``)."""
        src = {n: p.detach() for n, p in block.named_parameters()}
        names = {"ln1": "ln1", "ln2": "ln2", "qkv": "attention.qkv", "proj": "attention.proj", "fc1": "mlp.fc1",
                 "fc2": "mlp.fc2"}
        with torch.no_grad():
            for mine, theirs in names.items():
                getattr(self, mine).weight.copy_(src[f"{theirs}.weight"])
                getattr(self, mine).bias.copy_(src[f"{theirs}.bias"])


def init_single_rank_group() -> None:
    """The course block's regions ask the process group for its size: a world of one, no communication."""
    import torch.distributed as dist

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def course_block(hidden: int, heads: int, device, dtype):
    from workers.parallel.block import ParallelBlock
    from workers.model.dense import BlockConfig

    init_single_rank_group()
    return ParallelBlock(BlockConfig(hidden=hidden, heads=heads), device=device, dtype=dtype)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_fwd_bwd(fn, x: torch.Tensor, grad: torch.Tensor, *, iters: int, warmup: int) -> dict:
    """Median seconds of forward + backward (``workers/timing/cuda.py``: CUDA events on a GPU, perf_counter on the
    CPU), ``x.grad`` cleared before each call, outside the timed window."""
    def clear_grad():
        x.grad = None

    times = [ms / 1e3 for ms in times_ms(lambda: fn(x).backward(grad), iters, warmup=warmup, device=x.device,
                                         setup=clear_grad)]
    return {"median_s": statistics.median(times), "min_s": min(times), "iters": iters}


def matmul_tflops(n: int, device, dtype, *, iters: int = 20) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    _sync(device)
    return 2 * n**3 * iters / (time.perf_counter() - t0) / 1e12


def activation_memory(block, x: torch.Tensor, *, recompute: bool) -> float | None:
    """Bytes a forward keeps for backward (input included), measured with the CUDA allocator; None on a CPU."""
    if x.device.type != "cuda":
        return None
    from torch.utils.checkpoint import checkpoint

    x = x.detach().requires_grad_()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before - y.numel() * y.element_size() + x.numel() * x.element_size()
    y.backward(torch.ones_like(y))
    del y
    return float(kept)


def bench_shape(hidden: int, heads: int, seq: int, batch: int, device, dtype, *, iters: int, warmup: int) -> dict:
    from course_utils.ledger import activation_bytes_per_layer

    torch.manual_seed(0)
    course = course_block(hidden, heads, device, dtype)
    plain = PlainBlock(hidden, heads, device=device, dtype=dtype)
    plain.load_course(course)
    x_sbh = torch.randn(seq, batch, hidden, device=device, dtype=dtype, requires_grad=True)
    x_bsh = x_sbh.detach().transpose(0, 1).contiguous().requires_grad_()
    with torch.no_grad():  # the same function: the comparison is the point of the benchmark
        diff = (course(x_sbh).transpose(0, 1).float() - plain(x_bsh).float()).abs().max().item()
    g_sbh, g_bsh = torch.randn_like(x_sbh), None
    g_bsh = g_sbh.transpose(0, 1).contiguous()
    flops, flops_full = block_flops(batch, seq, hidden), block_flops(batch, seq, hidden, causal=False)
    rows = {}
    for name, fn, x, g in (("course_block", course, x_sbh, g_sbh), ("plain_block", plain, x_bsh, g_bsh)):
        t = time_fwd_bwd(fn, x, g, iters=iters, warmup=warmup)
        rows[name] = {**t, "tflops": flops / t["median_s"] / 1e12, "tflops_noncausal_count": flops_full / t["median_s"] / 1e12}
    rows["course_vs_plain_time"] = rows["course_block"]["median_s"] / rows["plain_block"]["median_s"]
    sbh = seq * batch * hidden
    nbytes = torch.finfo(dtype).bits // 8
    memory = {
        "measured_bytes": activation_memory(course, x_sbh, recompute=False),
        "measured_bytes_recompute": activation_memory(course, x_sbh, recompute=True),
        "korthikanti_none_bytes": activation_bytes_per_layer(seq, batch, hidden, heads) * nbytes / 2,
        "korthikanti_selective_bytes": activation_bytes_per_layer(seq, batch, hidden, heads, recompute="selective")
        * nbytes / 2,
        "korthikanti_full_bytes": activation_bytes_per_layer(seq, batch, hidden, heads, recompute="full") * nbytes / 2,
        "sbh": sbh, "note": "Korthikanti et al. 2022 Table 2 assumes 16-bit activations and 1-byte dropout masks; "
                            "scaled here by bytes/2 for the dtype used; this block has no dropout and its SDPA "
                            "may not store the s x s scores",
    }
    if torch.device(device).type == "cuda":
        memory["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    return {"seq": seq, "batch": batch, "hidden": hidden, "heads": heads, "flops_per_step": flops,
            "max_abs_diff_course_vs_plain": diff, **rows, "activation_memory": memory}


def environment(device: str | None = None) -> dict:
    """``{"provenance": workers.provenance.record(...)}`` for the device measured, plus cuDNN's version on a GPU."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    env = {"provenance": record(" ".join(["python tools/gpu/tp_block_bench.py"] + sys.argv[1:]), device=device)}
    if torch.device(device).type == "cuda":
        env["cudnn"] = torch.backends.cudnn.version()
    return env


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "data" / "gpu" / "tp_block_h200.json")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--shapes", default="1024x8,4096x2", help="seq x batch, comma-separated")
    p.add_argument("--matmul", type=int, default=8192)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--profile", action="store_true", help="also run the chapter 06 per-segment profile")
    p.add_argument("--trace-dir", default="", help="write torch.profiler traces here (with --profile)")
    a = p.parse_args(argv)
    dtype = DTYPES[a.dtype]
    result = {**environment(a.device), "dtype": a.dtype,
              "matmul": {"n": a.matmul, "tflops": matmul_tflops(a.matmul, a.device, dtype)}, "shapes": []}
    print(f"matmul {a.matmul}^3 {a.dtype}: {result['matmul']['tflops']:.1f} TFLOP/s", flush=True)
    for shape in a.shapes.split(","):
        seq, batch = (int(v) for v in shape.lower().split("x"))
        row = bench_shape(a.hidden, a.heads, seq, batch, a.device, dtype, iters=a.iters, warmup=a.warmup)
        row["course_fraction_of_matmul"] = row["course_block"]["tflops"] / result["matmul"]["tflops"]
        row["plain_fraction_of_matmul"] = row["plain_block"]["tflops"] / result["matmul"]["tflops"]
        result["shapes"].append(row)
        print(json.dumps({k: row[k] for k in ("seq", "batch", "course_vs_plain_time", "max_abs_diff_course_vs_plain")})
              + f" course {row['course_block']['tflops']:.1f} / plain {row['plain_block']['tflops']:.1f} TFLOP/s",
              flush=True)
        if torch.device(a.device).type == "cuda":
            torch.cuda.empty_cache()
    if a.profile:
        import course_utils as cu

        profiles = []
        for shape in a.shapes.split(","):
            seq, batch = (int(v) for v in shape.lower().split("x"))
            res = cu.run("workers.ch06_profile", world_size=1, timeout=300, warm=False, hidden=a.hidden,
                         heads=a.heads, seqs=[seq], batch=batch, dtype=a.dtype, repeats=a.iters, warmup=a.warmup,
                         trace_dir=a.trace_dir)
            profiles += res[0]["profiles"]
        result["profile"] = profiles
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}", flush=True)
    return result


if __name__ == "__main__":
    main()
    os._exit(0)  # the single-rank gloo group has no peers to say goodbye to
