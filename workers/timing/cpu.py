"""Timing on one CPU rank, with the course's thread settings: ``timed``'s loop (warm-up, then repeats of a loop of
calls lasting a target time; the median, min and max of the repeats' per-call means), and what ``workers/calibrate.py``
times with it alone on a core: a matmul, the fixed cost of an eager op, of an op autograd records and of a
``backward()`` call, a tiny ``nn.Linear`` step, one AdamW step over a layer of chapter 15's GPT, fused causal
attention and GELU forward and forward + backward, and a large copy and add. Kept apart from the rank script so a
test (or a chapter) can time these in its own process, and so that ``course_utils.calibration`` can tell when a stored
calibration was measured by other code (its cache key hashes this file with the worker's)."""
from __future__ import annotations

import statistics
import time

import torch

DTYPES = {"float32": torch.float32, "float64": torch.float64}
CHAIN = (1, 2, 4, 8, 16)  # ops per autograd chain: the slope in K is one op's cost
ATTENTION_SHAPES = ((8, 16, 4), (64, 16, 4), (512, 16, 4), (16, 128, 32))  # (batch x heads, seq, head_dim)
ACTIVATION_SIZES = (1024, 16384, 262144)  # elements: chapter 15's MLP is [micro-batch x 16 tokens, 128 / tp]
SHORTER = 10  # the kernels' repeats: SHORTER times as many, each SHORTER times shorter (measure_kernels)
# one layer of chapter 15's GPT at hidden 32, ffn 128 (two LayerNorms, QKV, output projection, the MLP's two)
ADAMW_SHAPES = ((32,), (32,), (96, 32), (96,), (32, 32), (32,), (32,), (32,), (128, 32), (128,), (32, 128), (32,))


def stats(samples: list[float]) -> dict:
    """Median, min, max, count, and the mean of the middle 80% (what a run of many such calls costs on average,
    without the rare preemption by another program)."""
    cut = len(samples) // 10
    middle = sorted(samples)[cut:len(samples) - cut]
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "samples": len(samples),
            "mean": statistics.fmean(middle)}


def timed(fn, repeats: int, target_s: float) -> dict:
    """Seconds per call of ``fn``: warm-up calls, then ``repeats`` repeats of a loop of ``inner`` calls lasting
    about ``target_s``; the median (and min, max) of the repeats' per-call means, and ``inner``."""
    fn()
    start = time.perf_counter()
    fn()
    fn()
    one = (time.perf_counter() - start) / 2
    inner = max(1, min(20000, round(target_s / max(one, 1e-8))))
    for _ in range(min(inner, 50)):  # warm the loop itself (allocator, caches, branch predictors)
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - start) / inner)
    return {**stats(samples), "inner": inner}


def matmul_fn(dtype, m: int, n: int, k: int):
    a = torch.randn(m, k, dtype=dtype)  # [m, k]
    b = torch.randn(k, n, dtype=dtype)  # [k, n]
    return lambda: a @ b  # [m, n], allocated as a model's product is


def op_fn():
    a, b = torch.ones(8), torch.ones(8)
    return lambda: a + b  # one eager op, allocating its output


def chain_fns(length: int):
    """Forward-only (graph recorded) and forward + backward of ``length`` ops ``y = y * w_i`` (each w_i a leaf)."""
    x = torch.ones(8)
    ws = [torch.ones(8, requires_grad=True) for _ in range(length)]

    def forward():
        y = x
        for w in ws:
            y = y * w
        return y

    def forward_backward():
        for w in ws:
            w.grad = None
        forward().sum().backward()

    return forward, forward_backward


def linear_fn():
    lin = torch.nn.Linear(32, 32)
    x = torch.randn(8, 32)  # [batch, in]

    def step():
        lin.weight.grad = lin.bias.grad = None
        lin(x).sum().backward()

    return step


def leaf_fns(op, leaves, grad):
    """Forward (graph recorded, as in training) and forward + backward of ``op(*leaves)``."""
    def forward():
        return op(*leaves)

    def forward_backward():
        for x in leaves:
            x.grad = None
        forward().backward(grad)

    return forward, forward_backward


def attention_fns(dtype, batch_heads: int, seq: int, head_dim: int):
    """Causal SDPA on leaves q, k, v of [1, batch x heads, seq, head_dim]."""
    q, k, v = (torch.randn(1, batch_heads, seq, head_dim, dtype=dtype, requires_grad=True) for _ in range(3))
    return leaf_fns(lambda *qkv: torch.nn.functional.scaled_dot_product_attention(*qkv, is_causal=True), (q, k, v),
                     torch.randn(1, batch_heads, seq, head_dim, dtype=dtype))


def activation_fns(dtype, elements: int):
    """``F.gelu`` (exact erf form, as the course's MLPs call it) on ``elements`` values."""
    x = torch.randn(elements, dtype=dtype, requires_grad=True)
    return leaf_fns(torch.nn.functional.gelu, (x,), torch.randn(elements, dtype=dtype))


def measure_kernels(dtypes, repeats: int, target_s: float) -> dict:
    """Seconds of fused causal attention and of the activation function, forward and forward + backward (each
    includes its ``backward()`` call, as a training step's share of one).

    Each is the least of the repeats, not their median: the planner prices backward as the difference of the two,
    and on a busy machine (another program preempting these loops of a few milliseconds) two medians of a few
    repeats can invert it (a CI run measured a forward longer than its forward + backward). Preemption only adds
    time, so the least repeat is the kernel undisturbed; the planner applies the contention it measures separately.
    And the least of many short loops: ``SHORTER`` times as many repeats, each that much shorter (the same seconds in
    all), since a preemption lands in a loop with a chance that grows with its length. Measured on 2 cores with two
    busy loops and six processes waking every 0.3 ms beside it (ATEN_CPU_CAPABILITY=default, 3 repeats of 0.2 ms as
    tests/test_calibration.py asks): a forward came out longer than its forward + backward in 11 of 60 calibrations
    with the repeats as given, 2 of 60 five times shorter, 0 of 60 ten times shorter."""
    def least(fn) -> float:
        return timed(fn, SHORTER * repeats, target_s / SHORTER)["min"]

    attention, activation = [], []
    for dtype in dtypes:
        for bh, seq, hd in ATTENTION_SHAPES:
            f, fb = attention_fns(DTYPES[dtype], bh, seq, hd)
            attention.append({"dtype": dtype, "batch_heads": bh, "seq": seq, "head_dim": hd,
                              "forward_s": least(f), "forward_backward_s": least(fb)})
        for n in ACTIVATION_SIZES:
            f, fb = activation_fns(DTYPES[dtype], n)
            activation.append({"dtype": dtype, "elements": n, "forward_s": least(f), "forward_backward_s": least(fb)})
    return {"attention": attention, "activation": activation}


def adamw_fn(shapes=ADAMW_SHAPES):
    """One AdamW step over float64 parameters of ``shapes`` (chapter 15's betas, eps and weight decay), past the first
    (which creates the state): on CPU torch steps one parameter at a time (``foreach`` is for CUDA tensors)."""
    params = [torch.zeros(shape, dtype=torch.float64, requires_grad=True) for shape in shapes]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    opt.step()
    return opt.step


def backward_call_fn():
    """``x.sum().backward()`` on a leaf: the fixed cost of a ``backward()`` call and the sum before it, timed. (The
    intercept of the chain's line at no ops estimates the same cost, but on a loaded machine its noise exceeds the
    cost and the intercept went below zero: -80 us on 2 busy cores.)"""
    x = torch.ones(8, requires_grad=True)

    def call():
        x.grad = None
        x.sum().backward()
    return call


def fit_line(xs, ys) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys over xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def measure_ops(repeats: int, target_s: float) -> dict:
    op = timed(op_fn(), repeats, target_s)
    fwd, fwd_bwd = [], []
    for length in CHAIN:
        f, fb = chain_fns(length)
        fwd.append(timed(f, repeats, target_s)["median"])
        fwd_bwd.append(timed(fb, repeats, target_s)["median"])
    f0, f1 = fit_line(CHAIN, fwd)
    c0, c1 = fit_line(CHAIN, fwd_bwd)
    return {"op_s": op["median"], "op": op, "chain": list(CHAIN), "chain_forward_s": fwd,
            "chain_forward_backward_s": fwd_bwd, "op_forward_s": f1, "op_forward_backward_s": c1,
            "backward_call_s": timed(backward_call_fn(), repeats, target_s)["median"],
            "backward_intercept_s": c0, "forward_intercept_s": f0,
            "linear_forward_backward_s": timed(linear_fn(), repeats, target_s)["median"],
            "adamw_step_s": timed(adamw_fn(), repeats, target_s)["median"],
            "adamw_shapes": [list(s) for s in ADAMW_SHAPES]}


def measure_stream(mib: int, repeats: int) -> dict:
    n = (mib << 20) // 4
    a, b, c = torch.ones(n), torch.ones(n), torch.empty(n)
    copy = timed(lambda: c.copy_(a), repeats, 0.0)  # read a, write c
    add = timed(lambda: torch.add(a, b, out=c), repeats, 0.0)  # read a and b, write c
    nbytes = n * 4
    return {"bytes": nbytes, "copy_s": copy["median"], "add_s": add["median"],
            "copy_bytes_per_s": 2 * nbytes / copy["median"], "add_bytes_per_s": 3 * nbytes / add["median"]}
