"""The planner held to published training runs: every row of ``PUBLISHED_RUNS`` priced and compared.

``compare(row)`` rebuilds a run from what its paper prints (the model's shape, the layout, the global batch, the
schedule, recomputation, the DP flavour, the hardware), prices one step with ``step_time``, turns the published
figure into seconds per step with the paper's own FLOP convention, and returns a ``Comparison`` with their ratio.

What a run does that its layout does not say is read from the row, never tuned per row: FlashAttention from 2023 on
(the 2021-22 Megatron runs computed the scores as batched GEMMs), gradient overlap unless the paper says it was off,
ZeRO stage from how the DP dimension holds the states. The only constants fitted to published runs are
``SUSTAINED``, one per hardware generation: the share of its isolated benchmark rate a GEMM keeps inside a long
training step (clocks under sustained power, caches shared with communication kernels). ``fit_sustained`` fits it
on the rows it is given; ``leave_one_paper_out`` refits without one paper and prices that paper's rows.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, fields, replace
from functools import lru_cache

from workers.layout.rules import Layout

from .hardware import CLUSTERS, SUSTAINED_GEMM_SHARE, Cluster
from .hardware import generation as gpu_generation
from .ledger import flops_per_token
from .model_shapes import LayoutError, ModelShape
from .published_configs import PUBLISHED_MOE, PUBLISHED_RUNS, PublishedConfig
from .step_time import Practice, StepTime, step_time

BAND = 0.15  # every fully printed row within +-15% (the acceptance)
MEDIAN_BOUND = 0.07
LEAVE_OUT_BAND = 0.20

SUSTAINED = SUSTAINED_GEMM_SHARE

_ZERO = {"none": 0, "DP": 0, "DDP": 0, "ZeRO-1": 1, "ZeRO-2": 2, "ZeRO-3": 3, "FSDP": 3}


def generation(cluster: Cluster) -> str:
    return gpu_generation(cluster.gpu)


def shape(row: PublishedConfig) -> ModelShape:
    """The run's model as the planner counts it."""
    return ModelShape(row.name, row.layers, row.hidden, row.heads, row.kv_heads or row.heads,
                      row.ffn or 4 * row.hidden, value(row, "vocab"), mlp=row.mlp,
                      tied_embeddings=row.tied_embeddings, source=row.source)


def zero_stage(row: PublishedConfig) -> int:
    """How the DP dimension holds model states. Llama 3's FSDP does not reshard parameters after the forward
    (sec 3.3.2): the weights are gathered once per step and the gradients, accumulated over the micro-batches, reduce-
    scattered once: ZeRO-1's traffic."""
    if row.paper == "llama3":
        return 1
    return _ZERO.get(row.data_parallel, 0)


def value(row: PublishedConfig, name: str):
    """A field as printed, or, where the paper does not print it, the value the row assumes."""
    printed = getattr(row, name)
    if printed is not None:
        return printed
    for field_name, assumed, _why in row.assumed:
        if field_name == name:
            return assumed
    return None


def layout(row: PublishedConfig) -> Layout:
    b = value(row, "micro_batch") or 1
    batch = value(row, "global_batch")
    m = batch // (row.dp * b) if batch else None
    schedule = "interleaved" if row.virtual_stages > 1 else "1f1b"  # DualPipe: Practice.dualpipe
    return Layout(dp=row.dp, tp=row.tp, pp=row.pp, cp=row.cp, ep=row.ep, zero=zero_stage(row), micro_batch=b,
                  seq=value(row, "seq"), micro_batches=m, virtual_stages=row.virtual_stages, schedule=schedule,
                  recompute=value(row, "recompute") or "selective", sequence_parallel=row.sequence_parallel)


# The frameworks whose default rank order puts pipeline parallelism outermost (Megatron-LM's "tp-cp-ep-dp-pp",
# DeepSpeed's PipeModelDataParallelTopology, torchtitan's mesh ["pp", "dp", "cp", "tp"]); Llama 3 puts DP outermost
# (Figure 5), as the course's planner does.
PP_OUTERMOST = ("narayanan2021", "korthikanti2022", "bloom", "mtnlg", "megatron-bridge", "torchtitan")


# Megatron-Core runs attention through Transformer Engine, whose default fused kernel is cuDNN's (2024 on)
CUDNN_ATTENTION = ("megatron-bridge",)


def practice(row: PublishedConfig) -> Practice:
    """What the run's framework did that its layout does not say, read from the row (never tuned per row):
    FlashAttention from 2023 on; fused elementwise kernels unless the row says torch.compile was off (torchtitan's
    eager runs); torchtitan's per-op selective recomputation; each framework's rank order; DualPipe."""
    overlap = value(row, "grad_overlap")
    return Practice(flash_attention=(row.year or 0) >= 2023, dtype=value(row, "dtype") or "bf16",
                    grad_overlap=True if overlap is None else overlap, dualpipe=row.schedule == "dualpipe",
                    ep_overlap=bool(value(row, "ep_overlap")),
                    fused=row.fused_kernels, recompute_matmuls=0.5 if row.paper == "torchtitan" else 0.0,
                    pp_outermost=row.paper in PP_OUTERMOST,
                    attention_kernel="cudnn" if row.paper in CUDNN_ATTENTION else "flash")


def published_step_s(row: PublishedConfig, model: ModelShape, lay: Layout, cluster: Cluster) -> float:
    """The published figure as seconds per step, by the row's FLOP convention."""
    tokens = lay.dp * lay.micro_batches * lay.micro_batch * lay.seq
    if row.iteration_time_s:
        return row.iteration_time_s
    if row.tokens_per_second_per_gpu:
        return tokens / (row.gpus * row.tokens_per_second_per_gpu)
    per_gpu = row.flops_per_gpu or row.mfu * cluster.gpu.peak_flops
    conv = row.flop_convention
    if conv == "narayanan":  # Narayanan et al. 2021, eq. (3): full recomputation counted
        s, h, l, v = lay.seq, row.hidden, row.layers, model.vocab
        flops = 96 * (tokens / s) * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    elif conv == "6N":
        flops = 6 * model.n_params * tokens
    else:  # "model" (PaLM Appendix B) and anything printed as MFU
        flops = flops_per_token(model.n_params, model.layers, model.heads, model.head_dim, lay.seq) * tokens
    return flops / (row.gpus * per_gpu)


@dataclass(frozen=True)
class Comparison:
    row: PublishedConfig
    predicted: StepTime
    published_s: float

    @property
    def ratio(self) -> float:
        """Predicted over published seconds per step (1 is exact; above 1 the planner is pessimistic)."""
        return self.predicted.total / self.published_s

    @property
    def error(self) -> float:
        return self.ratio - 1

    @property
    def counts(self) -> bool:
        """A row counts toward the band and the median unless it is derived or an assumed value alone moves it
        by more than the band (``assumption_swing``)."""
        return self.row.flop_convention != "derived" and assumption_swing(self.row) <= BAND


def cluster_of(row: PublishedConfig) -> Cluster:
    if row.cluster not in CLUSTERS:
        raise LayoutError(f"{row.name}: cluster {row.cluster!r} is not one of {', '.join(CLUSTERS)}.")
    return CLUSTERS[row.cluster]


def compare(row: PublishedConfig, sustained: dict[str, float] | None = None, **overrides) -> Comparison:
    """Price one published run; ``overrides`` replace Layout or Practice fields (what an assumption would change)."""
    shares = tuple(sorted((SUSTAINED if sustained is None else sustained).items()))
    return _compare(row, shares, tuple(sorted(overrides.items())))


@lru_cache(maxsize=4096)
def _compare(row: PublishedConfig, shares: tuple, overrides: tuple) -> Comparison:
    from .planner import resolve_layout

    sustained, overrides = dict(shares), dict(overrides)
    model = shape(row)
    cl = cluster_of(row)
    habits = {k: overrides.pop(k) for k in list(overrides) if k in _PRACTICE_FIELDS}
    lay = replace(layout(row), **overrides)
    if lay.virtual_stages == 1 and lay.schedule == "interleaved":
        lay = replace(lay, schedule="1f1b")
    lay = resolve_layout(model, lay, row.gpus, global_batch=value(row, "global_batch"))
    moe = next((m for m in PUBLISHED_MOE if m.name == row.moe), None) if row.moe else None
    st = step_time(model, lay, row.gpus, cl, replace(practice(row), **habits),
                   sustained=sustained.get(generation(cl), 1.0), moe=moe)
    return Comparison(row, st, published_step_s(row, model, lay, cl))


_PRACTICE_FIELDS = {f.name for f in fields(Practice)}
_ALTERNATIVES = {"micro_batch": (1, 2, 4), "virtual_stages": (1, 2, 3, 4), "recompute": ("none", "selective", "full"),
                 "ep_overlap": (False, True)}


def _alternatives(row: PublishedConfig, name: str) -> tuple:
    """What a paper of the row's time could have used for an unprinted value: an interleaved schedule the paper
    names keeps two chunks or more."""
    if name == "virtual_stages" and row.schedule == "interleaved" and "schedule" not in {a[0] for a in row.assumed}:
        return (2, 3, 4)
    return _ALTERNATIVES[name]


@lru_cache(maxsize=None)
def assumption_swing(row: PublishedConfig) -> float:
    """The most any assumed value moves the row's prediction, trying the alternatives a paper of its time could have
    used (relative change of the predicted step)."""
    base = None
    swing = 0.0
    for name, value, _why in row.assumed:
        if name not in _ALTERNATIVES:
            continue
        if base is None:
            base = compare(row).predicted.total
        for alt in _alternatives(row, name):
            if alt == value:
                continue
            try:
                other = compare(row, **{name: alt}).predicted.total
            except (LayoutError, ValueError):
                continue
            swing = max(swing, abs(other / base - 1))
    return swing


def comparisons(rows=PUBLISHED_RUNS, sustained: dict[str, float] | None = None) -> list[Comparison]:
    return [compare(r, sustained) for r in rows]


def _affine_in_share(row: PublishedConfig, low: float = 0.6, high: float = 0.9) -> tuple[float, float]:
    """(A, B) with predicted seconds = A / share + B: the matmul and attention terms scale as 1 / share, the rest
    does not (two exact evaluations pin the line; the fitted share is then checked exactly)."""
    gen = generation(cluster_of(row))
    t_low = compare(row, {gen: low}).predicted.total
    t_high = compare(row, {gen: high}).predicted.total
    a = (t_low - t_high) / (1 / low - 1 / high)
    return a, t_low - a / low


def fit_sustained(rows, start: dict[str, float] | None = None) -> dict[str, float]:
    """Per generation, the sustained share that makes the geometric mean of predicted / published 1 over the rows
    that count: a one-dimensional root of mean(log((A / share + B) / published)) = 0, by bisection."""
    out = dict(start or SUSTAINED)
    counted = [r for r in rows if compare(r).counts]
    for gen in out:
        mine = [r for r in counted if generation(cluster_of(r)) == gen]
        if not mine:
            continue
        lines = [(*_affine_in_share(r), compare(r).published_s) for r in mine]

        def mean_log(share: float) -> float:
            return statistics.mean(math.log((a / share + b) / pub) for a, b, pub in lines)

        low, high = 0.2, 1.0  # mean_log falls as the share rises
        if mean_log(high) > 0:
            out[gen] = high
            continue
        for _ in range(50):
            mid = (low + high) / 2
            low, high = (mid, high) if mean_log(mid) > 0 else (low, mid)
        out[gen] = (low + high) / 2
    return out


def leave_one_paper_out(paper: str, rows=PUBLISHED_RUNS) -> list[Comparison]:
    """Fit the sustained shares without ``paper``'s rows, then price that paper's rows with them."""
    fitted = fit_sustained([r for r in rows if r.paper != paper])
    return [compare(r, fitted) for r in rows if r.paper == paper]


def summary(comps: list[Comparison]) -> dict:
    counted = [c for c in comps if c.counts]
    errors = [abs(c.error) for c in counted]
    return {"rows": len(comps), "counted": len(counted), "median_error": statistics.median(errors) if errors else 0.0,
            "worst": max(counted, key=lambda c: abs(c.error)) if counted else None,
            "outside_band": [c.row.name for c in counted if abs(c.error) > BAND]}
