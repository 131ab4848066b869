"""This machine as a device of chapter 00's planner, and the planner held to the chapters' own runs on it.

``device_from(cal)`` turns a ``MachineCalibration`` (``course_utils/calibration.py``) into a ``Cluster`` that
``step_time`` prices exactly as it prices an H100 node: the matmul rows measured here as its GEMM table (and its
fused attention and activation function timed at the course's shapes: ``attention_rows``, ``activation_rows``), the copy
bandwidth as its memory bandwidth, one op's measured cost as its kernel overhead (serial: a CPU rank dispatches op
after op), the cores its ranks share, and gloo's fitted alpha-beta per collective and world size as both network
tiers (every rank is on this one machine, so every group is "inside the node"). Two choices of the mapping:

* an "op" is an aten op as ``TorchDispatchMode`` sees it, and one costs what the calibration's small ``nn.Linear``
  step costs per op the same counter sees in it (``op_seconds``: module call, autograd and ``backward()``
  included), except in chapter 15's model: the calibration times one micro-batch of it in one process, whole and
  with its ring of 2, and its ops are priced at what they cost there after the priced matmuls, attention and
  memory-bound work (``gpt_op_prices``): a GPT layer's ops carry Python the dispatcher does not see (its modules,
  TP mappings and the ledger's regions), the ring's blocks' ops are bare aten ops, views and slices among them. On
  the 2-core EPYC VM this was written on, quiet calibrations priced a model op at 4.7-4.9 us (the Linear step's
  4.7-4.8) and a ring op at 3.3-4.2 us. Chapter 13's Linear + tanh chunks keep the
  Linear step's price, about 40% above what they cost alone (bare aten ops): its trainer's step around them is
  measured instead (``trainer_step_s``);
* the calibration's ``p2p`` fits are also given under ``send_recv``, the name ``step_time`` prices a pipeline's
  message by: without it ``link_time`` would take the nearest fit of any collective (a 2-rank all_gather);
* with more ranks computing than cores (``device_from(cal, world)``, ``contended``), a rank woken by a message
  waits for the scheduler to give it a core back: a group smaller than the world (a pipeline's message, the tied
  embedding's all-reduce) is priced with the calibration's contended fits (``p2p_busy``, ``all_reduce_busy``:
  measured between two ranks while the others compute), a collective over the whole world keeps its fit (every
  rank in it, as measured). A padded run's ranks sleep through their pads and hold no core: its messages are the
  quiet ones.

``predict(row, cal)`` prices one ``measure_runs`` row with that device:

* chapter 15 (the course's GPT, float64): a ``ModelShape`` of the run's model, a ``Layout`` of its degrees and
  micro-batches, and ``step_time(model, layout, world, cluster, Practice(...))``; the ``Practice`` says how the
  course's trainer runs (float64 activations and gradients, no overlap of the gradient reduction or the ZeRO-1
  all-gather with compute, SDPA's fused kernel for attention, the ring's unfused blocks under context parallelism,
  the ring's exchanges one by one, each waiting for its peer's core as a one-way message does, every message end
  costing its rank the CPU the calibration measured one to cost) and carries the ops per layer and per
  micro-batch *counted* on the model as the worker builds it (``count_gpt_ops``);
* chapter 13 (a stack of Linear + tanh, float32, which a ``ModelShape`` cannot express): each virtual stage's
  forward and backward from the same pieces (its GEMMs through the device's ``GemmTable``, its tanh's bytes over the
  memory bandwidth, its counted ops times the op cost, all times the cores' contention), the message from the
  fitted ``p2p`` link, and ``pipeline_makespan`` of those times. An unpadded pipeline whose ranks outnumber the
  cores (``shares_cores``) is replayed on the cores instead (``shared_cores_makespan``): each action its own CPU,
  ranks and messages queueing for a core, each message the CPU of its threads (measured in the executor's pattern:
  ``message_main_s``, ``message_transport_s``), each action after a wait starting cold (``cold_start_s``), and each
  rank after its last action running the trainer's step besides its actions (``trainer_step_s``: the calibration
  measures chapter 13's trainer itself, with one stage on every rank, because that step is Python between tiny
  actions that no op count sees: 0.4-0.6 ms of CPU on a 2-core EPYC VM where its counted ops price 0.05 ms). One
  price for every message cannot hold there: in one pipeline of four ranks few compute at once and a message finds
  a core free, in two pipelines of two every message queues behind the other pair's work; and the last stages'
  step after their schedule holds the cores while the first stages wait for their last gradients.

Terms that are not the time model's own, one sentence each:

* **padding** (chapter 13 and 15 runs with ``forward_ms``/``backward_ms``): the executor sleeps after an action's
  real compute until the action has lasted forward_ms / v (backward_ms / v), so an action takes
  max(compute, pad), and the padding term is that max minus the compute, on the busiest rank;
* **tied embedding** (chapter 15 with pp > 1): the tied embedding's gradient is all-reduced between the first and
  the last stage after the schedule (``sum_tied_gradients``), priced with the fitted 2-rank all_reduce;
* **loss all-reduce** (chapter 15): the last stage all-reduces the step's loss (8 bytes) over dp x cp after the
  schedule, priced with the fitted all_reduce of that group's size;
* **optimizer** (added to step_time's memory-bound AdamW term; chapter 13's SGD) and **reporting** (the step's
  batch, the gradients and digests the worker reports, ZeRO-1's report all-gathers): ops *counted* on the first
  stage's parameters as the trainer runs them (``count_gpt_step_ops``, ``count_mlp_step_ops``), at the
  calibration's cost of an AdamW op (``optimizer_op_seconds``) and of one eager op (``op_s``), times the cores'
  contention;
* **barrier**: the executor's barrier of the whole world before each schedule, the calibration's mean barrier.

``compare_runs(cal, rows)`` sets every prediction against the measured median step, and ``comparison_table`` prints
it. CPU timings on a shared machine: see ``course_utils/calibration.py``.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import os
import statistics
import sys
from dataclasses import dataclass

from workers.layout.rules import Layout

from .calibration import HOST_TRIES, SLOW_HOST, MachineCalibration
from .device_rates import GemmRow, GemmTable
from .hardware import GPU, Cluster, Link
from .model_shapes import ModelShape
from .step_time import Practice, gemm_seconds, group_time, pipeline_makespan, schedule_plan, step_time
from .tables import Table

TOLERANCE = 0.25  # the acceptance band: |predicted / measured - 1| <= 25%
ALL_ON_ONE_NODE = 1 << 20  # gpus_per_node: every group of ranks is inside the one machine
P2P_NAMES = ("send_recv",)  # what step_time calls a one-way message (the calibration's "p2p")
DTYPE_BYTES = {"float64": 8, "float32": 4}


# -- the device ---------------------------------------------------------------------------------------------------

def contended(cal: MachineCalibration, world: int | None) -> bool:
    """Whether ``world`` ranks computing at once outnumber the cores and the calibration measured what a message
    costs then (``p2p_busy``)."""
    return bool(world and cal.contended_world and cal.cores and world > cal.cores and cal.p2p_busy[0] > 0)


def hops(collective: str, ranks: int) -> int:
    """Messages one after another in a ring collective over ``ranks`` (an all-reduce is a reduce-scatter and an
    all-gather): what a woken rank waits for a core at, once each."""
    return 2 * (ranks - 1) if collective == "all_reduce" else ranks - 1


def link_fits(cal: MachineCalibration, world: int | None = None) -> tuple[tuple[str, int, float, float], ...]:
    """``cal.link_fits()``, and each ``p2p`` fit again under the name ``step_time`` asks for (``send_recv``): the
    same measured constants, so a pipeline's message is priced as a one-way p2p, not as the nearest collective.

    In a world of more ranks than cores (``contended``), a group smaller than the world talks while other ranks
    compute, and a rank woken by a message waits for the scheduler to give it a core: its 2-rank message
    (``send_recv``) costs the calibration's ``p2p_busy``, its 2-rank all-reduce ``all_reduce_busy``, and any other
    collective over fewer ranks than the world its fit plus, per message of its ring (``hops``), the measured
    excess of a contended message over a quiet one (``p2p_busy`` - ``p2p_quiet``, alpha). A collective over every
    rank of the world keeps its fit: it was measured with every rank in it, as the runs call it."""
    fits = cal.link_fits()
    fits = fits + tuple((alias, n, a, b) for name, n, a, b in fits if name == "p2p" for alias in P2P_NAMES)
    if not contended(cal, world):
        return fits
    excess = max(0.0, cal.p2p_busy[0] - cal.p2p_quiet[0])
    out = []
    for name, n, a, b in fits:
        if n >= world or name == "p2p":
            out.append((name, n, a, b))
        elif name in P2P_NAMES and n == 2:
            out.append((name, n, *cal.p2p_busy))
        elif name == "all_reduce" and n == 2 and cal.all_reduce_busy[0] > 0:
            out.append((name, n, *cal.all_reduce_busy))
        else:
            out.append((name, n, a + hops(name, n) * excess, b))
    return tuple(out)


def op_seconds(cal: MachineCalibration) -> float:
    """The cost of one op as the op counter counts them: the calibration's small ``nn.Linear`` step (forward,
    ``sum``, ``backward()``: module call, autograd and the backward call included) over the aten ops the same
    dispatch counter sees in that step (``linear_step_ops``)."""
    return cal.linear_forward_backward_s / linear_step_ops()


def _memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0.0


def device_from(cal: MachineCalibration, world: int | None = None, op_s: float | None = None) -> Cluster:
    """This machine as a planner ``Cluster``: one "GPU" per rank, all ranks on one node sharing ``cal.cores``;
    ``world``: the ranks that compute at once (its links are then ``link_fits(cal, world)``'s); ``op_s``: one op's
    cost (``op_seconds(cal)`` unless given)."""
    best = max(f for *_, f in cal.matmul)
    gpu = GPU(name=f"{cal.cpu} ({cal.cores} cores, {cal.threads_per_rank} thread per rank)",
              memory_bytes=_memory_bytes(), peak_flops=best,
              source=f"course_utils.calibration, measured {cal.measured_at}",
              memory_bandwidth=cal.stream_bandwidth, stream_efficiency=1.0,
              kernel_overhead_s=op_seconds(cal) if op_s is None else op_s,
              overhead_serial=True, cores=cal.cores, gemm_rows=tuple(cal.matmul), attention_rows=cal.attention,
              activation_rows=cal.activation)
    alpha, beta = cal.p2p
    link = Link(name="gloo on this machine", bandwidth=1.0 / beta if beta > 0 else 0.0, latency=alpha,
                source="course_utils.calibration: per-collective alpha-beta fits", fitted=link_fits(cal, world))
    return Cluster(name=f"this machine: {cal.cores} cores, gloo", gpu=gpu, gpus_per_node=ALL_ON_ONE_NODE,
                   intra_node=link, inter_node=link)


def gemm_table(cluster: Cluster, dtype: str) -> GemmTable:
    """The device's measured matmul rows in ``dtype`` (all rows when none were measured in it)."""
    rows = cluster.gpu.gemm_rows
    chosen = [r for r in rows if r[0] == dtype] or list(rows)
    return GemmTable(cluster.gpu.name, dtype, tuple(GemmRow(m, n, k, f) for _, m, n, k, f in chosen))


def contention(cluster: Cluster, world: int) -> float:
    """step_time's rule: ranks that outnumber the cores slow each other's compute by ranks / cores."""
    cores = cluster.gpu.cores
    return max(1.0, world / cores) if cores else 1.0


# -- counting ops ---------------------------------------------------------------------------------------------------

def _counter():
    import torch  # noqa: F401 - TorchDispatchMode needs torch loaded
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        """Every aten op dispatched inside the block, by name."""

        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

        @property
        def total(self) -> int:
            return sum(self.ops.values())

    return Count()


@functools.lru_cache(maxsize=None)
def linear_step_ops() -> int:
    """Aten ops of the calibration's ``nn.Linear(32, 32)`` step on ``[8, 32]`` float32: forward, ``sum``,
    ``backward()`` after clearing the two gradients (``workers/timing/cpu.py: linear_fn``, the step it times)."""
    import torch

    from workers.timing.cpu import linear_fn

    with _one_thread(torch), torch.random.fork_rng(devices=[]):
        step = linear_fn()
        step()  # the first call's one-time work is not what the calibration times (it warms up first)
        with _counter() as c:
            step()
    return c.total


@contextlib.contextmanager
def _one_thread(torch):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def _one_rank_group():
    """A world of one (gloo, an in-memory store) for building a rank's model in this process: its TP mappings ask
    the default group's size. Left as it was afterwards; refused inside a real world of several ranks."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError("count ops outside a process group of several ranks: its collectives would run")
        yield
        return
    hook = sys.excepthook  # init_process_group wraps it to prefix tracebacks with "[rank0]": put it back after
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


@dataclass(frozen=True)
class OpCount:
    """Aten ops of one micro-batch: per layer (forward, backward), and outside the layers (embedding, final norm,
    head, loss, its ``.item()``; forward, backward)."""

    layer_forward: int
    layer_backward: int
    extra_forward: int
    extra_backward: int

    @property
    def per_layer(self) -> tuple[int, int]:
        return (self.layer_forward, self.layer_backward)

    @property
    def extra(self) -> int:
        return self.extra_forward + self.extra_backward


def _loopback_ring(cp: int):
    """A ring of ``cp`` whose exchanges run the real ring's tensor ops (detach, copy to the comm device, a receive
    buffer) without ranks: what each rank's ring attention dispatches, counted in one process."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    from workers.context_parallel.ring import Exchange, Ring

    class Loopback(Ring):
        def exchange(self, tensor, phase, tag=0):
            send_buf = tensor.detach().to(self.comm_device).contiguous()
            recv_buf = torch.empty_like(send_buf)
            with _disable_current_modes():  # what gloo writes into it, outside the dispatcher on a rank
                recv_buf.copy_(send_buf)
            self.messages[phase] += 1
            return Exchange([], send_buf, recv_buf, self.device, self)

    cpu = torch.device("cpu")
    return Loopback(0, list(range(cp)), cpu, cpu)


@contextlib.contextmanager
def _gpt_rank(vocab: int, seq: int, hidden: int, heads: int, layers: int, micro_batch: int, cp: int, dtype: str):
    """A rank of chapter 15's GPT built in this process as the worker builds it (``workers/composed``: ``make_dense``,
    then ``ParallelGPT`` per stage with the vocab-parallel ends the trainer uses at every tp, tp = 1, the ring under
    cp > 1 as a loopback ring, one thread, a world of one): yields ``stage(vs, stages) -> (forward, backward)``, the
    two halves of one micro-batch through virtual stage ``vs`` of ``stages`` (the last with the trainer's loss,
    summed CE over the batch's valid tokens, and its ``.item()``)."""
    import torch

    from workers.composed.model import make_dense, model_config
    from workers.composed.train import vocab_parallel_token_losses
    from workers.context_parallel.split import local_positions
    from workers.model import Where
    from workers.model.batch import make_batch
    from workers.parallel.gpt import ParallelGPT, Parallelism

    dt = {"float64": torch.float64, "float32": torch.float32}[dtype]
    cfg = model_config(vocab, seq, hidden, heads, layers)
    with _one_thread(torch), _one_rank_group(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        dense = make_dense(cfg, 0, dt)
        tokens, valid = make_batch(cfg, micro_batch, 0)
        positions = local_positions(seq, cp, 0, "zigzag")
        where = Where(0, positions, torch.arange(micro_batch), micro_batch, seq)
        inputs, targets = tokens[:, :-1][:, positions], tokens[:, 1:][:, positions]
        mask = valid[:, positions]

        def stage(vs: int, stages: int):
            ring = _loopback_ring(cp) if cp > 1 else None
            module = ParallelGPT(dense, Parallelism(ring=ring, vocab_parallel=True), vs, stages)
            if module.first:
                x = inputs
            else:
                x = torch.randn(len(positions), micro_batch, hidden, dtype=dt, requires_grad=True)
            grad = None if module.last else torch.randn(len(positions), micro_batch, hidden, dtype=dt)
            out = []

            def forward():
                y = module(x, where)
                if module.last:
                    y = vocab_parallel_token_losses(y, targets, mask, None) / max(int(mask.sum()), 1)
                    y.item()
                out.append(y)

            def backward():
                y = out.pop()
                if module.last:
                    y.backward()
                else:
                    torch.autograd.backward(y, grad_tensors=grad)

            return forward, backward

        yield stage


@functools.lru_cache(maxsize=None)
def count_gpt_ops(vocab: int = 32, seq: int = 16, hidden: int = 32, heads: int = 8, layers: int = 4,
                  micro_batch: int = 4, cp: int = 1, dtype: str = "float64") -> OpCount:
    """The aten ops of one micro-batch's forward and backward of chapter 15's GPT, built as the worker builds it
    (``_gpt_rank``), counted with ``TorchDispatchMode`` at the run's shapes: per layer from a stage holding one
    middle layer, and the rest (embedding, position table, final LayerNorm, tied head, the loss-parallel
    cross-entropy as the trainer normalises it and its ``.item()``) as the whole model's count less ``layers``
    layers. A layout with tp > 1 is counted at tp = 1 (the same ops on narrower tensors, less the mappings'
    clones); the executor's message buffers are not counted. Cached: the count is a property of the code."""
    if layers < 3:
        raise ValueError(f"layers={layers}: counting one middle layer needs at least 3")
    with _gpt_rank(vocab, seq, hidden, heads, layers, micro_batch, cp, dtype) as stage:
        def count(vs: int, stages: int) -> tuple[int, int]:
            forward, backward = stage(vs, stages)
            forward()  # once to warm (first-call work), once counted
            backward()
            with _counter() as fwd:
                forward()
            with _counter() as bwd:
                backward()
            return fwd.total, bwd.total

        layer_f, layer_b = count(1, layers)  # a middle stage of one layer: neither embedding nor head
        whole_f, whole_b = count(0, 1)
    return OpCount(layer_f, layer_b, whole_f - layers * layer_f, whole_b - layers * layer_b)


def total_ops(ops: OpCount, layers: int) -> int:
    """The ops of one micro-batch through the whole model."""
    return layers * sum(ops.per_layer) + ops.extra


# the micro-batches the calibration times chapter 15's GPT at, in this process (``time_gpt``): (cp, micro-batch),
# the whole model at the default shape; cp = 2 runs the ring's blocks on the same tokens per rank as cp = 1's
GPT_TIMED = ((1, 4), (2, 8))


def time_gpt(cp: int, micro_batch: int, bursts: int = 12, passes: int = 4, warm: int = 2) -> float:
    """Seconds of one micro-batch's forward and backward through chapter 15's whole default GPT in this process
    (``_gpt_rank``: one thread, the ring a loopback ring under cp > 1): the quickest of ``bursts`` bursts of
    ``passes`` passes, per pass, after ``warm`` bursts to warm up (as the calibration times its kernels: the least
    repeat, the one a shared host slowed least; a first call in a fresh process ran 30-50% slow for a whole burst
    of six on the 2-core EPYC VM this was written on)."""
    import time

    m = gpt_timed_row(cp, micro_batch)["model"]
    with _gpt_rank(m["vocab"], m["seq"], m["hidden"], m["heads"], m["layers"], micro_batch, cp, m["dtype"]) as stage:
        forward, backward = stage(0, 1)
        times = []
        for _ in range(warm + bursts):
            start = time.perf_counter()
            for _ in range(passes):
                forward()
                backward()
            times.append((time.perf_counter() - start) / passes)
    return min(times[warm:])


@functools.lru_cache(maxsize=None)
def count_mlp_chunk_ops(layers: int = 8, hidden: int = 16, micro_batch_size: int = 4, chunks: int = 2,
                        micro_batches: int = 4) -> tuple[tuple[int, int], ...]:
    """Chapter 13: the aten ops of one micro-batch's forward and backward of each of the ``chunks`` virtual
    stages of its MLP (``workers/pipeline/model.py: stage_module``, as the worker builds them; the last with the
    loss / m and its ``.item()``, as the executor runs it), counted with ``TorchDispatchMode``."""
    import torch

    from workers.pipeline.model import PipelineConfig, loss_fn, make_batch, stage_module

    cfg = PipelineConfig(layers=layers, hidden=hidden, micro_batch_size=micro_batch_size, micro_batches=micro_batches)
    out = []
    with _one_thread(torch), torch.random.fork_rng(devices=[]):
        x0, y0 = make_batch(cfg)
        x0, y0 = x0[:micro_batch_size], y0[:micro_batch_size]
        for vs in range(chunks):
            module = stage_module(cfg, vs, chunks)
            first, last = vs == 0, vs == chunks - 1
            for counting in (False, True):
                x = x0 if first else torch.randn(micro_batch_size, hidden).requires_grad_()
                grad = None if last else torch.randn(micro_batch_size, hidden)
                with _counter() if counting else contextlib.nullcontext() as fwd:
                    y = module(x)
                    if last:
                        y = loss_fn(y, y0) / micro_batches
                        y.item()
                with _counter() if counting else contextlib.nullcontext() as bwd:
                    if last:
                        y.backward()
                    else:
                        torch.autograd.backward(y, grad_tensors=grad)
            out.append((fwd.total, bwd.total))
    return tuple(out)


@functools.lru_cache(maxsize=None)
def adamw_ops(shapes: tuple) -> int:
    """Aten ops of the AdamW step the calibration times (``workers/timing/cpu.py: adamw_fn``) over float64 parameters
    of ``shapes``: the step after the first."""
    import torch

    from workers.timing.cpu import adamw_fn

    with _one_thread(torch):
        step = adamw_fn(shapes)  # it has taken the first step
        with _counter() as c:
            step()
    return c.total


def optimizer_op_seconds(cal: MachineCalibration) -> float:
    """The cost of one op of an optimizer step as the op counter counts them: the calibration's AdamW step over the
    ops the same counter sees in it (``adamw_ops``; a loop over the parameters, Python included), or one eager op
    (``op_s``) for a calibration without it."""
    if cal.adamw_step_s > 0 and cal.adamw_shapes:
        return cal.adamw_step_s / adamw_ops(tuple(tuple(s) for s in cal.adamw_shapes))
    return cal.op_s


@dataclass(frozen=True)
class StepOps:
    """Aten ops of one rank's step outside its schedule: ``optimizer`` (the gradient buckets' copies and the
    optimizer's step: AdamW, ZeRO-1's flat shards, SGD) and ``reporting`` (the step's batch and what the worker
    reports: gradients, digests); ``report_gather_bytes``: what ZeRO-1's report all-gathers (one call per bucket)."""

    optimizer: int
    reporting: int
    report_gather_bytes: tuple[float, ...] = ()


@functools.lru_cache(maxsize=None)
def count_gpt_step_ops(vocab: int = 32, seq: int = 16, hidden: int = 32, heads: int = 8, layers: int = 4,
                       dtype: str = "float64", global_batch: int = 8, dp: int = 1, pp: int = 1, cp: int = 1,
                       virtual_stages: int = 1, micro_batches: int = 1, zero: int = 0) -> StepOps:
    """Chapter 15: the aten ops of the first stage's rank (dp = cp = 0, the one that reports) outside its schedule,
    as ``workers/composed/train.py: ComposedTrainer.step`` runs them, counted with ``TorchDispatchMode`` on that
    rank's parameters (``ParallelGPT`` per chunk, tp = 1): ``optimizer`` the gradient buckets' flatten and copy back
    and ``torch.optim.AdamW``'s step (ZeRO-0), or ``Zero1Optimizer.step`` with its inner AdamW (in a world of one:
    its flat shard is one tensor per bucket whatever the group); ``reporting`` ``_micro_batches`` (the step's batch),
    ``record`` of the gradients (ZeRO-1: ``_zero1_grads``, whose all-gathers are priced as collectives) and the
    digest of every parameter. The step after the first (the optimizer's state exists). Cached."""
    import types

    import torch

    from workers.composed.model import make_dense, model_config
    from workers.composed.train import BETAS, EPS, WEIGHT_DECAY, ComposedTrainer, digest, record
    from workers.context_parallel.split import local_positions
    from workers.layout import Layout
    from workers.model.batch import make_batch
    from workers.parallel.gpt import ParallelGPT, Parallelism
    from workers.pipeline.schedules import virtual_stage

    dt = {"float64": torch.float64, "float32": torch.float32}[dtype]
    cfg = model_config(vocab, seq, hidden, heads, layers)
    chunks = pp * virtual_stages
    with _one_thread(torch), _one_rank_group(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        dense = make_dense(cfg, 0, dt)
        modules = [ParallelGPT(dense, Parallelism(vocab_parallel=True), virtual_stage(0, c, pp), chunks) for c in range(virtual_stages)]
        named = {n: p for mod in modules for n, p in mod.named_parameters()}
        params = list(named.values())
        for p in params:
            p.grad = torch.randn_like(p)
        tied = [p for p in params if hasattr(p, "tied_to")] + ([modules[0].embed.weight] if pp > 1 else [])
        tied_ids = {id(p) for p in tied}
        buckets = [b for b in ([p for p in params if id(p) in tied_ids], [p for p in params if id(p) not in tied_ids])
                   if b]
        gathers = ()
        if zero == 1:
            from workers.zero.zero1 import Zero1Optimizer

            opt = Zero1Optimizer([{"params": b} for b in buckets], torch.optim.AdamW, average=False, lr=0.01,
                                 betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)

            def optimizer():
                opt.zero_grad()
                opt.step()

            me = types.SimpleNamespace(optimizer=opt, named=named, reporter=True)
            report = functools.partial(ComposedTrainer._zero1_grads, me)
            gathers = tuple(float(flat.flat_grads.nbytes) for flat in opt.groups)
        else:
            opt = torch.optim.AdamW(params, lr=0.01, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)

            def optimizer():  # ComposedTrainer.step's buckets: one flat tensor each, all-reduced, copied back
                for bucket in buckets:
                    flat = torch.cat([p.grad.reshape(-1) for p in bucket])
                    offset = 0
                    for p in bucket:
                        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                        offset += p.numel()
                opt.step()

            def report():
                return record(named, "grad")

        layout = Layout(dp=dp, pp=pp, cp=cp, micro_batches=micro_batches, virtual_stages=virtual_stages)
        me = types.SimpleNamespace(layout=layout, cfg=cfg, batch=make_batch, global_batch=global_batch, data_seed=1,
                                   coords={"dp": 0}, positions=local_positions(seq, cp, 0, "zigzag"))

        def reporting():
            ComposedTrainer._micro_batches(me, 1)
            report()
            return {n: digest(p.data) for n, p in named.items()}

        optimizer()  # the first step creates the state
        reporting()
        with _counter() as opt_ops:
            optimizer()
        with _counter() as report_ops:
            reporting()
    return StepOps(opt_ops.total, report_ops.total, gathers)


@functools.lru_cache(maxsize=None)
def count_mlp_step_ops(layers: int = 8, hidden: int = 16, micro_batch_size: int = 4, micro_batches: int = 4,
                       pp: int = 2, virtual_stages: int = 1, lr: float = 0.1) -> StepOps:
    """Chapter 13: the aten ops of the first stage's rank outside its schedule, as ``workers/ch13_pipeline.py``
    runs them: ``optimizer`` its SGD step, ``reporting`` the step's batch (made and split) and the copy of every
    gradient it reports. Counted with ``TorchDispatchMode``; cached."""
    import torch

    from workers.pipeline.model import PipelineConfig, make_batch, micro_batches as split, stage_module
    from workers.pipeline.schedules import virtual_stage

    cfg = PipelineConfig(layers=layers, hidden=hidden, micro_batch_size=micro_batch_size, micro_batches=micro_batches)
    chunks = pp * virtual_stages
    with _one_thread(torch), torch.random.fork_rng(devices=[]):
        modules = [stage_module(cfg, virtual_stage(0, c, pp), chunks) for c in range(virtual_stages)]
        params = [q for mod in modules for q in mod.parameters()]
        for q in params:
            q.grad = torch.randn_like(q)
        opt = torch.optim.SGD(params, lr=lr)

        def reporting():
            x, y = make_batch(cfg, 1)
            split(cfg, x), split(cfg, y)
            return [q.grad.detach().cpu().clone() for q in params]

        opt.step()
        reporting()
        with _counter() as opt_ops:
            opt.step()
        with _counter() as report_ops:
            reporting()
    return StepOps(opt_ops.total, report_ops.total)


# -- chapter 15: step_time ------------------------------------------------------------------------------------------

def gpt_timed_row(cp: int, micro_batch: int) -> dict:
    """A ``measure_runs`` row of chapter 15's default GPT as ``time_gpt`` runs it: one rank's share of a ring of
    ``cp``, one micro-batch."""
    return {"chapter": 15, "name": f"timed cp {cp}", "world": cp, "global_batch": micro_batch, "micro_batches": 1,
            "micro_batch_size": micro_batch,
            "model": {"vocab": 32, "seq": 16, "hidden": 32, "heads": 8, "layers": 4, "dtype": "float64", "tied": True},
            "layout": {"dp": 1, "tp": 1, "pp": 1, "cp": cp, "zero": 0, "schedule": "1f1b", "virtual_stages": 1,
                       "split": "zigzag"}}


def work_alone(cal: MachineCalibration, row: dict) -> float:
    """The matmuls, attention and memory-bound work ``step_time`` prices for ``row``'s micro-batch on one rank with
    a core of its own: what of a one-process timing is not its ops."""
    cluster = device_from(cal, op_s=0.0)
    cluster = dataclasses.replace(cluster, gpu=dataclasses.replace(cluster.gpu, cores=0))  # no contention
    ops = gpt_ops(row)
    st = step_time(gpt_shape(row), gpt_layout(row), row["world"], cluster, gpt_practice(row, ops))
    return sum(st.terms.get(t, 0.0) for t in ("matmul", "attention", "memory-bound"))


def gpt_op_prices(cal: MachineCalibration) -> tuple[float, float]:
    """(an op of chapter 15's model, an op of the CP ring's blocks), in seconds, from the calibration's timings of
    the model in one process (``cal.gpt``): the whole model's micro-batch at cp = 1 less its priced work, over its
    counted ops; then the ring's micro-batch at cp = 2 less its priced work and the model's ops at that price, over
    the ops the ring adds. The course's model spends Python the op counter does not see (its modules, the ledger's
    regions, the loss), the ring's blocks are bare aten ops: each is priced at what it costs. Without those timings
    (or with a timing its priced work exceeds) both are ``op_seconds(cal)``, the ``nn.Linear`` step's."""
    fallback = op_seconds(cal)
    timed = sorted(cal.gpt)
    alone = [(mb, t) for cp, mb, t in timed if cp == 1]
    if not alone:
        return fallback, fallback
    mb, t = alone[0]
    row = gpt_timed_row(1, mb)
    model_op = (t - work_alone(cal, row)) / total_ops(gpt_ops(row), row["model"]["layers"])
    if model_op <= 0:
        return fallback, fallback
    ring = [(cp, mb, t) for cp, mb, t in timed if cp > 1]
    if not ring:
        return model_op, model_op
    cp, mb, t = ring[0]
    row = gpt_timed_row(cp, mb)
    layers = row["model"]["layers"]
    model_ops, all_ops = total_ops(plain_ops(row), layers), total_ops(gpt_ops(row), layers)
    ring_op = (t - work_alone(cal, row) - model_ops * model_op) / max(all_ops - model_ops, 1)
    return model_op, ring_op if ring_op > 0 else model_op


def gpt_op_seconds(row: dict, cal: MachineCalibration) -> float:
    """One counted op of ``row``'s micro-batch at ``gpt_op_prices``: the model's ops at the model's price, the ops
    the ring adds under cp > 1 at the ring's, averaged over its ops (``step_time`` has one price per device)."""
    model_op, ring_op = gpt_op_prices(cal)
    layers = row["model"]["layers"]
    every, model_ops = total_ops(gpt_ops(row), layers), total_ops(plain_ops(row), layers)
    return (model_ops * model_op + max(every - model_ops, 0) * ring_op) / every


def gpt_shape(row: dict) -> ModelShape:
    """Chapter 15's GPT as the planner spells a model (GeLU MLP, tied embedding)."""
    m = row["model"]
    return ModelShape("chapter 15's GPT", layers=m["layers"], hidden=m["hidden"], heads=m["heads"],
                      kv_heads=m.get("kv_heads") or m["heads"], ffn=m.get("ffn") or 4 * m["hidden"], vocab=m["vocab"],
                      mlp="gelu", tied_embeddings=bool(m.get("tied", True)), source="workers/composed/model.py")


def gpt_layout(row: dict) -> Layout:
    lay = row["layout"]
    return Layout(dp=lay["dp"], tp=lay["tp"], pp=lay["pp"], cp=lay["cp"], zero=lay["zero"],
                  sequence_parallel=bool(lay.get("sequence_parallel")), micro_batches=row["micro_batches"],
                  virtual_stages=lay.get("virtual_stages", 1), schedule=lay.get("schedule", "1f1b"),
                  split=lay.get("split", "zigzag"), micro_batch=row["micro_batch_size"], seq=row["model"]["seq"],
                  recompute="none")


def gpt_ops(row: dict) -> OpCount:
    m, lay = row["model"], row["layout"]
    return count_gpt_ops(m["vocab"], m["seq"], m["hidden"], m["heads"], m["layers"], row["micro_batch_size"],
                         lay["cp"], m.get("dtype", "float64"))


def plain_ops(row: dict) -> OpCount:
    """``gpt_ops`` of ``row``'s model without the ring (cp = 1): what the ops of a run under CP less these are the
    ring's."""
    return gpt_ops({**row, "layout": {**row["layout"], "cp": 1}})


def gpt_practice(row: dict, ops: OpCount, cal: MachineCalibration | None = None) -> Practice:
    """How the course's composed trainer runs a step, in the planner's words: float64 matmuls (the calibration's
    float64 rows), 8-byte activations and gradients, the gradient reduction and ZeRO-1's all-gather after the
    schedule (no overlap), SDPA's fused attention kernel (``flash_attention``) except under CP, where the ring's
    blocks are unfused batched matmuls, no dropout, no recomputation, the counted ops (``step_time`` adds the
    per-micro-batch ones, embedding and head and loss alike, to the first stage), the ring exchange by exchange
    (``ring_exchanges``, hidden behind the ops the ring adds to a layer as counted), and every end of a message
    (the ring's, the pipeline's) at the CPU the calibration measured a message end to cost its rank in the pipeline
    executor's pattern (``message_main_s`` on its own thread + ``message_transport_s`` on gloo's)."""
    nbytes = DTYPE_BYTES[row["model"].get("dtype", "float64")]
    end = cal.message_main_s + cal.message_transport_s if cal is not None and cal.messaging_world else 0.0
    ring = (0, 0)
    if row["layout"]["cp"] > 1:  # the ops the ring adds to a layer: its blocks, merges and buffers
        ring = tuple(max(0, a - b) for a, b in zip(ops.per_layer, plain_ops(row).per_layer))
    return Practice(flash_attention=row["layout"]["cp"] == 1,  # SDPA's fused kernel; the ring's blocks are unfused
                    dtype=row["model"].get("dtype", "float64"), grad_overlap=False, param_gather_overlap=False,
                    ops_per_layer=ops.per_layer, activation_bytes=float(nbytes), grad_bytes=float(nbytes),
                    dropout=False, extra_ops_per_microbatch=ops.extra, ring_exchanges=True, ring_ops_per_layer=ring,
                    message_end_cpu_s=end)


def _pipeline_message(model: ModelShape, layout: Layout, cluster: Cluster, practice: Practice) -> float:
    """One activation between stages, as step_time prices it (``send_recv`` over two ranks)."""
    msg = layout.micro_batch * layout.seq / layout.cp * model.hidden * practice.activation_bytes / layout.tp
    return group_time("send_recv", msg, 2, layout.tp * layout.cp, cluster)


def padded(row: dict) -> bool:
    """Whether the run pads its actions to calibrated waits (``forward_ms``/``backward_ms``)."""
    return row.get("forward_ms", 0.0) > 0 or row.get("backward_ms", 0.0) > 0


def busy_world(row: dict) -> int | None:
    """The ranks of the run that compute at once: its world, unless its actions are padded (a padded action sleeps
    most of its time, and a sleeping rank holds no core)."""
    return None if padded(row) else row["world"]


def run_cluster(row: dict, cal: MachineCalibration) -> Cluster:
    """``device_from(cal, busy_world(row))``: the device with the links the run's messages meet."""
    return device_from(cal, busy_world(row))


def step_ops(row: dict) -> StepOps:
    """The counted ops of the run's step outside its schedule (``count_gpt_step_ops``, ``count_mlp_step_ops``)."""
    m, lay = row["model"], row["layout"]
    if row["chapter"] == 15:
        return count_gpt_step_ops(m["vocab"], m["seq"], m["hidden"], m["heads"], m["layers"],
                                  m.get("dtype", "float64"), row["global_batch"], lay["dp"], lay["pp"], lay["cp"],
                                  lay.get("virtual_stages", 1), row["micro_batches"], lay["zero"])
    return count_mlp_step_ops(m["layers"], m["hidden"], row["micro_batch_size"], row["micro_batches"], lay["pp"],
                              lay.get("virtual_stages", 1))


def outside_schedule(row: dict, cal: MachineCalibration, cluster: Cluster) -> dict[str, float]:
    """What a step does besides its schedule, priced from counted ops and measured constants (the first stage's
    rank: it ends the schedule last and starts the next one first): ``optimizer`` the counted optimizer ops at the
    calibration's optimizer op (``optimizer_op_seconds``), ``reporting`` the counted batch and report ops at one
    eager op (``op_s``), plus ZeRO-1's report all-gathers, both times the cores' contention (every rank runs them
    at about the same time); ``barrier`` the executor's barrier of the whole world that starts each schedule
    (the calibration's mean barrier at the run's world)."""
    ops = step_ops(row)
    slow = contention(cluster, row["world"])
    optimizer, reporting = counted_step_cpu(row, cal)
    group = row["layout"]["dp"] * row["layout"]["cp"] if row["chapter"] == 15 else 1
    gathers = sum(group_time("all_gather", b, group, 1, cluster) for b in ops.report_gather_bytes) if group > 1 else 0.0
    return {"optimizer": optimizer * slow, "reporting": reporting * slow + gathers,
            "barrier": cal.barrier_seconds(row["world"])}


def counted_step_cpu(row: dict, cal: MachineCalibration) -> tuple[float, float]:
    """(optimizer, reporting): one rank's CPU for the counted ops of its step outside the schedule, the optimizer's
    at the calibration's optimizer op (``optimizer_op_seconds``), the batch's and the report's at one eager op."""
    ops = step_ops(row)
    return ops.optimizer * optimizer_op_seconds(cal), ops.reporting * cal.op_s


def trainer_tail(row: dict, cal: MachineCalibration) -> float:
    """The CPU one rank of chapter 13's trainer spends on a step besides its actions: the calibration's
    ``trainer_step_s`` (the trainer measured with one stage on every rank at once), or, on a calibration without
    it, the step's counted optimizer and reporting ops alone (``counted_step_cpu``)."""
    return cal.trainer_step_s if cal.trainer_world else sum(counted_step_cpu(row, cal))


def predict_gpt(row: dict, cal: MachineCalibration, cluster: Cluster | None = None) -> dict:
    """Chapter 15: ``step_time`` of the run's model, layout and practice on this machine, plus the documented
    terms outside it (padding, the tied embedding's and the loss's all-reduces, the step outside its schedule)."""
    cluster = cluster or run_cluster(row, cal)
    op_s = gpt_op_seconds(row, cal)  # the model's and the ring's ops at their own prices
    cluster = dataclasses.replace(cluster, gpu=dataclasses.replace(cluster.gpu, kernel_overhead_s=op_s))
    model, layout, ops = gpt_shape(row), gpt_layout(row), gpt_ops(row)
    practice = gpt_practice(row, ops, cal)
    world, lay = row["world"], row["layout"]
    st = step_time(model, layout, world, cluster, practice)
    terms = dict(st.terms)
    nbytes = DTYPE_BYTES[row["model"].get("dtype", "float64")]
    if lay["pp"] > 1 and model.tied_embeddings:
        terms["tied embedding"] = group_time("all_reduce", model.vocab * model.hidden * nbytes, 2, 1, cluster)
    group = lay["dp"] * lay["cp"]
    terms["loss all-reduce"] = group_time("all_reduce", 8.0, group, 1, cluster) if group > 1 else 0.0
    extra = {}
    if padded(row):
        extra = _pad_gpt(row, model, layout, cluster, practice, st, terms)
    outside = outside_schedule(row, cal, cluster)
    terms["optimizer"] += outside.pop("optimizer")
    terms.update(outside)
    return {"predicted_s": sum(terms.values()), "terms": terms, "step_time": st, "ops": ops, **extra}


def _pad_gpt(row, model, layout, cluster, practice, st, terms) -> dict:
    """A padded chapter 15 run: the pipeline again with every action max(its compute, the pad). Each rank's
    compute per micro-batch is step_time's (``stage_busy`` / m), split between forward and backward as step_time
    splits one layer (``layer_seconds``) and between a rank's v chunks equally; the pipeline's terms (bubble, pp)
    are replaced by the padded pipeline's, and ``padding`` is the busiest padded rank's time less its compute."""
    from .step_time import COMPUTE_TERMS, layer_seconds

    p, v, m = layout.pp, layout.virtual_stages, layout.micro_batches
    chunks = p * v
    one = layer_seconds(model, layout, cluster, practice)
    f1, b1 = sum(one["forward"].values()), sum(one["backward"].values())
    share = f1 / (f1 + b1) if f1 + b1 > 0 else 1 / 3
    pad_f, pad_b = row.get("forward_ms", 0.0) / 1e3 / v, row.get("backward_ms", 0.0) / 1e3 / v
    compute = [st.stage_busy[vs % p] / m / v for vs in range(chunks)]  # one micro-batch of one chunk
    fwd = [max(c * share, pad_f) for c in compute]
    bwd = [max(c * (1 - share), pad_b) for c in compute]
    message = _pipeline_message(model, layout, cluster, practice) if p > 1 else 0.0
    schedule = layout.schedule if p > 1 else "1f1b"
    flat = pipeline_makespan(schedule, p, m, v, fwd, bwd, 0.0)
    timed = pipeline_makespan(schedule, p, m, v, fwd, bwd, message) if message else flat
    busy = [m * sum(fwd[vs] + bwd[vs] for vs in range(r, chunks, p)) for r in range(p)]
    critical = max(range(p), key=lambda r: busy[r])
    terms["padding"] = busy[critical] - sum(terms[t] for t in COMPUTE_TERMS)
    terms["bubble"] = flat - busy[critical]
    terms["pp"] = timed - flat
    return {"forward": fwd, "backward": bwd, "message": message, "busy": busy}


# -- chapter 13: pipeline_makespan ----------------------------------------------------------------------------------

def messages(plan) -> list[tuple[int, int]]:
    """``(producer, consumer)`` units of every message of ``plan``: each dependency that crosses ranks."""
    return [(plan.dep[u] >> 1, u) for u in range(len(plan.rank)) if plan.dep[u] >= 0 and plan.dep[u] & 1]


def shared_cores_makespan(plan, unit_seconds: list[float], replicas: int, cores: int, *, transport: float = 0.0,
                          wire: float = 0.0, cold: float = 0.0, tail: float = 0.0) -> float:
    """Seconds from the start of a step to its last action for ``replicas`` identical pipelines side by side (the
    run's dp) whose ranks share ``cores`` cores, each rank running its list of ``plan`` (``schedules.Plan``), unit u
    taking ``unit_seconds[u]`` of a core (its compute and the CPU of its message ends on the rank's own thread).

    How the cores are shared, as measured on CPU ranks: a rank holds a core from the moment it gets one until it must
    wait for a message (its actions are shorter than a scheduler's slice), and a rank or a message that wants a core
    queues for one, first come first served. A message leaves when the threads that carry it (gloo's transport
    threads at both ends) have had ``transport`` of a core, after the action that produced it; it lands ``wire``
    later. A rank that has waited (for a message, or the step's barrier) starts its next action ``cold``: that
    action costs ``cold`` more (``MachineCalibration.cold_start_s``). With ``tail``, each rank goes on after its
    last action with ``tail`` of CPU on the core it holds (the trainer's step besides its schedule), and the result is
    when the last rank's tail ends: a rank that finished early keeps a core from the ranks still waiting for a
    message. With cores for every rank and ``transport`` = ``cold`` = ``tail`` = 0 this is ``Plan.run``'s replay
    with each message taking ``wire``."""
    if plan.calls:
        raise ValueError("a table with calls (DualPipeV's overlapped pairs) has no shared-cores replay")
    p, n = plan.p, len(plan.rank)
    units = [[u for u in range(n) if plan.rank[u] == r] for r in range(p)]
    consumers = collections.defaultdict(list)  # a unit -> the units on other ranks that wait for its message
    for producer, consumer in messages(plan):
        consumers[producer].append(consumer)
    ranks = replicas * p  # rank g is stage g % p of pipeline g // p
    pos = [0] * ranks
    done, landed = set(), set()  # (pipeline, unit) finished on its rank; whose message landed on its consumer
    queue = collections.deque()  # tasks waiting for a core: ("rank", g) or ("send", pipeline, unit)
    running = {}  # task -> seconds of a core it still needs
    waiting, cold_next = set(range(ranks)), set()
    wires = []  # (time a message lands, pipeline, unit)
    now, left = 0.0, replicas * n
    eps = 1e-12

    def ready(g: int) -> bool:
        q, r = divmod(g, p)
        d = plan.dep[units[r][pos[g]]]
        return d < 0 or (q, d >> 1) in (landed if d & 1 else done)

    while left or running or wires:
        for g in sorted(waiting):  # ranks whose next action may start: queue for a core, cold after their wait
            if pos[g] < len(units[g % p]) and ready(g):
                waiting.discard(g)
                cold_next.add(g)
                queue.append(("rank", g))
        while queue and len(running) < cores:
            task = queue.popleft()
            if task[0] == "rank":
                g = task[1]
                running[task] = unit_seconds[units[g % p][pos[g]]] + (cold if g in cold_next else 0.0)
                cold_next.discard(g)
            else:
                running[task] = transport
        if not running and not wires:
            raise RuntimeError("the pipelines wait on each other forever: the table deadlocks")
        step = min([*running.values(), *(w[0] - now for w in wires)])
        now += max(step, 0.0)
        for task in running:
            running[task] -= step
        for w in [w for w in wires if w[0] <= now + eps]:
            wires.remove(w)
            landed.add((w[1], w[2]))
        for task in [t for t, need in running.items() if need <= eps]:
            del running[task]
            if task[0] == "send":
                wires.append((now + wire, task[1], task[2]))
                continue
            if task[0] == "tail":
                continue
            g = task[1]
            q, r = divmod(g, p)
            u = units[r][pos[g]]
            done.add((q, u))
            left -= 1
            pos[g] += 1
            for _ in consumers[u]:  # its message: its threads' CPU first, if any, then the wire
                if transport > 0:
                    queue.append(("send", q, u))
                else:
                    wires.append((now + wire, q, u))
            if pos[g] < len(units[r]) and ready(g):
                running[task] = unit_seconds[units[r][pos[g]]]  # it goes on without giving its core up
            elif pos[g] == len(units[r]) and tail > 0:
                running[("tail", g)] = tail  # the step after its schedule, on the core it holds
            else:
                waiting.add(g)
    return now


def shares_cores(row: dict, cal: MachineCalibration) -> bool:
    """Whether chapter 13's run is priced by ``shared_cores_makespan``: a pipeline whose ranks compute at once
    (unpadded) outnumber the cores, on a calibration that measured the messaging pattern's CPU."""
    return (row["layout"]["pp"] > 1 and contended(cal, busy_world(row)) and cal.messaging_world > 0
            and row["layout"]["schedule"] in ("gpipe", "1f1b", "interleaved"))


def _shared_schedule(row: dict, cal: MachineCalibration, schedule: str, fwd: list[float], bwd: list[float],
                     nbytes: float, tail: float = 0.0) -> tuple[float, float, float, float]:
    """(the schedule on shared cores with free messages, with its messages, one message on idle cores) for a
    chapter 13 run that ``shares_cores``: each action's CPU its compute plus ``message_main_s`` per message end on it
    (its receive, its sends), each message the two ends' transport CPU (``message_transport_s`` each) and the rest of
    the calibration's quiet one-way time (``p2p_quiet``, the other ranks idle) as its wire, each action after a wait
    ``cold_start_s`` more."""
    lay = row["layout"]
    p, v, m = lay["pp"], lay.get("virtual_stages", 1), row["micro_batches"]
    plan = schedule_plan(schedule, p, m, v if schedule == "interleaved" else 1)
    seconds = plan.seconds(fwd, bwd, 0.0)
    base = [seconds[plan.key[u]] for u in range(len(plan.rank))]
    ends = [0] * len(base)  # message ends per unit: its sends and its receive
    for producer, consumer in messages(plan):
        ends[producer] += 1
        ends[consumer] += 1
    with_messages = [b + k * cal.message_main_s for b, k in zip(base, ends)]
    transport = 2 * cal.message_transport_s
    quiet = cal.p2p_quiet[0] + cal.p2p_quiet[1] * nbytes
    wire = max(0.0, quiet - transport - 2 * cal.message_main_s)
    replicas = row["world"] // p
    flat = shared_cores_makespan(plan, base, replicas, cal.cores)
    replay = functools.partial(shared_cores_makespan, plan, with_messages, replicas, cal.cores, transport=transport,
                               wire=wire, cold=cal.cold_start_s)
    total = replay()
    return flat, total, replay(tail=tail) if tail > 0 else total, transport + wire + 2 * cal.message_main_s


def predict_mlp(row: dict, cal: MachineCalibration, cluster: Cluster | None = None) -> dict:
    """Chapter 13: each virtual stage's forward and backward of one micro-batch from the time model's pieces, each
    action padded to max(compute, pad), and ``pipeline_makespan`` of the run's schedule over them (``schedule_s``),
    plus the step outside its schedule (``outside_schedule``)."""
    cluster = cluster or run_cluster(row, cal)
    m_, lay = row["model"], row["layout"]
    layers, h, mbs = m_["layers"], m_["hidden"], row["micro_batch_size"]
    p, v, m = lay["pp"], lay.get("virtual_stages", 1), row["micro_batches"]
    chunks = p * v
    per_chunk = layers // chunks
    dtype = m_.get("dtype", "float32")
    table = gemm_table(cluster, dtype)
    shared = shares_cores(row, cal)
    # ranks replayed on the cores share them in the replay: each action is then its own CPU, no contention factor
    slow = 1.0 if shared else contention(cluster, row["world"])
    gpu = cluster.gpu
    bw = gpu.memory_bandwidth * gpu.stream_efficiency
    e = DTYPE_BYTES[dtype]
    ops = count_mlp_chunk_ops(layers, h, mbs, chunks, m)
    pad_f, pad_b = row.get("forward_ms", 0.0) / 1e3 / v, row.get("backward_ms", 0.0) / 1e3 / v
    compute_f, compute_b, parts = [], [], []
    for vs in range(chunks):
        tanhs = per_chunk - (1 if vs == chunks - 1 else 0)  # the last layer is linear
        mm_f = per_chunk * gemm_seconds(table, mbs, h, h)
        mm_b = per_chunk * gemm_seconds(table, mbs, h, h, backward=True)
        mem_f = tanhs * 2 * e * mbs * h / bw  # tanh reads and writes the activation
        mem_b = 2 * mem_f
        over_f, over_b = ops[vs][0] * gpu.kernel_overhead_s, ops[vs][1] * gpu.kernel_overhead_s
        f = {"matmul": mm_f * slow, "memory-bound": mem_f * slow, "kernel overhead": over_f * slow}
        b = {"matmul": mm_b * slow, "memory-bound": mem_b * slow, "kernel overhead": over_b * slow}
        compute_f.append(sum(f.values()))
        compute_b.append(sum(b.values()))
        parts.append((f, b))
    fwd = [max(t, pad_f) for t in compute_f]
    bwd = [max(t, pad_b) for t in compute_b]
    schedule = lay["schedule"] if p > 1 else "1f1b"
    if shared:
        flat, total, with_tail, message = _shared_schedule(row, cal, schedule, fwd, bwd, mbs * h * e,
                                                           trainer_tail(row, cal))
        # the trainer's step besides its actions holds a core after each rank's schedule: what it adds to the
        # step, the ranks still sending waiting for it included (its optimizer and reporting are part of it)
        outside = {"trainer": with_tail - total, "barrier": cal.barrier_seconds(row["world"])}
    else:
        message = group_time("send_recv", mbs * h * e, 2, 1, cluster) if p > 1 else 0.0
        flat = pipeline_makespan(schedule, p, m, v, fwd, bwd, 0.0)
        total = pipeline_makespan(schedule, p, m, v, fwd, bwd, message) if message else flat
        outside = outside_schedule(row, cal, cluster)
    busy = [m * sum(fwd[vs] + bwd[vs] for vs in range(r, chunks, p)) for r in range(p)]
    critical = max(range(p), key=lambda r: busy[r])
    terms = {"matmul": 0.0, "memory-bound": 0.0, "kernel overhead": 0.0}
    for vs in range(critical, chunks, p):
        for part in parts[vs]:
            for k, x in part.items():
                terms[k] += m * x
    compute = sum(terms.values())
    terms["padding"] = busy[critical] - compute
    terms["bubble"] = flat - busy[critical]
    terms["pp"] = total - flat
    terms.update(outside)
    return {"predicted_s": sum(terms.values()), "schedule_s": total, "terms": terms, "forward": fwd,
            "backward": bwd, "message": message, "busy": busy, "ops": ops}


# -- both -----------------------------------------------------------------------------------------------------------

def predict(row: dict, cal: MachineCalibration, cluster: Cluster | None = None) -> dict:
    """The predicted step of one ``measure_runs`` row: ``{"predicted_s", "terms", ...}`` (terms add up to it)."""
    if row["chapter"] == 15:
        return predict_gpt(row, cal, cluster)
    if row["chapter"] == 13:
        return predict_mlp(row, cal, cluster)
    raise ValueError(f"no predictor for chapter {row['chapter']}'s runs (15 and 13 have one)")


def message_bytes(row: dict) -> float:
    """Bytes of one message between pipeline stages (chapter 15: ``[s/cp, b, h]``; chapter 13: ``[b, h]``), or of
    one K/V exchange of the ring (chapter 15 under cp > 1: ``[2, b, heads, s/cp, d]``); 0 without either."""
    m, lay = row["model"], row["layout"]
    e = DTYPE_BYTES[m.get("dtype", "float64")]
    if row["chapter"] == 13:
        return row["micro_batch_size"] * m["hidden"] * e if lay["pp"] > 1 else 0.0
    if lay["pp"] > 1:
        return m["seq"] / lay["cp"] * row["micro_batch_size"] * m["hidden"] * e / lay["tp"]
    if lay["cp"] > 1:
        return 2 * row["micro_batch_size"] * m["seq"] / lay["cp"] * m["hidden"] * e / lay["tp"]
    return 0.0


def p2p_check(cal: MachineCalibration, nbytes: float, world: int) -> tuple[float, float]:
    """(the fitted one-way p2p time of ``nbytes``, the measured median at the nearest size measured, in log2) at
    ``world`` ranks: how well the alpha-beta line prices a message of that size on this machine."""
    alpha, beta = cal.collectives.get(("p2p", world), cal.p2p)
    points = cal.raw.get(world, {}).get("collectives", {}).get("p2p", [])
    if not points or nbytes <= 0:
        return alpha + beta * nbytes, float("nan")
    _, median = min(points, key=lambda pt: abs(math.log2(pt[0]) - math.log2(nbytes)))
    return alpha + beta * nbytes, median


# Chapter 15's step in the parts its trainer times (calibration.step_parts_measured), and the terms that price each:
# the schedule runs from the executor's barrier to the last action (the bubble and the messages' waits among it);
# sync is the gradient collectives and the optimizer step; outside, what the trainer does between (the tied
# embedding's and the loss's all-reduces) and after (the report; ZeRO-0's gradient record, timed in sync, is priced
# in outside with the rest of the report).
STEP_PARTS = {"schedule": ("matmul", "attention", "memory-bound", "kernel overhead", "recompute", "tp", "cp", "ep",
                           "padding", "bubble", "pp", "barrier"),
              "sync": ("dp", "optimizer"),
              "outside": ("tied embedding", "loss all-reduce", "reporting")}


def step_parts(terms: dict[str, float]) -> dict[str, float]:
    """A chapter 15 prediction's terms summed per part of the step (``STEP_PARTS``); a term of no part is refused."""
    out = dict.fromkeys(STEP_PARTS, 0.0)
    for term, seconds in terms.items():
        part = next((name for name, members in STEP_PARTS.items() if term in members), None)
        if part is None:
            raise ValueError(f"the term {term!r} belongs to no part of chapter 15's step: add it to STEP_PARTS")
        out[part] += seconds
    return out


def compare_runs(cal: MachineCalibration, rows: list[dict]) -> list[dict]:
    """Per row: predicted and measured median step, ratio = predicted / measured, whether it is within
    ``TOLERANCE``, the largest term and all terms; for a run that sends messages (a pipeline, the CP ring), one
    message's size, its fitted p2p time and the measured p2p median nearest that size."""
    clusters = {}
    out = []
    for row in rows:
        world = busy_world(row)
        if world not in clusters:
            clusters[world] = device_from(cal, world)
        pred = predict(row, cal, clusters[world])
        measured = row["measured_median_s"]
        ratio = pred["predicted_s"] / measured if measured > 0 else float("nan")
        terms = pred["terms"]
        nbytes = message_bytes(row)
        fit, median = p2p_check(cal, nbytes, row["world"]) if nbytes else (0.0, float("nan"))
        out.append({"chapter": row["chapter"], "name": row["name"], "world": row["world"],
                    "predicted_s": pred["predicted_s"], "measured_s": measured, "ratio": ratio,
                    "within": abs(ratio - 1) <= TOLERANCE, "dominant": max(terms, key=terms.get), "terms": terms,
                    "message_bytes": nbytes, "message_fit_s": fit, "message_measured_s": median,
                    "host_slowdown": row.get("host_slowdown", math.nan)})
        if "measured_parts_s" in row:
            out[-1].update(measured_parts_s=row["measured_parts_s"], predicted_parts_s=step_parts(terms))
    return out


def with_repeats(compared: list[dict], repeats: list[list[dict]]) -> list[dict]:
    """``compared`` with, per run, the measured medians of the same run measured again (``repeats``: further
    ``measure_runs`` results, rows in the same order), ``repeat_spread`` = the largest of all its medians over the
    smallest, less 1, and ``within_repeats``: whether the prediction is within ``TOLERANCE`` of any of them. A run
    whose medians move by more than the band between one measurement and the next holds no model to it."""
    _same_runs(compared, repeats)
    out = []
    for i, r in enumerate(compared):
        medians = [r["measured_s"], *(rows[i]["measured_median_s"] for rows in repeats)]
        spread = max(medians) / min(medians) - 1 if min(medians) > 0 else float("nan")  # no step: no spread
        out.append({**r, "medians_s": medians, "repeat_spread": spread,
                    "within_repeats": any(m > 0 and abs(r["predicted_s"] / m - 1) <= TOLERANCE for m in medians)})
    return out


def _same_runs(first: list[dict], again: list[list[dict]]) -> None:
    """Refuse measurements of other runs, or of the same runs in another order, than ``first``'s."""
    for i, r in enumerate(first):
        names = {rows[i]["name"] for rows in again}
        if names - {r["name"]}:
            raise ValueError(f"run {i}: {r['name']!r} measured again as {sorted(names)}: repeat the same runs in order")


def median_of_launches(launches: list[list[dict]]) -> list[dict]:
    """One row per run from several launches of the same runs (``measure_runs`` on fresh ranks each time, rows in
    the same order): the first launch's row with ``measured_median_s`` the median of the launches' medians (of those
    measured while the host ran within ``SLOW_HOST`` of its quickest, when any was; ``launches_used`` says how many). On a
    shared CPU a run's median moves between launches by more than the band (unpadded pipelines on 2 cores: up to
    1.77 times, 6 launches, 2026-12-07), so a prediction is held to the median of several;
    ``with_repeats(compare_runs(cal, rows), launches)`` shows each launch's and their spread."""
    if not launches:
        raise ValueError("no launches: measure the runs at least once")
    _same_runs(launches[0], launches[1:])
    out = []
    for i, row in enumerate(launches[0]):
        # the launches measured on a quiet host (within SLOW_HOST of its quickest; a row without probes counts as
        # quiet), or all of them when none was: the planner prices the machine as its calibration found it
        runs = [rows[i] for rows in launches]
        quiet = [r for r in runs if not r.get("host_slowdown", 1.0) > SLOW_HOST] or runs
        out.append({**row, "measured_median_s": statistics.median(r["measured_median_s"] for r in quiet),
                    "host_slowdown": max(r.get("host_slowdown", math.nan) for r in quiet), "launches_used": len(quiet)})
        if all("measured_parts_s" in r for r in quiet):  # the same launches' median, part by part
            out[-1]["measured_parts_s"] = {part: statistics.median(r["measured_parts_s"][part] for r in quiet)
                                           for part in row["measured_parts_s"]}
    return out


def comparison_table(compared: list[dict]) -> Table:
    """Predicted, measured, ratio and the largest term per run; the caption counts those within the band."""
    ok = sum(r["within"] for r in compared)
    quiet = [r for r in compared if r.get("host_slowdown", math.nan) <= SLOW_HOST]
    on_quiet = (f" ({sum(r['within'] for r in quiet)} of the {len(quiet)} measured with the host within {SLOW_HOST}x "
                "of its quickest)" if any(math.isfinite(r.get("host_slowdown", math.nan)) for r in compared) else "")
    again = all("medians_s" in r for r in compared) and compared
    rows = [[r["chapter"], r["name"], r["world"], f"{r['predicted_s'] * 1e3:.1f}", f"{r['measured_s'] * 1e3:.1f}",
             *([" / ".join(f"{m * 1e3:.1f}" for m in r["medians_s"][1:]), f"{r['repeat_spread']:.0%}"] if again else []),
             f"{r['ratio']:.2f}", "yes" if r["within"] else "no",
             f"{r['dominant']} {r['terms'][r['dominant']] / r['predicted_s']:.0%}",
             f"{r.get('host_slowdown', math.nan):.2f}x"] for r in compared]
    return Table(["chapter", "run", "ranks", "predicted ms", "measured ms",
                  *(["measured again ms", "medians moved"] if again else []), "ratio", f"within {TOLERANCE:.0%}",
                  "largest term", "host slowdown"], rows,
                 caption=f"the planner's step_time on this machine's calibration against the measured median step: "
                         f"{ok} of {len(compared)} within {TOLERANCE:.0%}{on_quiet}; host slowdown: a tiny op's "
                         "time in this process around the run over the session's quietest (a shared machine's speed "
                         f"swings; a run around which it was over {SLOW_HOST}x was measured again, {HOST_TRIES} times "
                         "in all at most, the quietest kept)")


def parts_table(compared: list[dict]) -> Table:
    """Chapter 15's runs part by part (``STEP_PARTS``): measured and predicted milliseconds of the schedule, the
    gradient sync and optimizer, and the rest of the step, and the measured waits on the CP ring and in pipeline
    receives beside the terms that price them (``cp``; ``bubble`` + ``pp``). Where a run's step is off, this says
    in which part. A rank's waits in receives are the part of its idle that falls inside its schedule: a stage
    that finishes first waits out the others after its schedule (in the tied embedding's all-reduce, under
    ``outside``), so a padded pipeline's waits read below its bubble."""
    def ms(x: float) -> str:
        return f"{x * 1e3:.1f}"

    rows = []
    for r in compared:
        if "measured_parts_s" not in r:
            continue
        got, want, t = r["measured_parts_s"], r["predicted_parts_s"], r["terms"]
        rows.append([r["name"], r["world"], *(f"{ms(got[p])} / {ms(want[p])}" for p in STEP_PARTS),
                     f"{ms(got['ring waits'])} / {ms(t.get('cp', 0.0))}" if "ring waits" in got else "",
                     f"{ms(got['pipeline waits'])} / {ms(t.get('bubble', 0.0) + t.get('pp', 0.0))}"
                     if "pipeline waits" in got else ""])
    return Table(["run", "ranks", *(f"{p} ms" for p in STEP_PARTS), "ring waits ms", "pipeline waits ms"], rows,
                 caption="chapter 15's step by part, measured / predicted (per step the median over ranks, then over "
                         "steps: the parts' medians need not add up to the step's); waits against the terms that "
                         "price them, cp and bubble + pp (CPU timings on this machine)")


__all__ = ["OpCount", "STEP_PARTS", "StepOps", "adamw_ops", "compare_runs", "comparison_table", "contended",
           "count_gpt_ops", "count_gpt_step_ops", "count_mlp_chunk_ops", "count_mlp_step_ops", "counted_step_cpu",
           "device_from", "link_fits", "median_of_launches", "messages", "op_seconds", "optimizer_op_seconds",
           "outside_schedule", "parts_table", "predict", "shared_cores_makespan", "shares_cores", "step_parts",
           "trainer_tail", "with_repeats"]
