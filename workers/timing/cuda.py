"""The one way a rank times GPU work: CUDA events around each call, after untimed warm-up calls.

    from workers.timing.cuda import median_ms, times_ms
    ms = median_ms(lambda: a @ b, 20, warmup=3)                           # one number
    each = times_ms(step, 10, warmup=2, device=x.device, setup=zero_grad)  # every call's ms

Kernels launch asynchronously: a host clock read when ``fn()`` returns measures the launch, not the work. So
``times_ms`` synchronizes after the warm-up calls (the first call of a kernel compiles, autotunes or warms the
allocator: never time it), then, for each timed call, records a CUDA event on the stream, calls ``fn``, records
a second event and synchronizes: ``start.elapsed_time(end)`` is the GPU time between the two, in milliseconds.
One synchronize per call keeps the calls apart, so each has its own time and a median over them shrugs off a
slow one; the price is that the GPU idles for a launch between calls, so a call shorter than its launch overhead
is timed with that overhead. ``setup`` (clearing ``.grad``, say) runs before every call, outside the timed
window. On a CPU device there are no events: the host clock (``time.perf_counter``) around the same call times
it, which is what a CPU rehearsal of a GPU benchmark and the tests run. ``median_ms`` is the median of
``times_ms`` (``statistics.median``: for an even count, the mean of the two middle calls); ``reps_for`` says how
many calls of a measured length fill a time budget, between a floor and a ceiling.

Users: ``workers/attention/bench.py`` (chapter 07's attention sweep), ``workers/ch11_fp8_gemm.py`` (chapter 11's
FP8 GEMM) and ``tools/gpu/tp_block_bench.py`` (the Megatron block against a plain one). ``workers/ch06_profile.py``
times segments of one step with its own events and is not (yet) one of them.

Why a package of its own: timing is no chapter's topic but every measuring chapter's tool, and ``workers/`` keeps
imported code in topic packages (docs/CONTRIBUTING.md, "Where files go"). ``collectives/`` holds chapter 01's
reference results of collectives and ``attention/`` chapter 07's kernels; putting the helper in either would make
chapter 11 and the block bench import an unrelated chapter's package. It lives on the rank side because ranks and
the GPU tools use it and the rank side never imports ``course_utils``; it imports only torch.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

_now = time.perf_counter  # the host clock of the CPU path (a name of its own so the tests can replace it)


def _is_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def times_ms(fn: Callable[[], object], reps: int, *, warmup: int = 0, device="cuda",
             setup: Callable[[], object] | None = None) -> list[float]:
    """Milliseconds of each of ``reps`` calls of ``fn()``, after ``warmup`` untimed calls.

    ``device``: where ``fn``'s work runs; CUDA events time a CUDA device, the host clock any other. ``setup()``,
    if given, runs before every call (warm-up ones too), outside the timed window. What ``fn`` returns is dropped.
    """
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"reps must be a whole number of at least 1, got {reps!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be a whole number of at least 0, got {warmup!r}")
    cuda = _is_cuda(device)
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        if setup is not None:
            setup()
        if cuda:
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = _now()
            fn()
            times.append((_now() - t0) * 1e3)
    return times


def median_ms(fn: Callable[[], object], reps: int, *, warmup: int = 0, device="cuda",
              setup: Callable[[], object] | None = None) -> float:
    """The median of ``times_ms(fn, reps, ...)``: the typical call, robust to a stray slow one."""
    return statistics.median(times_ms(fn, reps, warmup=warmup, device=device, setup=setup))


def reps_for(target_ms: float, one_call_ms: float, min_reps: int = 5, max_reps: int = 100) -> int:
    """How many calls of ``one_call_ms`` fill ``target_ms``, at least ``min_reps`` and at most ``max_reps`` (a call
    timed under a microsecond counts as one microsecond, so a too-fast pilot call cannot ask for unbounded reps)."""
    return int(min(max_reps, max(min_reps, target_ms / max(one_call_ms, 1e-3))))
