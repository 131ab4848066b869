"""Calibrate this machine as a device of chapter 00's planner: what one rank's work and its messages cost here.

    torchrun --nproc-per-node 4 workers/calibrate.py
    torchrun --nproc-per-node 2 workers/calibrate.py --dtypes float32 --sizes 8 4096 1048576

Every number is measured on the ranks as the course runs them (one intra-op thread per rank, the ranks sharing the
machine's cores), after a warm-up. What one rank costs is measured on rank 0 alone, the other ranks asleep in a
barrier (a gloo barrier waits without spinning): the median of ``repeats`` repeats, each a loop of about
``target_ms`` over the thing measured, counted as the loop's mean per call (``workers/timing/cpu.py`` holds that loop
and what one rank times with it; this script runs them on the ranks and adds what only ranks can measure).

* **matmul**: ``a @ b`` for each (m, n, k) of ``shapes`` (an (m x k) @ (k x n) product) in each dtype;
* **ops**: the fixed cost of one eager op (``a + b`` on 8 floats), of one op recorded by autograd (forward) and of
  its backward (a chain of K ``y * w_i``, each ``w_i`` a leaf: the slope in K of the forward, and of the forward
  plus ``backward()``; the intercept of the latter is the fixed cost of a ``backward()`` call), and of a tiny
  ``nn.Linear``'s forward + backward;
* **kernels**: the two kernels a small model's step spends most in beyond its matmuls, forward and forward +
  backward, per dtype: fused causal attention (``F.scaled_dot_product_attention``, q, k, v ``[1, batch x heads, seq,
  head_dim]`` for each of ``timing.cpu.ATTENTION_SHAPES``: chapter 15's heads of 4 at its sequence of 16, and a
  larger one) and the MLP's activation function (``F.gelu``, exact erf form as the course's models call it, on each
  of ``timing.cpu.ACTIVATION_SIZES`` elements). On a CPU neither is what its FLOPs or bytes say: a tiny attention call
  is its setup, and erf in float64 is compute-bound. Each is the least of its repeats (the rest: medians), so that the
  backward the planner takes as their difference is never inverted by another program's preemption;
* **stream**: a large copy and a large add (``stream_mib`` MiB per operand): bytes read + written per second;
* **contention**: one compute-bound matmul (``contention_shape``, float32), one tiny op and the copy, run by 1, 2,
  ... world ranks at once, each for ``windows`` windows of about ``window_ms`` (many scheduler slices: ranks that
  outnumber the cores take turns, as in a training step; a short repeat's median would hide that);
* **collectives** at the world size: all_reduce, all_gather (``all_gather_into_tensor``), reduce_scatter
  (``reduce_scatter_tensor``), all_to_all (``all_to_all_single``), broadcast, at every size of ``sizes`` (bytes,
  float32; nccl-tests' S: the whole buffer, for all_gather the gathered output, for reduce_scatter the unreduced
  input, for all_to_all each rank's whole buffer), and ``p2p``: isend/irecv ping-pong between ranks 2i and 2i+1
  (all pairs at once), one way = half a round trip. Each call is timed on its own, back to back, ``calls`` to
  ``max_calls`` of them (as many as fit in ``point_ms``);
* **contended** messages (worlds of 3 ranks or more): ranks 0 and 1 as two pipeline stages, each computing
  ``contended_work_ms`` of small eager ops between messages: a ping-pong (one way = (round trip - the other side's
  work) / 2) and an all-reduce over the pair, at every size of ``contended_sizes``, while the other world - 2 ranks
  are busy (spinning on small eager ops, as a training rank computes) or idle (in a barrier); and an all-reduce of
  the whole world with every rank computing between calls (``world_all_reduce``, the smallest size). A rank
  blocked in a receive sleeps; when the message comes it must get a core back, and with more busy ranks than cores
  that waits for the scheduler to take one from a busy rank, not for the wire. The scheduler tends to stay in one
  regime for a window, so each point is ``contended_rounds`` windows of about ``contended_ms`` taken in turn, each
  call timed on its own;
* **messaging** (worlds of 3 ranks or more, an even number): every rank in a pair of pipeline stages passing a small
  tensor back and forth in the executor's pattern (receives posted ahead, ``isend``, each receive waited for where
  it is needed, each direction on a process group of its own), each computing a burst of ``messaging_burst_steps``
  tiny ``nn.Linear`` steps between: the CPU of a burst that starts after a wait (against the same burst back to
  back: on a machine whose idle cores sleep, or whose caches another rank has filled meanwhile, work that resumes
  after a wait runs cold), and the CPU each message end costs this thread and the others (gloo's transport
  threads), read from the CPU clocks (``time.thread_time``, ``time.process_time``);
* **trainer** (worlds of 3 ranks or more): the CPU chapter 13's trainer (``workers/pipeline/trainer.py``) spends on a
  step besides its actions, every rank training at once: the trainer with one stage each (no messages) at 1 and 3
  micro-batches for ``trainer_steps`` steps, the median step's CPU on this thread (``time.thread_time``) less a
  barrier's (the barrier is priced on its own). The CPU per step at m micro-batches is a + b m; a is the step's
  bookkeeping (the batch, the step's message objects, ``zero_grad``, the timeline and gradients it reports, the SGD
  step), the Python a schedule of tiny actions leaves between them that no op count sees;
* **barrier**: barriers of the whole world back to back, each timed (every world of 2 ranks or more);
* **adamw**: one ``torch.optim.AdamW`` step (as on CPU: a loop over the parameters, about ten eager ops each) over
  the parameters of one layer of chapter 15's GPT (``ADAMW_SHAPES``, float64), measured with the ops.

Each rank returns its own numbers; the notebook (``course_utils/calibration.py``) takes the slowest rank's median
for a collective (it is done when its last rank is) and the median over the busy ranks for contention; a contended
ping-pong is rank 0's (it times the round trip), a contended all-reduce per call the least of its ranks' times (the
rank that arrived last times the collective itself).
"""
from __future__ import annotations

import os
import platform
import statistics
import time

import torch
import torch.distributed as dist

from workers.layout.grid import RankGrid
from workers.layout.mesh import Mesh, link_names
from workers.pipeline.p2p import link_group
from workers.pipeline.trainer import train
from workers.runtime import all_gather_single, at_least, entrypoint, one_of, reduce_scatter_single, refusal
from workers.timing.cpu import (DTYPES, linear_fn, matmul_fn, measure_kernels, measure_ops, measure_stream, op_fn,
                                stats, timed)

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p")
SHAPES = ["4x16x16", "8x32x32", "32x32x96", "64x64x64", "128x32x128", "128x128x128", "256x256x256", "512x512x512"]
SIZES = [8, 64, 512, 4096, 32768, 262144, 1048576, 4194304]
MAX_BYTES = 64 << 20
CONTENDED = ("p2p", "all_reduce", "world_all_reduce")
CONTENDED_SIZES = [8, 65536]


def parse_shape(text: str) -> tuple[int, int, int]:
    """``"64x32x96"`` -> (m, n, k) = (64, 32, 96): an (m x k) @ (k x n) product."""
    m, n, k = (int(x) for x in str(text).lower().split("x"))
    if min(m, n, k) < 1:
        raise ValueError(text)
    return m, n, k


def _shape_problem(shapes) -> str | None:
    try:
        if not shapes:
            raise ValueError
        for s in shapes:
            parse_shape(s)
    except (ValueError, TypeError):
        return f"shapes must be 'MxNxK' strings of positive sizes (like '64x32x96'), not {shapes!r}"
    return None


def check_params(world_size, shapes=SHAPES, dtypes=("float32", "float64"), sizes=SIZES, collectives=COLLECTIVES,
                 contention_shape="256x256x256", repeats=7, target_ms=2.0, window_ms=30.0, windows=3, calls=11,
                 max_calls=41, point_ms=50.0, stream_mib=32, contended_sizes=CONTENDED_SIZES, contended_ms=40.0,
                 contended_calls=100, contended_work_ms=1.0, contended_rounds=6, messaging_steps=20,
                 messaging_messages=8, messaging_burst_steps=4, trainer_steps=40, **_):
    def bad(values):
        return any(not isinstance(s, int) or isinstance(s, bool) or s < 4 or s > MAX_BYTES for s in values)

    bad_sizes = not sizes or bad(sizes)
    return refusal(_shape_problem(shapes), _shape_problem([contention_shape]),
                   *(one_of("dtypes", d, tuple(DTYPES)) for d in dtypes),
                   *(one_of("collectives", c, COLLECTIVES) for c in collectives),
                   f"sizes must be whole numbers of bytes from 4 to {MAX_BYTES} (64 MiB), not {sizes!r}"
                   if bad_sizes else None,
                   f"contended_sizes must be whole numbers of bytes from 4 to {MAX_BYTES} (64 MiB), not "
                   f"{contended_sizes!r}" if not isinstance(contended_sizes, (list, tuple)) or bad(contended_sizes)
                   else None,
                   at_least("repeats", repeats, 3), at_least("windows", windows), at_least("calls", calls, 3),
                   at_least("contended_calls", contended_calls, 2), at_least("contended_rounds", contended_rounds),
                   at_least("messaging_steps", messaging_steps, 0), at_least("messaging_messages", messaging_messages),
                   at_least("messaging_burst_steps", messaging_burst_steps),
                   None if trainer_steps == 0 or (isinstance(trainer_steps, int) and trainer_steps >= 5) else
                   f"trainer_steps={trainer_steps} must be 0 (not measured) or at least 5",
                   None if 0 <= contended_work_ms <= 100 else
                   f"contended_work_ms={contended_work_ms} must be between 0 and 100 ms",
                   None if max_calls >= calls else f"max_calls={max_calls} must be at least calls={calls}",
                   *(None if 0.05 <= v <= 1000 else f"{k}={v} must be between 0.05 and 1000 ms"
                     for k, v in (("target_ms", target_ms), ("window_ms", window_ms), ("point_ms", point_ms),
                                  ("contended_ms", contended_ms))),
                   None if 1 <= stream_mib <= 256 else f"stream_mib={stream_mib} must be between 1 and 256")


# -- one rank alone, or all of them at once ----------------------------------------------------------------------------

def _alone(ctx, fn):
    """``fn()`` on rank 0 while the other ranks sleep in a barrier (a gloo barrier waits without spinning)."""
    dist.barrier()
    out = fn() if ctx.rank == 0 else None
    dist.barrier()
    return out


def _agree(value: float, op=dist.ReduceOp.MAX) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.item()


def busy(ctx, fn, active: int, calls: int, windows: int) -> float | None:
    """Seconds per call of ``fn`` while ranks 0..active-1 all run it: each runs ``windows`` windows of ``calls``
    calls started together from a barrier (about ``window_ms`` each when alone, many scheduler slices, so that ranks
    outnumbering the cores share them as in a training step); the median of the windows' per-call means."""
    fn()
    samples = []
    for _ in range(windows):
        dist.barrier()
        if ctx.rank < active:
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            samples.append((time.perf_counter() - start) / calls)
    dist.barrier()
    return statistics.median(samples) if samples else None


def contention(ctx, fn, alone_s: float, window_ms: float, windows: int) -> list[dict]:
    """``busy`` with 1, 2, ... world ranks at once; the number of calls per window is rank 0's alone time's."""
    calls = max(1, round(_agree(window_ms / 1e3 / alone_s if ctx.rank == 0 else 0.0)))
    return [{"active": k, "seconds": busy(ctx, fn, k, calls, windows), "calls": calls}
            for k in range(1, ctx.world_size + 1)]


# -- collectives ----------------------------------------------------------------------------------------------------

def element_count(nbytes: int, world: int) -> int:
    """float32 elements of the whole buffer S, a multiple of ``world`` (at least one per rank)."""
    return max(nbytes // 4 // world, 1) * world


def _collective_fn(name: str, total: int, world: int, rank: int):
    if name == "all_reduce":
        x = torch.ones(total)
        return lambda: dist.all_reduce(x)
    if name == "broadcast":
        x = torch.ones(total)
        return lambda: dist.broadcast(x, src=0)
    if name == "all_gather":
        out, inp = torch.empty(total), torch.ones(total // world)
        return lambda: all_gather_single(out, inp)
    if name == "reduce_scatter":
        out, inp = torch.empty(total // world), torch.ones(total)
        return lambda: reduce_scatter_single(out, inp)
    if name == "all_to_all":
        out, inp = torch.empty(total), torch.ones(total)
        return lambda: dist.all_to_all_single(out, inp)
    if name == "p2p":  # ping-pong: rank 2i sends, 2i+1 answers; one way is half the round trip
        buf, back = torch.ones(total), torch.empty(total)
        peer = rank + 1 if rank % 2 == 0 else rank - 1

        def ping_pong():
            if rank % 2 == 0:
                send = dist.isend(buf, dst=peer)
                dist.irecv(back, src=peer).wait()
                send.wait()
            else:
                dist.irecv(back, src=peer).wait()
                dist.isend(buf, dst=peer).wait()

        return ping_pong
    raise ValueError(f"unknown collective {name!r}")


def measure_collective(ctx, name: str, sizes, calls: int, max_calls: int, point_ms: float) -> list[dict]:
    """Per size: two warm-up calls, then between ``calls`` and ``max_calls`` calls (as many as fit in ``point_ms``,
    from the slowest rank's warm-up, so that every rank makes the same calls), each timed on its own."""
    world, rank = ctx.world_size, ctx.rank
    rows = []
    for nbytes in sizes:
        total = element_count(int(nbytes), 1 if name == "p2p" else world)
        fn = _collective_fn(name, total, world, rank)
        fn()
        start = time.perf_counter()
        fn()
        warm = _agree(time.perf_counter() - start)
        n = int(min(max_calls, max(calls, point_ms / 1e3 / max(warm, 1e-6))))
        dist.barrier()
        samples = []
        for _ in range(n):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        if name == "p2p":
            samples = [s / 2 for s in samples]
        rows.append({"bytes": total * 4, **stats(samples)})
    return rows


# -- contended messages ----------------------------------------------------------------------------------------------

def _spin(seconds: float) -> int:
    """Small eager ops back to back for ``seconds``, as a training rank's step dispatches them; how many."""
    a, b = torch.ones(8), torch.ones(8)
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(8):
            torch.add(a, b)
        n += 8
    return n


def _pair_call(kind: str, total: int, rank: int, pair, work_s: float):
    """``call(more) -> (seconds, more)`` for ranks 0 and 1, as two pipeline stages: each computes ``work_s`` of small
    eager ops, then they exchange. ``p2p``: rank 0 sends and waits for the answer, which rank 1 sends after its own
    ``work_s`` (its measured length rides in the answer): one way = (round trip - rank 1's work) / 2, the wire and
    the two wake-ups. ``all_reduce``: both compute, then all-reduce over the pair, each timing its call (the one
    that arrived last times the collective itself); ``world_all_reduce`` the same over every rank of the world.
    ``more`` (rank 0's choice) rides in the message, so that the others know whether another call follows."""
    buf, back = torch.zeros(total), torch.empty(total)  # at least 2 elements: [more, seconds of work]
    if kind == "p2p":
        def call(more: bool) -> tuple[float, bool]:
            if rank == 0:
                _spin(work_s)
                buf[0] = 1.0 if more else 0.0
                start = time.perf_counter()
                send = dist.isend(buf, dst=1)
                dist.irecv(back, src=1).wait()
                send.wait()
                return max(time.perf_counter() - start - back[1].item(), 0.0) / 2, more
            dist.irecv(back, src=0).wait()
            start = time.perf_counter()
            _spin(work_s)
            buf[1] = time.perf_counter() - start
            dist.isend(buf, dst=0).wait()
            return float("nan"), back[0].item() != 0.0
        return call

    group = None if kind == "world_all_reduce" else pair

    def all_reduce(more: bool) -> tuple[float, bool]:
        _spin(work_s)
        buf.zero_()
        if rank == 0:
            buf[0] = 1.0 if more else 0.0
        start = time.perf_counter()
        dist.all_reduce(buf, group=group)
        seconds = time.perf_counter() - start
        return seconds, buf[0].item() != 0.0
    return all_reduce


def measure_contended(ctx, sizes, window_ms: float, max_calls: int, work_ms: float, rounds: int) -> dict:
    """Ranks 0 and 1 exchange messages (``CONTENDED``, each side computing ``work_ms`` between them) for a window of
    about ``window_ms`` while ``busy`` = 0 or world - 2 other ranks spin on small eager ops (10% longer than the
    window and 10 ms more, so that the pair's last call still has them busy; with 0 they wait in a barrier);
    ``world_all_reduce`` has every rank compute and all-reduce, at the smallest size (``busy`` = world - 2: while two
    ranks exchange, the others compute). The scheduler tends to stay in one regime for a whole window (the woken rank gets a core at
    once, or after a slice), so each point is ``rounds`` windows, taken in turn with the others'. Rows per kind,
    size and busy of each rank's calls (``seconds``: every call's, in order; empty on a rank that only spun or
    waited)."""
    rank, world = ctx.rank, ctx.world_size
    pair = dist.new_group([0, 1])  # every rank takes part in making it
    window, work = window_ms / 1e3, work_ms / 1e3
    points = [(kind, int(nbytes), busy) for kind in CONTENDED
              for nbytes in (sizes[:1] if kind == "world_all_reduce" else sizes)
              for busy in ([world - 2] if kind == "world_all_reduce" else [0, world - 2])]
    calls, samples = {}, {point: [] for point in points}
    for _ in range(rounds):
        for point in points:
            kind, nbytes, busy = point
            everyone = kind == "world_all_reduce"
            if (rank < 2 or everyone) and point not in calls:
                calls[point] = _pair_call(kind, max(element_count(nbytes, 1), 2), rank, pair, work)
            dist.barrier()
            if point in calls:
                call = calls[point]
                call(True)  # warm-up: the window's first call
                start, more, n = time.perf_counter(), True, 0
                while more:
                    if rank == 0:
                        more = time.perf_counter() - start < window and n + 1 < max_calls
                    seconds, more = call(more)
                    samples[point].append(seconds)
                    n += 1
            elif rank < 2 + busy:
                _spin(1.1 * window + 0.01)
            dist.barrier()
    rows = {kind: [] for kind in CONTENDED}
    for kind, nbytes, busy in points:
        rows[kind].append({"bytes": max(element_count(nbytes, 1), 2) * 4, "busy": busy,
                           "seconds": samples[(kind, nbytes, busy)]})
    return rows


def measure_barrier(calls: int) -> list[float]:
    """``calls`` barriers of the whole world back to back, each timed (what the pipeline executor's step starts
    with)."""
    dist.barrier()
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        dist.barrier()
        samples.append(time.perf_counter() - start)
    return samples


def _no_metric(**_) -> None:
    """Where the trainer's losses go inside the calibration: nowhere (the notebook reads the calibration's metrics as
    its progress)."""


def measure_trainer(ctx, steps: int, repeats: int = 5) -> dict:
    """Chapter 13's trainer (``workers/pipeline/trainer.py``) with one stage on every rank at once (``pp`` = 1,
    GPipe: no message, the same step otherwise, its losses not sent), at 1 and 3 micro-batches for ``steps`` steps:
    the median over the steps after the first of this thread's CPU per step (``step_cpu_s``: a median, because the
    machine's speed can swing for seconds on a shared host) less one barrier's CPU (measured here over 20
    barriers), fitted as a + b m per repeat. ``step_s`` is the median of a over the repeats after the first
    (warm-up), ``micro_batch_s`` of b."""
    dist.barrier()
    start = time.thread_time()
    for _ in range(20):
        dist.barrier()
    barrier_s = (time.thread_time() - start) / 20

    def cpu(m: int) -> float:
        dist.barrier()
        got = train(ctx, schedule="gpipe", micro_batches=m, pp=1, steps=steps, metric=_no_metric)
        return statistics.median(got["step_cpu_s"][1:]) - barrier_s

    a, b = [], []
    for _ in range(repeats):
        per = {m: cpu(m) for m in (1, 3)}
        a.append((3 * per[1] - per[3]) / 2)
        b.append((per[3] - per[1]) / 2)
    return {"step_s": statistics.median(a[1:]), "micro_batch_s": statistics.median(b[1:]), "barrier_cpu_s": barrier_s,
            "steps": steps}


def measure_messaging(ctx, steps: int, messages: int, burst_steps: int) -> dict | None:
    """The CPU a pipeline's messages and waits cost, every rank taking part: ranks 2i and 2i + 1 as two stages pass a
    ``[4, 16]`` float32 tensor back and forth ``messages`` times a step, as the pipeline executor does (the step's
    receives posted before a barrier, ``isend``, each receive waited for where it is needed, each direction of a pair
    on a group of its own as on gloo), each rank computing a burst of ``burst_steps`` calibration ``nn.Linear`` steps
    between a receive and its next send (about the size of one of chapter 13's actions). Every burst follows a wait,
    so it starts cold.

    Per rank, from the CPU clocks (``time.thread_time``: this thread; ``time.process_time``: every thread of the
    process, gloo's transport threads included): ``burst_s`` the CPU of one burst in the pattern, ``main_per_end_s``
    this thread's CPU outside the bursts per message end (a send or a receive: the isend, the posted receive, its
    wait), ``transport_per_end_s`` the other threads' CPU per message end; and on rank 0 ``alone_s``, one burst back
    to back with the other ranks asleep. None in a world of an odd number of ranks."""
    if ctx.world_size % 2:
        return None
    step = linear_fn()

    def burst():
        for _ in range(burst_steps):
            step()

    for _ in range(20):
        burst()  # warm-up

    def alone() -> float:
        start, n = time.thread_time(), 50
        for _ in range(n):
            burst()
        return (time.thread_time() - start) / n

    alone_s = _alone(ctx, alone)
    # pipelines of two stages, each direction of a pair on a group of its own as the executor sends them on gloo
    mesh = Mesh(RankGrid.for_world(ctx.world_size, pp=2), ctx.rank, link_names(ctx.backend, 2))
    pair = mesh.ranks("pp")
    peer, first = pair[1 - pair.index(ctx.rank)], pair[0] == ctx.rank
    to_peer, from_peer = link_group(mesh.links(), ctx.rank, peer), link_group(mesh.links(), peer, ctx.rank)
    send = torch.ones(4, 16)
    bursts_s, thread0, process0 = 0.0, time.thread_time(), time.process_time()
    for _ in range(steps):
        receives = [dist.irecv(torch.empty(4, 16), src=peer, tag=j, group=from_peer) for j in range(messages)]
        dist.barrier()  # every receive of the step is posted before any message of it
        sends = []
        for j in range(messages):
            if not first:
                receives[j].wait()
            start = time.thread_time()
            burst()
            bursts_s += time.thread_time() - start
            sends.append(dist.isend(send, dst=peer, tag=j, group=to_peer))
            if first:
                receives[j].wait()
        for work in sends:
            work.wait()
    thread_s, process_s = time.thread_time() - thread0, time.process_time() - process0
    mesh.destroy()
    n = steps * messages  # bursts; each rank sent n messages and received n
    return {"alone_s": alone_s, "burst_s": bursts_s / n, "main_per_end_s": (thread_s - bursts_s) / (2 * n),
            "transport_per_end_s": (process_s - thread_s) / (2 * n), "bursts": n, "burst_steps": burst_steps}


# -- the run --------------------------------------------------------------------------------------------------------

def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(ctx, shapes: list = SHAPES, dtypes: list = ["float32", "float64"],  # noqa: B006
         sizes: list = SIZES, collectives: list = list(COLLECTIVES), contention_shape: str = "256x256x256",
         repeats: int = 7, target_ms: float = 2.0, window_ms: float = 30.0, windows: int = 3, calls: int = 11,
         max_calls: int = 41, point_ms: float = 50.0, stream_mib: int = 32, contended_sizes: list = CONTENDED_SIZES,
         contended_ms: float = 40.0, contended_calls: int = 100, contended_work_ms: float = 1.0,
         contended_rounds: int = 6, messaging_steps: int = 20, messaging_messages: int = 8,
         messaging_burst_steps: int = 4, trainer_steps: int = 40):
    """Measure matmul rates, per-op overheads, attention and activation kernels, memory bandwidth, contention,
    collectives and messages under contention on these ranks."""
    start = time.perf_counter()
    target_s = target_ms / 1e3
    phases = {}

    def phase(name: str, t0: float) -> None:
        phases[name] = time.perf_counter() - t0
        ctx.metric(step=len(phases), seconds=phases[name])  # progress: one point per phase

    if ctx.device.type != "cpu" or ctx.backend != "gloo":
        raise RuntimeError(f"workers/calibrate.py measures CPU ranks talking through gloo; this rank runs on "
                           f"{ctx.device} with {ctx.backend}: set COURSE_DEVICE=cpu to calibrate the CPU")

    t0 = time.perf_counter()
    matmul = []
    for dtype in dtypes:
        for shape in shapes:
            m, n, k = parse_shape(shape)
            fn = matmul_fn(DTYPES[dtype], m, n, k)
            got = _alone(ctx, lambda: timed(fn, repeats, target_s))
            matmul.append({"dtype": dtype, "m": m, "n": n, "k": k, **(got or {})})
    phase("matmul", t0)

    t0 = time.perf_counter()
    ops = _alone(ctx, lambda: measure_ops(repeats, target_s))
    phase("ops", t0)

    t0 = time.perf_counter()
    kernels = _alone(ctx, lambda: measure_kernels(dtypes, repeats, target_s))
    phase("kernels", t0)

    t0 = time.perf_counter()
    stream = _alone(ctx, lambda: measure_stream(stream_mib, max(3, repeats // 2)))
    phase("stream", t0)

    t0 = time.perf_counter()
    cm, cn, ck = parse_shape(contention_shape)
    n_stream = (stream_mib << 20) // 4
    src, dst = torch.ones(n_stream), torch.empty(n_stream)
    shared = {}
    for kind, fn in {"matmul": matmul_fn(torch.float32, cm, cn, ck), "op": op_fn(),
                     "stream": lambda: dst.copy_(src)}.items():
        alone_s = timed(fn, repeats, target_s)["median"] if ctx.rank == 0 else 1.0  # the others wait in _agree
        shared[kind] = contention(ctx, fn, alone_s, window_ms, windows)
    phase("contention", t0)

    t0 = time.perf_counter()
    coll = {}
    for name in collectives if ctx.world_size > 1 else ():
        if name == "p2p" and ctx.world_size % 2:
            continue  # ping-pong needs pairs of ranks
        coll[name] = measure_collective(ctx, name, sizes, calls, max_calls, point_ms)
    phase("collectives", t0)

    t0 = time.perf_counter()
    contended = None
    if ctx.world_size > 2 and contended_sizes:
        contended = measure_contended(ctx, contended_sizes, contended_ms, contended_calls, contended_work_ms,
                                      contended_rounds)
    barrier = measure_barrier(max(calls, max_calls)) if ctx.world_size > 1 else []
    phase("contended", t0)

    t0 = time.perf_counter()
    messaging = None
    if ctx.world_size > 2 and messaging_steps:
        messaging = measure_messaging(ctx, messaging_steps, messaging_messages, messaging_burst_steps)
    phase("messaging", t0)

    t0 = time.perf_counter()
    trainer = measure_trainer(ctx, trainer_steps) if ctx.world_size > 2 and trainer_steps else None
    phase("trainer", t0)

    return {"cpu": cpu_name(), "capability": torch.backends.cpu.get_cpu_capability(),
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
            "torch": torch.__version__, "world_size": ctx.world_size, "backend": ctx.backend,
            "device": str(ctx.device), "matmul": matmul if ctx.rank == 0 else None, "ops": ops,
            "kernels": kernels, "stream": stream,
            "contention": shared, "contention_shape": [cm, cn, ck], "stream_bytes": n_stream * 4,
            "collectives": coll, "contended": contended, "messaging": messaging, "trainer": trainer,
            "barrier": barrier,
            "phases": phases,
            "seconds": time.perf_counter() - start,
            "params": {"repeats": repeats, "target_ms": target_ms, "window_ms": window_ms, "windows": windows,
                       "calls": calls, "max_calls": max_calls, "point_ms": point_ms, "stream_mib": stream_mib,
                       "contended_sizes": list(contended_sizes), "contended_ms": contended_ms,
                       "contended_calls": contended_calls, "contended_work_ms": contended_work_ms,
                       "contended_rounds": contended_rounds, "messaging_steps": messaging_steps,
                       "messaging_messages": messaging_messages, "messaging_burst_steps": messaging_burst_steps,
                       "trainer_steps": trainer_steps}}


if __name__ == "__main__":
    entrypoint(main)
