"""This machine as a device of chapter 00's planner: its calibration, and the chapters' runs to hold the planner to.

``calibrate()`` runs ``workers/calibrate.py`` on 2 and 4 ranks (the course's thread settings: one intra-op thread
per rank, the ranks sharing the cores) and turns what the ranks measured into a ``MachineCalibration``:

* the per-op overheads that dominate the course's tiny models (one eager op; one op recorded by autograd, forward
  and forward + backward; the fixed cost of a ``backward()`` call; a tiny ``nn.Linear`` step);
* the matmul rate by shape and dtype (FLOP/s = 2 m n k / seconds of ``a @ b``, overhead included: a tiny product is
  its overhead);
* how ranks slow each other when they outnumber the cores (``contention``: time of a matmul, a tiny op and a copy
  with k ranks busy at once, over their time alone);
* fused causal attention (SDPA) and the MLP's activation function (GELU), forward and forward + backward, timed at
  a few sizes (``attention``, ``activation``): on a CPU a tiny attention call costs its setup per head and float64
  erf is compute-bound, so neither is priced by FLOPs or bytes;
* the streaming bandwidth (bytes read + written per second by a large copy);
* one micro-batch's forward and backward through chapter 15's own GPT in this process, one thread, whole and with
  its ring of 2 (a loopback ring: the ring's blocks and buffers without ranks; ``gpt``): the ops of the course's
  model carry Python the op counter does not see (its modules, the ledger's regions, the trainer's loss), those of
  the ring's blocks are bare aten ops, and the planner prices each kind at what it costs here
  (``machine_device.gpt_op_prices``);
* what a pipeline's messages and waits cost in CPU, every rank of a world of 4 in pairs passing small tensors as the
  pipeline executor does (``cold_start_s``: the extra CPU of work that resumes after a wait, against the same work
  back to back; ``message_main_s`` and ``message_transport_s``: a message end's CPU on the rank's own thread and on
  gloo's transport threads);
* what chapter 13's trainer spends on a step besides its actions, every rank training at once (``trainer_step_s``:
  its CPU per step at no micro-batch, from its one-stage runs at 1 and 3; the batch, the step's message objects,
  the reported gradients and timeline, the optimizer step: Python between tiny actions that no op count sees);
* per collective and world size an alpha (seconds) and a beta (seconds per byte of nccl-tests' S: the whole buffer;
  for all_gather the gathered output, for reduce_scatter the unreduced input, for all_to_all each rank's buffer),
  fitted to the medians by least squares on the relative error (sizes span six decades: a plain least squares
  would fit the largest messages only), with the fit's worst relative error on its own medians; ``p2p`` (one way,
  from a ping-pong) fitted the same way.

The calibration is cached for the session (keyed on the CPU capability, the world sizes and the worker's
parameters) and in a JSON file under the scratch folder (``build/scratch/calibration/``, never a tracked path),
reused while the machine, torch and the worker are the same (``refresh=True`` measures again).

``measure_runs()`` runs the chapters' own steps on the ranks and reports each run's median step time (the wall time
from one step's end to the next's, on every rank; per step the median over ranks, then the median over the steps,
the first left out as warm-up), with everything a predictor needs to rebuild the run: chapter 15's layouts
(``workers/ch15_composed.py``, as ``course_utils/ch15.py`` runs them) and chapter 13's schedules
(``workers/ch13_pipeline.py``, as ``notebooks/src/13_pipeline_parallel.py`` runs them), padded to the chapter's
calibrated waits and not. These are CPU timings on a shared machine: medians of repeats (the kernels' the least
repeat), and they vary by machine.

A shared virtual machine's speed swings with nothing else running on it (a tiny op took 1.06-1.16 us in the quiet
moments of the 2-core EPYC VM this was written on, 1.8-2.1 us in its slow stretches, which last from a third of a
second to seconds). So
``probe_host()`` times a tiny op in this process before and after the calibration and each measured run, and
``host_slowdown`` says how much slower the slowest of those probes ran than the quietest this session has seen: a
run measured while the host slowed down by more than ``SLOW_HOST`` is measured again (``measured_quietly``: up to
``HOST_TRIES`` times in all, the least slowed kept), and every row says how slowed down its host was.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from course_utils import progress
from course_utils.launcher import cores
from course_utils.launcher import run as run_worker
from course_utils.paths import ROOT
from course_utils.scratch import SCRATCH
from course_utils.tables import Table

WORKER = "workers.calibrate"
CH13_WORKER = "workers.ch13_pipeline"
CH15_WORKER = "workers.ch15_composed"
WORLD_SIZES = (2, 4)
TIMEOUT_S = 120.0  # one calibration run: 3 s on 2 ranks, 13-16 s on 4 (4 s of contended messages, 2-4 s of a trainer; warm ranks)
RUN_TIMEOUT_S = 120.0  # one measured run of a chapter
CH13_TIMED = {"forward_ms": 20.0, "backward_ms": 40.0}  # chapter 13's TIMED padding (t_B = 2 t_F)
FORMAT = 2  # of the JSON file; a file of another format is measured again (fields added since have defaults)
# A probe this much slower than the session's quietest: the host was in a slow stretch. On the 2-core EPYC VM
# (2026-12-07, 98 probes around 48 runs of chapters 13 and 15) quiet probes read 1.06-1.16 us per op, 10% apart, and
# the slow stretches 1.8-2.1 us; 1.3 sits between with room for a noisier quiet
SLOW_HOST = 1.3
# A run or a calibration measured at most this many times while the host is slow. Once more only: its slow stretches
# came and went within a third of a second as often as they lasted seconds (probes 0.3 s apart read 1.1 then 2.1 us),
# so a third try rarely met a quieter host, and on a machine that stays busy every try costs as much as the first
HOST_TRIES = 2


def _scratch() -> Path:
    return Path(os.environ.get("COURSE_SCRATCH_DIR") or SCRATCH) / "calibration"


# -- fits -------------------------------------------------------------------------------------------------------------

def fit_alpha_beta(sizes: list[float], seconds: list[float]) -> tuple[float, float, float]:
    """``(alpha, beta, worst)``: ``t = alpha + beta * bytes`` minimising the sum of squared *relative* errors (each
    median counts alike, from 8 bytes to megabytes), and the worst relative error of the fit on these points.

    If the unconstrained fit makes one coefficient negative (a flat, falling or noisy curve), that coefficient is
    held at a floor a millionth of what the data could carry (1e-6 of the smallest time, of the smallest time per
    byte: it moves no point by more than 1e-6 of its time) and the other refitted: both stay positive, and
    ``worst`` says how well it went."""
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise ValueError(f"an alpha-beta fit needs at least two (size, seconds) points, got {len(sizes)}")
    if not all(t > 0 and math.isfinite(t) for t in seconds):
        raise ValueError(f"an alpha-beta fit needs positive finite times, got {seconds}")
    # rows [1/t, S/t] . [alpha, beta] = 1
    a = [(1 / t, s / t) for s, t in zip(sizes, seconds)]
    s11 = sum(x * x for x, _ in a)
    s12 = sum(x * y for x, y in a)
    s22 = sum(y * y for _, y in a)
    r1, r2 = sum(x for x, _ in a), sum(y for _, y in a)
    det = s11 * s22 - s12 * s12
    alpha, beta = ((r1 * s22 - r2 * s12) / det, (s11 * r2 - s12 * r1) / det) if det > 0 else (-1.0, -1.0)
    if not (alpha > 0 and beta > 0):
        floor_a, floor_b = 1e-6 * min(seconds), 1e-6 * min(t / max(s, 1) for s, t in zip(sizes, seconds))
        # beta alone (alpha at its floor): minimise sum((floor_a/t + beta S/t - 1)^2)
        b_only = max(floor_b, sum(y * (1 - floor_a * x) for x, y in a) / s22)
        a_only = max(floor_a, sum(x * (1 - floor_b * y) for x, y in a) / s11)
        candidates = [(floor_a, b_only), (a_only, floor_b)]
        alpha, beta = min(candidates, key=lambda ab: sum((ab[0] * x + ab[1] * y - 1) ** 2 for x, y in a))
    worst = max(abs(alpha + beta * s - t) / t for s, t in zip(sizes, seconds))
    return alpha, beta, worst


_QUIETEST = [math.inf]  # the quietest probe this process has taken


def _tiny_op_seconds(ops: int, bursts: int) -> float:
    a = torch.ones(8)
    times = []
    for _ in range(bursts):
        start = time.perf_counter()
        for _ in range(ops):
            a + a
        times.append((time.perf_counter() - start) / ops)
    return statistics.median(times)  # the median burst: the first one warms the caches


def probe_host(ops: int = 2000, bursts: int = 5) -> float:
    """Seconds per tiny eager op (``a + a`` on 8 floats) in this process, the median of ``bursts`` bursts of ``ops``
    (about 15 ms): how fast the host runs at this moment. Remembers the quietest probe of the session."""
    probe = _tiny_op_seconds(ops, bursts)
    _QUIETEST[0] = min(_QUIETEST[0], probe)
    return probe


def host_slowdown(probes) -> float:
    """The slowest of ``probes`` over the quietest probe this process has taken: 1.0 when the host ran as fast as
    it has this session, 1.8 when a tiny op took 1.8 times as long."""
    probes = [p for p in probes if p > 0]
    return max(probes) / min(_QUIETEST[0], *probes) if probes else float("nan")


def measured_quietly(measure, again: str):
    """``measure()`` between two ``probe_host`` calls, once more (``HOST_TRIES`` in all) while the host ran more than
    ``SLOW_HOST`` times slower around it, saying so with ``again``: (the least slowed result, its probes, its
    slowdown, the tries made). The one rule for the calibration and for every measured run."""
    best = None
    for tries in range(1, HOST_TRIES + 1):
        before = probe_host()
        result = measure()
        probes = (before, probe_host())
        slowdown = host_slowdown(probes)
        if best is None or slowdown < best[2]:
            best = (result, probes, slowdown)
        if best[2] <= SLOW_HOST:
            break
        if tries < HOST_TRIES:
            progress.say(f"the host ran {slowdown:.1f}x slower around {again}: measuring it again")
    return (*best, tries)


def _median(values) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


# -- the calibration --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MachineCalibration:
    """What this machine's ranks cost, measured (see the module's docstring for each quantity's definition).

    Times in seconds, rates in FLOP/s, bandwidths in bytes/s; one rank's costs are measured with the other ranks
    asleep, and ``contention`` says how much slower a kind of work goes with k ranks busy at once.
    ``collectives[(name, world)] = (alpha, beta)`` with beta in seconds per byte of the collective's whole buffer S;
    ``p2p = (alpha, beta)`` one way, at the largest world measured (``collectives[("p2p", world)]`` at each).
    ``raw[world]`` keeps the medians the fits were made from."""

    cpu: str
    capability: str  # torch.backends.cpu.get_cpu_capability()
    cores: int  # len(os.sched_getaffinity(0))
    threads_per_rank: int  # torch.get_num_threads() on a rank
    world_sizes: tuple[int, ...]
    torch_version: str
    op_s: float  # one eager op (a + b on 8 floats)
    op_forward_s: float  # one op recorded by autograd (y * w, w a leaf), forward only
    op_forward_backward_s: float  # the same op, forward + its share of backward
    backward_call_s: float  # fixed cost of a backward() call (and the sum before it)
    linear_forward_backward_s: float  # nn.Linear(32, 32) on [8, 32]: forward, sum, backward
    matmul: tuple[tuple[str, int, int, int, float], ...]  # (dtype, m, n, k, FLOP/s), overhead included
    stream_bandwidth: float  # bytes read + written per second by a large copy
    contention: tuple[tuple[str, int, float], ...]  # (kind "matmul" | "op" | "stream", ranks busy, time / alone)
    collectives: dict = field(default_factory=dict)  # {(name, world): (alpha_s, beta_s_per_byte)}
    fit_error: dict = field(default_factory=dict)  # {(name, world): worst relative error of the fit}
    p2p: tuple[float, float] = (0.0, 0.0)  # (alpha_s, beta_s_per_byte), one way
    adamw_step_s: float = 0.0  # one AdamW step (float64, one parameter at a time as on CPU) over adamw_shapes
    adamw_shapes: tuple[tuple[int, ...], ...] = ()
    contended_world: int = 0  # the world the contended messages were measured in (0: none was)
    p2p_busy: tuple[float, float] = (0.0, 0.0)  # (alpha_s, beta_s_per_byte) one way, every other rank busy
    p2p_quiet: tuple[float, float] = (0.0, 0.0)  # the same pair and work, the other ranks idle
    all_reduce_busy: tuple[float, float] = (0.0, 0.0)  # two ranks' all-reduce, every other rank busy
    all_reduce_quiet: tuple[float, float] = (0.0, 0.0)  # the same, the other ranks idle
    world_all_reduce_busy: tuple[float, float] = (0.0, 0.0)  # every rank of contended_world computing, all-reducing
    barrier: tuple[tuple[int, float], ...] = ()  # (world, mean seconds of one barrier of the whole world)
    # a pipeline's messages and waits, every rank of messaging_world in pairs (workers/calibrate.py: measure_messaging)
    messaging_world: int = 0  # 0: not measured
    cold_start_s: float = 0.0  # extra CPU of a burst of work that starts after a wait, over the same back to back
    message_main_s: float = 0.0  # a rank's own CPU per message end (isend, posted receive, its wait)
    message_transport_s: float = 0.0  # its other threads' CPU per message end (gloo's transport threads)
    # chapter 13's trainer, one stage on every rank of trainer_world (workers/calibrate.py: measure_trainer)
    trainer_world: int = 0  # 0: not measured
    trainer_step_s: float = 0.0  # its CPU per step besides its actions (the fit's intercept at no micro-batch)
    # (dtype, batch x heads, seq, head_dim, forward_s, forward_backward_s): causal SDPA on [1, b x h, s, d]
    attention: tuple[tuple[str, int, int, int, float, float], ...] = ()
    activation: tuple[tuple[str, int, float, float], ...] = ()  # (dtype, elements, forward_s, forward_backward_s): GELU
    # (cp, micro-batch, seconds): one micro-batch's forward and backward through chapter 15's whole default GPT in the
    # calibrating process, one thread, the ring a loopback ring under cp > 1 (machine_device.time_gpt)
    gpt: tuple[tuple[int, int, float], ...] = ()
    measured_at: str = ""  # ISO time
    seconds: float = 0.0  # wall time of the calibration
    host_probe_s: tuple[float, ...] = ()  # probe_host() before and after it, in the process that calibrated
    host_slowdown: float = 0.0  # host_slowdown(host_probe_s) then (0: not probed)
    params: dict = field(default_factory=dict)  # the worker's parameters (beyond its defaults)
    raw: dict = field(default_factory=dict)  # {world: medians, as aggregated over the ranks}

    # -- reading it -----------------------------------------------------------------------------------------------
    def barrier_seconds(self, world: int) -> float:
        """One barrier of ``world`` ranks as measured (the nearest world measured; 0 for one rank or none)."""
        if world <= 1 or not self.barrier:
            return 0.0
        return min(self.barrier, key=lambda wt: (abs(wt[0] - world), -wt[0]))[1]

    def collective_seconds(self, name: str, world: int, nbytes: float) -> float:
        alpha, beta = self.collectives[(name, world)]
        return alpha + beta * nbytes

    def slowdown(self, busy: int, kind: str = "matmul") -> float:
        """Time of ``kind`` with ``busy`` ranks working at once over its time alone (past the ranks measured: the
        last measured slowdown, scaled by busy ranks; 1 when nothing was measured)."""
        rows = sorted((k, s) for what, k, s in self.contention if what == kind)
        if not rows:
            return 1.0
        for k, s in rows:
            if k >= busy:
                return s
        return rows[-1][1] * busy / rows[-1][0]

    def link_fits(self) -> tuple[tuple[str, int, float, float], ...]:
        """Every fit as ``(collective, ranks, alpha_s, beta_s_per_byte)`` (``p2p`` included): ``hardware.Link.fitted``'s
        form."""
        return tuple((n, w, a, b) for (n, w), (a, b) in sorted(self.collectives.items()))

    def matmul_rows(self, dtype: str) -> list[tuple[int, int, int, float]]:
        """``[(m, n, k, FLOP/s)]`` measured in ``dtype``."""
        return [(m, n, k, f) for d, m, n, k, f in self.matmul if d == dtype]

    # -- JSON -----------------------------------------------------------------------------------------------------
    def to_json(self) -> str:
        d = asdict(self)
        d["collectives"] = [[n, w, a, b] for (n, w), (a, b) in sorted(self.collectives.items())]
        d["fit_error"] = [[n, w, e] for (n, w), e in sorted(self.fit_error.items())]
        d["raw"] = {str(w): v for w, v in self.raw.items()}
        return json.dumps({"format": FORMAT, **d}, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "MachineCalibration":
        d = json.loads(text)
        if d.pop("format", None) != FORMAT:
            raise ValueError(f"not a machine calibration of format {FORMAT}")
        d["world_sizes"] = tuple(d["world_sizes"])
        d["matmul"] = tuple(tuple(r) for r in d["matmul"])
        d["contention"] = tuple(tuple(r) for r in d["contention"])
        d["collectives"] = {(n, int(w)): (a, b) for n, w, a, b in d["collectives"]}
        d["fit_error"] = {(n, int(w)): e for n, w, e in d["fit_error"]}
        d["p2p"] = tuple(d["p2p"])
        for name in CONTENDED_FITS:  # absent from older files
            if name in d:
                d[name] = tuple(d[name])
        d["adamw_shapes"] = tuple(tuple(s) for s in d.get("adamw_shapes", ()))
        d["barrier"] = tuple((int(w), t) for w, t in d.get("barrier", ()))
        d["attention"] = tuple(tuple(r) for r in d.get("attention", ()))  # absent from older files
        d["activation"] = tuple(tuple(r) for r in d.get("activation", ()))
        d["gpt"] = tuple(tuple(r) for r in d.get("gpt", ()))
        d["raw"] = {int(w): v for w, v in d["raw"].items()}
        d["host_probe_s"] = tuple(d.get("host_probe_s", ()))
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    # -- for the notebook -----------------------------------------------------------------------------------------
    def summary(self) -> Table:
        """One table: the machine, the overheads, the matmul rates, the bandwidth, contention, every alpha-beta fit."""
        us, gf = 1e6, 1e-9
        rows = [["machine", f"{self.cpu}, {self.capability}, {self.cores} cores, {self.threads_per_rank} thread(s) "
                            f"per rank, torch {self.torch_version}"],
                ["one eager op", f"{self.op_s * us:.2f} us"],
                ["one autograd op, forward", f"{self.op_forward_s * us:.2f} us"],
                ["one autograd op, forward + backward", f"{self.op_forward_backward_s * us:.2f} us"],
                ["a backward() call", f"{self.backward_call_s * us:.1f} us"],
                ["nn.Linear(32, 32) on [8, 32], forward + backward", f"{self.linear_forward_backward_s * us:.1f} us"],
                ["stream (copy)", f"{self.stream_bandwidth * gf:.1f} GB/s"]]
        for dtype in sorted({r[0] for r in self.matmul}):
            rates = ", ".join(f"{m}x{n}x{k} {f * gf:.3g}" for m, n, k, f in self.matmul_rows(dtype))
            rows.append([f"matmul {dtype} (GFLOP/s)", rates])
        for dtype in sorted({r[0] for r in self.attention}):
            cells = ", ".join(f"{bh}x{sq}x{hd} {f * us:.0f} / {fb * us:.0f}"
                              for d, bh, sq, hd, f, fb in self.attention if d == dtype)
            rows.append([f"causal SDPA {dtype}, [b x h]x[seq]x[head_dim]: forward / + backward (us)", cells])
        for dtype in sorted({r[0] for r in self.activation}):
            cells = ", ".join(f"{n} {f * us:.0f} / {fb * us:.0f}" for d, n, f, fb in self.activation if d == dtype)
            rows.append([f"GELU {dtype}, elements: forward / + backward (us)", cells])
        if self.gpt:
            cells = ", ".join(f"cp {cp}, micro-batch {mb}: {t * 1e3:.2f} ms" for cp, mb, t in self.gpt)
            rows.append(["chapter 15's GPT, one micro-batch forward + backward, one process", cells])
        for kind in ("matmul", "op", "stream"):
            cells = ", ".join(f"{k}: {s:.2f}x" for what, k, s in self.contention if what == kind)
            if cells:
                rows.append([f"{kind}: time with k ranks busy / alone", cells])
        for (name, world), (alpha, beta) in sorted(self.collectives.items()):
            rows.append([f"{name}, {world} ranks", f"alpha {alpha * us:.0f} us, 1/beta {1 / beta * gf:.2f} GB/s "
                                                   f"(worst fit error {self.fit_error[(name, world)]:.0%})"])
        if self.contended_world:
            for what, fit in (("p2p, others busy", self.p2p_busy), ("p2p, others idle", self.p2p_quiet),
                              ("all_reduce, others busy", self.all_reduce_busy),
                              ("all_reduce, others idle", self.all_reduce_quiet)):
                rows.append([f"{what}: 2 of {self.contended_world} ranks", f"alpha {fit[0] * us:.0f} us, "
                                                                           f"{fit[1] * 1e12:.0f} ps/byte"])
        if self.messaging_world:
            rows.append([f"pipeline messages, {self.messaging_world} ranks in pairs: a burst that starts after a wait",
                         f"{self.cold_start_s * us:.0f} us more CPU than back to back"])
            rows.append(["CPU per message end: the rank's own thread / its transport threads",
                         f"{self.message_main_s * us:.0f} / {self.message_transport_s * us:.0f} us"])
        if self.trainer_world:
            rows.append([f"chapter 13's trainer, {self.trainer_world} ranks at once: a step besides its actions",
                         f"{self.trainer_step_s * us:.0f} us of CPU"])
        for world, t in self.barrier:
            rows.append([f"barrier, {world} ranks", f"{t * us:.0f} us"])
        if self.host_probe_s:
            rows.append(["the host around it: a tiny op in this process before / after (slowdown against the "
                         "quietest probe then)", " / ".join(f"{p * us:.2f}" for p in self.host_probe_s)
                         + f" us ({self.host_slowdown:.2f}x)"])
        if self.adamw_step_s:
            rows.append([f"AdamW step, {len(self.adamw_shapes)} float64 tensors", f"{self.adamw_step_s * us:.0f} us"])
        return Table(["quantity", "measured"], rows,
                     caption=f"this machine, measured {self.measured_at} in {self.seconds:.1f} s (CPU timings: they "
                             "vary by machine and by load)")

    def collective_table(self) -> Table:
        """Per collective and world: each size's measured median and what the fit says."""
        rows = []
        for (name, world), (alpha, beta) in sorted(self.collectives.items()):
            for nbytes, t in self.raw[world]["collectives"][name]:
                fit = alpha + beta * nbytes
                rows.append([name, world, nbytes, f"{t * 1e6:.0f}", f"{fit * 1e6:.0f}", f"{fit / t - 1:+.0%}"])
        return Table(["collective", "ranks", "bytes", "measured us", "fit us", "fit error"], rows)


CONTENDED_FITS = ("p2p_busy", "p2p_quiet", "all_reduce_busy", "all_reduce_quiet", "world_all_reduce_busy")
OPS = ("op_s", "op_forward_s", "op_forward_backward_s", "backward_call_s", "linear_forward_backward_s",
       "adamw_step_s")


DISTRIBUTION = ("median", "q1", "q3", "min", "max", "calls", "mean")  # _distribution's list; mean: of the middle 80%
CONTENDED_COLUMNS = ("bytes", "busy", *DISTRIBUTION)  # a contended row
CONTENDED_STAT = "mean"  # what the contended fits and the barrier are made of


def _distribution(samples: list[float]) -> list[float]:
    """[median, first quartile, third quartile, min, max, count, mean of the middle 80%] of ``samples`` (NaN left
    out)."""
    xs = sorted(x for x in samples if x == x)
    if not xs:
        return [float("nan")] * 5 + [0, float("nan")]
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else (xs[0],) * 3
    cut = len(xs) // 10
    return [statistics.median(xs), q1, q3, xs[0], xs[-1], len(xs), statistics.fmean(xs[cut:len(xs) - cut])]


def contended_rows(ranks: list[dict]) -> dict:
    """The contended messages of one run as ``{kind: [[bytes, busy, median, q1, q3, min, max, calls, mean], ...]}``
    (``mean``: of the middle 80% of the calls): a ping-pong's one way as rank 0 timed it; an all-reduce per call the
    least of its ranks' times (the rank that arrived last times the collective itself, the others also their wait
    for it)."""
    r0 = ranks[0].get("contended")
    if not r0:
        return {}
    out = {}
    for kind, rows in r0.items():
        out[kind] = []
        for i, row in enumerate(rows):
            seconds = row["seconds"]
            if kind != "p2p":
                takers = [r["contended"][kind][i]["seconds"] for r in ranks if r["contended"][kind][i]["seconds"]]
                seconds = [min(call) for call in zip(*takers)]
            out[kind].append([row["bytes"], row["busy"], *_distribution(seconds)])
    return out


def messaging_medians(ranks: list[dict]) -> dict:
    """The messaging pattern's CPU (``workers/calibrate.py: measure_messaging``) as the median over the ranks (every
    rank took part), the burst alone as rank 0 timed it; {} where it was not measured."""
    if not ranks[0].get("messaging"):
        return {}
    out = {k: _median(r["messaging"][k] for r in ranks) for k in ("burst_s", "main_per_end_s", "transport_per_end_s")}
    return {"alone_s": ranks[0]["messaging"]["alone_s"], **out}


def aggregate(ranks: list[dict]) -> dict:
    """One calibration run's rank results as one world's medians: one rank's costs from rank 0 (measured alone),
    contention as the median over the busy ranks, a collective's time as its slowest rank's median; the contended
    messages as ``contended_rows``, and the barrier's calls (each its slowest rank's) as a ``DISTRIBUTION``."""
    r0, world = ranks[0], len(ranks)
    matmul = [{k: row[k] for k in ("dtype", "m", "n", "k", "median", "min", "max")} for row in r0["matmul"]]
    ops = {k: r0["ops"][k] for k in (*OPS, "chain", "chain_forward_s", "chain_forward_backward_s", "adamw_shapes")}
    kernels = r0.get("kernels") or {"attention": [], "activation": []}
    stream = {k: r0["stream"][k] for k in ("bytes", "copy_bytes_per_s", "add_bytes_per_s")}
    contention = {kind: [{"active": row["active"], "calls": row["calls"],
                          "seconds": _median(r["contention"][kind][i]["seconds"] for r in ranks)}
                         for i, row in enumerate(rows)] for kind, rows in r0["contention"].items()}
    coll = {name: [[row["bytes"], max(r["collectives"][name][i]["median"] for r in ranks)]
                   for i, row in enumerate(rows)] for name, rows in r0["collectives"].items()}
    # the same, as each rank's mean of the middle 80% of its calls (what many calls cost on average)
    coll_mean = {name: [[row["bytes"], max(r["collectives"][name][i]["mean"] for r in ranks)]
                        for i, row in enumerate(rows)] for name, rows in r0["collectives"].items()}
    barrier = [max(r["barrier"][i] for r in ranks) for i in range(len(r0.get("barrier") or []))]
    return {"world": world, "matmul": matmul, "ops": ops, "kernels": kernels, "stream": stream,
            "contention": contention, "messaging": messaging_medians(ranks),
            "trainer": _median(r["trainer"]["step_s"] for r in ranks) if r0.get("trainer") else None,
            "contended": contended_rows(ranks), "barrier": _distribution(barrier) if barrier else [],
            "contention_shape": r0["contention_shape"], "stream_bytes": r0["stream_bytes"], "collectives": coll,
            "collectives_mean": coll_mean,
            "rank_seconds": max(r["seconds"] for r in ranks), "phases": r0["phases"]}


def build(per_world: dict[int, list[dict]], *, seconds: float = 0.0, params: dict | None = None,
          host_probe_s: tuple[float, ...] = (), gpt: tuple = ()) -> MachineCalibration:
    """A ``MachineCalibration`` from the ranks' results of each world (``{world: res.ranks}``): one rank's costs
    are the median over the worlds (the same quantity, measured in each), contention the largest world's."""
    worlds = tuple(sorted(per_world))
    raw = {w: aggregate(per_world[w]) for w in worlds}
    r0 = per_world[worlds[0]][0]
    matmul = []
    for i, row in enumerate(raw[worlds[0]]["matmul"]):
        t = _median(raw[w]["matmul"][i]["median"] for w in worlds)
        matmul.append((row["dtype"], row["m"], row["n"], row["k"], 2.0 * row["m"] * row["n"] * row["k"] / t))
    kernels = [raw[w]["kernels"] for w in worlds]
    attention = tuple((row["dtype"], row["batch_heads"], row["seq"], row["head_dim"],
                       *(_median(k["attention"][i][t] for k in kernels) for t in ("forward_s", "forward_backward_s")))
                      for i, row in enumerate(kernels[0]["attention"]))
    activation = tuple((row["dtype"], row["elements"],
                        *(_median(k["activation"][i][t] for k in kernels) for t in ("forward_s", "forward_backward_s")))
                       for i, row in enumerate(kernels[0]["activation"]))
    top = raw[worlds[-1]]["contention"]
    contention = tuple((kind, c["active"], c["seconds"] / rows[0]["seconds"]) for kind, rows in top.items()
                       for c in rows)
    collectives, errors = {}, {}
    for w in worlds:
        for name, points in raw[w]["collectives"].items():
            alpha, beta, worst = fit_alpha_beta([b for b, _ in points], [t for _, t in points])
            collectives[(name, w)], errors[(name, w)] = (alpha, beta), worst
    p2p_worlds = [w for w in worlds if ("p2p", w) in collectives]
    one = {k: _median(raw[w]["ops"][k] for w in worlds) for k in OPS}
    contended = _contended_fits(raw, collectives)
    messaging = _messaging(raw)
    trained = [w for w in worlds if raw[w].get("trainer") is not None]
    trainer = {"trainer_world": trained[-1], "trainer_step_s": max(0.0, raw[trained[-1]]["trainer"])} if trained else {}
    return MachineCalibration(
        cpu=r0["cpu"], capability=r0["capability"], cores=r0["cores"], threads_per_rank=r0["threads"],
        world_sizes=worlds, torch_version=r0["torch"], **one, matmul=tuple(matmul), attention=attention,
        activation=activation, gpt=tuple(tuple(r) for r in gpt),
        stream_bandwidth=_median(raw[w]["stream"]["copy_bytes_per_s"] for w in worlds),
        contention=contention, collectives=collectives, fit_error=errors,
        p2p=collectives[("p2p", max(p2p_worlds))] if p2p_worlds else (0.0, 0.0),
        adamw_shapes=tuple(tuple(s) for s in r0["ops"]["adamw_shapes"]), **contended, **messaging,
        **trainer,
        barrier=tuple((w, raw[w]["barrier"][DISTRIBUTION.index(CONTENDED_STAT)]) for w in worlds if raw[w]["barrier"]),
        measured_at=datetime.datetime.now().astimezone().isoformat(timespec="seconds"), seconds=seconds,
        host_probe_s=tuple(host_probe_s), host_slowdown=host_slowdown(host_probe_s) if host_probe_s else 0.0,
        params=dict(params or {}), raw=raw)


def alpha_at(beta: float, sizes: list[float], seconds: list[float]) -> float:
    """The alpha of ``t = alpha + beta * bytes`` with ``beta`` given, least squares on the relative error (as
    ``fit_alpha_beta``), at least a millionth of the smallest time."""
    alpha = sum((t - beta * s) / t**2 for s, t in zip(sizes, seconds)) / sum(1 / t**2 for t in seconds)
    return max(alpha, 1e-6 * min(seconds))


def _contended_fits(raw: dict, collectives: dict) -> dict:
    """The contended fields of the largest world that measured them: per kind and state (every other rank busy,
    ``busy`` = world - 2, or none, ``busy`` = 0) the alpha of the mean calls (``CONTENDED_STAT``) over the sizes,
    with the beta of the same transfer's back-to-back fit (``p2p`` at that world for the ping-pong, the 2-rank
    ``all_reduce`` for the pair's, the world's ``all_reduce`` for ``world_all_reduce``): the bytes move as fast once
    the rank runs; what contention adds is a wait for a core once per message, and two sizes measured in a few
    noisy windows cannot tell a bandwidth apart. The mean, not the median: a contended message's time is bimodal
    (a core is free at once, or after the scheduler's slice), and what a schedule's many messages add up to is the
    mean."""
    worlds = [w for w in sorted(raw) if raw[w]["contended"]]
    if not worlds:
        return {}
    world = worlds[-1]
    out = {"contended_world": world}
    column = CONTENDED_COLUMNS.index(CONTENDED_STAT)
    rows = raw[world]["contended"]
    betas = {"p2p": ("p2p", world), "all_reduce": ("all_reduce", 2), "world_all_reduce": ("all_reduce", world)}
    for kind, states in (("p2p", ("busy", "quiet")), ("all_reduce", ("busy", "quiet")), ("world_all_reduce", ("busy",))):
        beta = collectives.get(betas[kind], (0.0, 0.0))[1]
        for state in states:
            busy = world - 2 if state == "busy" else 0
            got = [(r[0], r[column]) for r in rows.get(kind, []) if r[1] == busy and r[column] > 0]
            if got:
                out[f"{kind}_{state}"] = (alpha_at(beta, [b for b, _ in got], [t for _, t in got]), beta)
    return out


def _messaging(raw: dict) -> dict:
    """The messaging fields of the largest world that measured them: the cold start is a burst in the pattern less
    the same burst back to back (never below 0), the message ends' CPU as measured."""
    worlds = [w for w in sorted(raw) if raw[w].get("messaging")]
    if not worlds:
        return {}
    got = raw[worlds[-1]]["messaging"]
    return {"messaging_world": worlds[-1], "cold_start_s": max(0.0, got["burst_s"] - got["alone_s"]),
            "message_main_s": got["main_per_end_s"], "message_transport_s": got["transport_per_end_s"]}


_CACHE: dict[tuple, MachineCalibration] = {}
TRAINER_CODE = ("pipeline/trainer.py", "pipeline/executor.py", "pipeline/p2p.py", "pipeline/model.py")
GPT_CODE = ("composed/model.py", "parallel/gpt.py", "context_parallel/attention.py", "context_parallel/ring.py")


def _worker_digest() -> str:
    """The code that measured a stored calibration: the rank script, the timing it runs, chapter 13's trainer and
    chapter 15's model."""
    code = b"".join((ROOT / "workers" / name).read_bytes()
                    for name in ("calibrate.py", "timing/cpu.py", *TRAINER_CODE, *GPT_CODE))
    return hashlib.sha1(code).hexdigest()[:12]


def _key(world_sizes: tuple, params: dict) -> tuple:
    return (torch.backends.cpu.get_cpu_capability(), tuple(world_sizes), json.dumps(params, sort_keys=True))


def cache_file(world_sizes=WORLD_SIZES, **params) -> Path:
    """Where ``calibrate(world_sizes, **params)`` keeps its result between sessions."""
    cap, worlds, p = _key(tuple(world_sizes), params)
    tag = hashlib.sha1(p.encode()).hexdigest()[:8]
    return _scratch() / f"machine_{cap}_w{'-'.join(map(str, worlds))}_{tag}.json"


def _fresh(cal: MachineCalibration) -> bool:
    """A stored calibration still describes this machine: same CPU, cores, threads, torch and worker."""
    return (cal.capability == torch.backends.cpu.get_cpu_capability() and cal.torch_version == torch.__version__
            and cal.cores == cores() and cal.params.get("_worker") == _worker_digest()
            and cal.threads_per_rank == int(os.environ.get("COURSE_THREADS_PER_RANK", 1)))


def calibrate(world_sizes=WORLD_SIZES, *, refresh: bool = False, timeout: float = TIMEOUT_S, store: bool = True,
              **params) -> MachineCalibration:
    """Measure this machine on ``world_sizes`` ranks (``params`` go to ``workers/calibrate.py``: fewer ``shapes``,
    ``sizes``, ``repeats`` for a quick run), or return the session's (or the stored) calibration of the same
    settings. ``refresh=True`` measures again; ``store=False`` keeps the result out of the JSON file."""
    world_sizes = tuple(sorted(world_sizes))
    key = _key(world_sizes, params)
    if not refresh and key in _CACHE:
        return _CACHE[key]
    path = cache_file(world_sizes, **params)
    if not refresh and path.is_file():
        try:
            cal = MachineCalibration.from_json(path.read_text())
            if _fresh(cal):
                _CACHE[key] = cal
                return cal
        except (ValueError, KeyError, TypeError):
            pass  # an older or damaged file: measure again
    from .machine_device import GPT_TIMED, time_gpt

    def measure():
        start, per_world = time.perf_counter(), {}
        for w in world_sizes:
            progress.say(f"calibrating this machine on {w} ranks")
            per_world[w] = run_worker(WORKER, world_size=w, timeout=timeout, **params).ranks
        progress.say("timing chapter 15's model in this process")
        gpt = tuple((cp, mb, time_gpt(cp, mb)) for cp, mb in GPT_TIMED)
        return per_world, gpt, time.perf_counter() - start

    # on a slowed host every constant would read high, and every prediction with them
    (per_world, gpt, seconds), probes, _, _ = measured_quietly(measure, "the calibration")
    cal = build(per_world, seconds=seconds, params={**params, "_worker": _worker_digest()}, host_probe_s=probes,
                gpt=gpt)
    _CACHE[key] = cal
    if store:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # two chapters may calibrate at once
        tmp.write_text(cal.to_json())
        tmp.replace(path)
    return cal


# -- the measured side: the chapters' runs ------------------------------------------------------------------------------

@dataclass(frozen=True)
class RunSpec:
    """One run to measure: the chapter, a name, the worker, the world size and the worker's parameters."""

    chapter: int
    name: str
    worker: str
    world: int
    params: dict


def ch15_params(layout: str, **options) -> dict:
    """The worker parameters chapter 15 runs ``layout`` with (``course_utils/ch15.py: layout_for`` and
    ``worker_params``: two micro-batches per rank when there is a pipeline, unless given)."""
    from workers.layout import Layout

    options = {"micro_batches": 2 if Layout.parse(layout).pp > 1 else 1, **options}
    layout_keys = ("zero", "sequence_parallel", "micro_batches", "schedule", "virtual_stages", "split")
    lay = Layout.parse(layout, **{k: v for k, v in options.items() if k in layout_keys})
    out = {d: getattr(lay, d) for d in ("dp", "tp", "pp", "cp", *layout_keys)}
    return {**out, **{k: v for k, v in options.items() if k not in layout_keys}}


def default_runs(chapters=(13, 15), *, padded: bool = True, unpadded: bool = True,
                 two_rank_layouts: bool = True) -> list[RunSpec]:
    """The runs the planner is held to: chapter 15's 4-rank layouts as the chapter runs them (ZeRO 0 and 1), its
    timed 1F1B run (m = 4, 20 / 40 ms padding), and the 2-rank layouts of the same model; chapter 13's gpipe,
    1f1b and interleaved (v = 2) at pp 2 and 4 (world 4: pp 2 runs as two pipelines), m 4 and 8, padded with the
    chapter's TIMED waits and not."""
    runs = []
    if 15 in chapters:
        for layout in ("1x1x4x1", "1x1x1x4"):
            for zero in (0, 1):
                runs.append(RunSpec(15, f"{layout} zero {zero}", CH15_WORKER, 4, ch15_params(layout, zero=zero)))
        if padded:
            runs.append(RunSpec(15, "1x1x4x1 m 4 timed", CH15_WORKER, 4,
                                ch15_params("1x1x4x1", micro_batches=4, forward_ms=20.0, backward_ms=40.0)))
        if two_rank_layouts:
            for layout in ("1x1x2x1", "1x1x1x2", "2x1x1x1", "1x2x1x1"):
                runs.append(RunSpec(15, layout, CH15_WORKER, 2, ch15_params(layout)))
    if 13 in chapters:
        paddings = ([("timed", CH13_TIMED)] if padded else []) + ([("unpadded", {})] if unpadded else [])
        for label, pad in paddings:
            for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
                for pp in (2, 4):
                    for m in (4, 8):
                        name = f"{schedule}{f' v {v}' if v > 1 else ''} pp {pp} m {m} {label}"
                        runs.append(RunSpec(13, name, CH13_WORKER, 4, {"schedule": schedule, "pp": pp,
                                                                       "virtual_stages": v, "micro_batches": m,
                                                                       **pad}))
    return runs


def _spread(per_step: list[float]) -> tuple[float, float, float]:
    return statistics.median(per_step), min(per_step), max(per_step)


def _per_step(ranks: list[dict], value, drop: int) -> list[float]:
    """Per step after the first ``drop``: the median over ranks of each rank's ``value``[step] (``value`` a result's
    key, or ``value(rank, step)``)."""
    of = value if callable(value) else (lambda r, i: r[value][i])
    return [statistics.median(of(r, i) for r in ranks) for i in range(drop, len(ranks[0]["step_s"]))]


def run_row(spec: RunSpec, ranks: list[dict], *, steps: int, seconds: float = 0.0, launch: str = "") -> dict:
    """One measured run as a row: its median step time and everything a predictor needs to rebuild the run."""
    drop = 1 if steps > 1 else 0
    per_step = _per_step(ranks, "step_s", drop)
    median, lo, hi = _spread(per_step)
    p = spec.params
    row = {"chapter": spec.chapter, "name": spec.name, "worker": spec.worker, "world": spec.world,
           "params": dict(p), "steps": len(per_step), "measured_median_s": median, "measured_spread": (lo, hi),
           "step_s": per_step, "forward_ms": p.get("forward_ms", 0.0), "backward_ms": p.get("backward_ms", 0.0),
           "run_s": seconds, "launch": launch}
    if spec.chapter == 15:
        cfg = ranks[0]["config"]
        lay = ranks[0]["layout"]
        dp, m = lay["dp"], lay["micro_batches"]
        row.update(model={"kind": "gpt", **{k: cfg[k] for k in ("vocab", "seq", "hidden", "heads", "kv_heads", "ffn",
                                                                  "layers", "tied")}, "dtype": cfg["dtype"]},
                   layout={k: lay[k] for k in ("dp", "tp", "pp", "cp", "zero", "sequence_parallel", "micro_batches",
                                               "schedule", "virtual_stages", "split")},
                   global_batch=cfg["global_batch"], micro_batches=m, micro_batch_size=cfg["global_batch"] // dp // m,
                   pipelines=dp * lay["tp"] * lay["cp"])
        # the training part alone (schedule + gradient sync + optimizer), the slowest rank per step: bench.py's measure
        train = [max(r["schedule_s"][i] + r["sync_s"][i] for r in ranks) for i in range(drop, len(ranks[0]["step_s"]))]
        row["train_median_s"] = statistics.median(train)
        row["measured_parts_s"] = step_parts_measured(ranks, drop)
    else:
        cfg = ranks[0]["config"]
        pp, m = ranks[0]["pp"], p["micro_batches"]
        # workers/pipeline/model.py: layers x (Linear(h, h), tanh but the last), mean-squared error, SGD
        row.update(model={"kind": "mlp", "layers": cfg["layers"], "hidden": cfg["hidden"], "dtype": "float32",
                          "optimizer": "sgd"},
                   layout={"dp": spec.world // pp, "tp": 1, "pp": pp, "cp": 1, "zero": 0, "micro_batches": m,
                           "schedule": p["schedule"], "virtual_stages": ranks[0]["virtual_stages"]},
                   global_batch=m * cfg["micro_batch_size"], micro_batches=m,
                   micro_batch_size=cfg["micro_batch_size"], pipelines=spec.world // pp)
        # the schedule alone: from the barrier every rank leaves together to the last action's end, slowest rank
        spans = [max(r["timelines"][i][-1]["end"] for r in ranks) for i in range(drop, len(ranks[0]["timelines"]))]
        row["schedule_median_s"] = statistics.median(spans)
    return row


def step_parts_measured(ranks: list[dict], drop: int = 1) -> dict[str, float]:
    """Where chapter 15's step went, as its trainer times it (``workers/composed/train.py: ComposedTrainer.step``),
    each the median over the steps after the first ``drop`` of the median over the ranks: ``schedule`` (the
    pipeline's actions from the barrier that starts them), ``sync`` (the gradient all-reduce or ZeRO-1's
    reduce-scatter and all-gather, and the optimizer step), ``outside`` (the rest of the step: the tied embedding's
    and the loss's all-reduces, the report, the next step's batch); inside the schedule, the time blocked on the CP
    ring's transfers (``ring waits``) and in pipeline receives (``pipeline waits``, the bubble among it).
    ``machine_device.step_parts`` groups a prediction's terms the same way."""
    def part(value) -> float:
        return statistics.median(_per_step(ranks, value, drop))

    out = {"schedule": part("schedule_s"), "sync": part("sync_s"),
           "outside": part(lambda r, i: r["step_s"][i] - r["schedule_s"][i] - r["sync_s"][i])}
    if all("comm_s" in r for r in ranks):
        out["ring waits"] = part(lambda r, i: r["comm_s"][i]["cp"] or 0.0)
        out["pipeline waits"] = part(lambda r, i: r["comm_s"][i]["pp"] or 0.0)
    return out


def padded(spec: RunSpec) -> bool:
    """Whether ``spec`` pads its actions to a calibrated wait (its steps are then steady: a few suffice)."""
    return spec.params.get("forward_ms", 0.0) > 0 or spec.params.get("backward_ms", 0.0) > 0


def measure_runs(runs: list[RunSpec] | None = None, *, steps: int = 24, padded_steps: int = 4,
                 timeout: float = RUN_TIMEOUT_S) -> list[dict]:
    """Run each of ``runs`` (``default_runs()`` when None) on warm ranks for ``steps`` optimizer steps
    (``padded_steps`` for a run padded to calibrated waits, whose steps vary by about 1%) and return one row per run
    (``run_row``): the median step time over the steps after the first (warm-up), their min and max, the model, the
    layout or schedule, the batch and the padding. CPU timings: they vary by machine and by load."""
    # steps: an unpadded step of 5-30 ms on shared cores varies by about +-25% from step to step (quartiles of 30
    # steps of chapter 13's runs on a 2-core EPYC VM, 2026-12-07); the median of 7 steps after the warm-up moved by
    # up to 74% between five launches of the same run there, the median of 29 by up to 30%
    runs = default_runs() if runs is None else list(runs)
    if min(steps, padded_steps) < 2:
        raise ValueError(f"steps={steps}, padded_steps={padded_steps}: measure at least 2 steps (the first is "
                         "warm-up and left out)")
    rows = []
    for spec in progress.each(runs, "measured run", lambda s: f"chapter {s.chapter}, {s.name}"):
        n = padded_steps if padded(spec) else steps
        res, probes, slowdown, tries = measured_quietly(
            lambda: run_worker(spec.worker, world_size=spec.world, timeout=timeout, steps=n, **spec.params),
            f"chapter {spec.chapter}'s {spec.name}")
        rows.append({**run_row(spec, res.ranks, steps=n, seconds=res.seconds, launch=res.launch),
                     "host_probe_s": probes, "host_slowdown": slowdown, "tries": tries})
    return rows


def runs_table(rows: list[dict]) -> Table:
    """The measured runs: per run its median step time and the spread over the steps."""
    return Table(["chapter", "run", "ranks", "steps", "median ms", "min ms", "max ms", "host slowdown"],
                 [[r["chapter"], r["name"], r["world"], r["steps"], f"{r['measured_median_s'] * 1e3:.1f}",
                   f"{r['measured_spread'][0] * 1e3:.1f}", f"{r['measured_spread'][1] * 1e3:.1f}",
                   f"{r.get('host_slowdown', math.nan):.2f}x"] for r in rows],
                 caption="measured on this machine's ranks (CPU timings: they vary by machine and by load); host "
                         "slowdown: a tiny op's time around the run over the session's quietest")


__all__ = ["HOST_TRIES", "MachineCalibration", "RunSpec", "SLOW_HOST", "aggregate", "build", "cache_file", "calibrate",
           "ch15_params", "cores", "default_runs", "fit_alpha_beta", "host_slowdown", "measure_runs",
           "measured_quietly", "padded", "probe_host", "run_row", "runs_table", "step_parts_measured"]
