"""The overview planner: does a parallel layout fit, and where does a training step's time go.

``plan(model, layout, n_gpus)`` answers chapter 00's three questions for one layout:

- memory per GPU by state (parameters, gradients, optimizer states, activations) against the
  GPU's memory, for the most loaded GPU (the first pipeline stage, Korthikanti et al. 2022, 4.2.3);
- the step's time term by term (``course_utils.step_time``): matmuls at the throughput measured for their shapes,
  attention, memory-bound work, recomputation, the pipeline bubble simulated from chapter 13's schedules, and each
  parallelism's communication (TP, CP, PP, DP) over the network tier its group spans (groups are laid out
  [TP, CP, PP, DP] from the innermost, as in Llama 3, Figure 5), less what hides behind compute.

Every formula is in ``course_utils.ledger`` with its citation; the planner only does the
bookkeeping. A layout that cannot run (degrees whose product is not the GPU count, heads that do not
split over TP, ...) raises ``LayoutError`` with one sentence saying what to change: ``resolve_layout``
checks a ``Layout`` against the course's one rule set (``workers/layout/rules.py``, which defines
``Layout`` too). ``min_gpus_to_fit`` and ``candidate_layouts`` search layouts with ``plan``.

The planner is these modules, one concern each. This one holds the layout check, the plan and the search, and
re-exports the public names of the four below (``__all__``), so ``from course_utils.planner import ...``
reaches every one; the step's time is ``course_utils.step_time`` (its rates by shape ``course_utils.device_rates``),
held to published runs by ``course_utils.planner_runs`` and to this machine by ``course_utils.machine_device``:

- ``course_utils.model_shapes``: ``ModelShape``, ``MODEL_SHAPES``, ``model_shape``, and ``LayoutError``,
  which all five raise;
- ``course_utils.hardware``: ``GPU``, ``Link``, ``Cluster``, ``GPUS``, ``NETWORK_TIERS``, ``CLUSTERS``,
  ``cluster``, ``H100_80GB_NVIDIA_SMI_BYTES``;
- ``course_utils.step_comm``: the communication model, ``step_collectives``, ``Collective``,
  ``zero_collectives_per_step``;
- ``course_utils.moe_counts``: mixture of experts, ``moe_parameter_counts``, ``ep_rank_parameters``,
  ``all_to_all_bytes``, ``ep_traffic_per_step``.

Modelling choices, stated once: the activation count is Korthikanti's GPT block (dropout masks,
4h GeLU MLP, multi-head attention), used as an approximation for Llama-style blocks (no dropout,
SwiGLU, grouped-query attention); the step's time is ``course_utils.step_time`` (matmuls at their measured
shapes, memory-bound work, the simulated pipeline, communication minus what overlaps), held to published runs
by ``course_utils.planner_runs``; framework overheads (CUDA context, allocator fragmentation, temporary buffers)
are not counted in memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from workers.layout.rules import DEFAULT_SEQ, Layout, problem
from workers.pipeline.validity import peak_stashes
from workers.pipeline.zero_bubble import SPLIT_SCHEDULES, split_stages

from .hardware import (
    CLUSTERS,
    GPU,
    GPUS,
    H100_80GB_NVIDIA_SMI_BYTES,
    NETWORK_TIERS,
    Cluster,
    Link,
    cluster,
    sustained_share,
)
from .ledger import (
    GB,
    GiB,
    activation_bytes_per_layer,
    flops_per_token,
    model_state_bytes,
)
from .model_shapes import (
    MODEL_SHAPES,
    LayoutError,
    ModelShape,
    _check_degree,
    _divisors,
    model_shape,
)
from .moe_counts import (
    all_to_all_bytes,
    ep_rank_parameters,
    ep_traffic_per_step,
    moe_parameter_counts,
)
from .step_comm import Collective, _link, step_collectives, zero_collectives_per_step
from .step_time import Practice, StepTime, step_time

__all__ = [  # the layout check and the plan, and the four modules' public names (docstring)
    "CLUSTERS",
    "GPU",
    "GPUS",
    "H100_80GB_NVIDIA_SMI_BYTES",
    "MODEL_SHAPES",
    "NETWORK_TIERS",
    "Cluster",
    "Collective",
    "Layout",
    "LayoutError",
    "Link",
    "ModelShape",
    "Plan",
    "Practice",
    "all_to_all_bytes",
    "candidate_layouts",
    "cluster",
    "ep_rank_parameters",
    "ep_traffic_per_step",
    "min_gpus_to_fit",
    "model_shape",
    "moe_parameter_counts",
    "plan",
    "resolve_layout",
    "search_layouts",
    "step_collectives",
    "zero_collectives_per_step",
]


@dataclass(frozen=True)
class Plan:
    """What ``plan`` found for one layout. Bytes, seconds and FLOPs throughout."""

    model: ModelShape
    layout: Layout  # with dp, micro_batches and seq filled in
    cluster: Cluster
    n_gpus: int
    gpu_memory_bytes: float
    memory: dict[str, float]  # per GPU: params, grads, optimizer, activations
    compute_time_s: float
    bubble_time_s: float
    comm_time_s: dict[str, float]  # per step, per GPU: tp, cp, pp, dp
    links: dict[str, str]  # the network tier each group's traffic crosses
    tokens_per_step: int
    model_flops_per_step: float
    hardware_flops_per_step: float
    notes: tuple[str, ...] = field(default=())
    time: StepTime | None = None  # the step's seconds by term (course_utils.step_time)

    @property
    def total_memory_bytes(self) -> float:
        return sum(self.memory.values())

    @property
    def fits(self) -> bool:
        return self.total_memory_bytes <= self.gpu_memory_bytes

    @property
    def headroom_bytes(self) -> float:
        """GPU memory left after everything counted (negative: over by that much)."""
        return self.gpu_memory_bytes - self.total_memory_bytes

    @property
    def sequences_per_step(self) -> int:
        """The global batch: sequences per optimizer step, dp x m x micro_batch."""
        return self.tokens_per_step // self.layout.seq

    @property
    def tokens_per_second(self) -> float:
        """Training throughput this step time implies; compare layouts by this (or MFU), not by s/step,
        unless their global batches are equal."""
        return self.tokens_per_step / self.step_time_s

    @property
    def comm_total_s(self) -> float:
        return sum(self.comm_time_s.values())

    @property
    def step_time_s(self) -> float:
        """Compute + bubble + exposed communication + the optimizer step: every term of ``time``."""
        return self.time.total

    @property
    def comm_share(self) -> float:
        """Exposed communication / step time."""
        return self.time.comm_share

    @property
    def hidden_comm_s(self) -> dict[str, float]:
        """Communication hidden behind compute (not on the step's critical path)."""
        return dict(self.time.hidden)

    @property
    def mfu(self) -> float:
        """Model FLOPs utilization this step time implies (PaLM Appendix B definition)."""
        return self.model_flops_per_step / (self.step_time_s * self.n_gpus * self.cluster.gpu.peak_flops)

    def summary(self) -> str:
        lay = self.layout
        lines = [
            f"{self.model.name} on {self.n_gpus} GPUs ({self.cluster.name})",
            f"  layout  tp={lay.tp} cp={lay.cp} pp={lay.pp} dp={lay.dp} zero={lay.zero} "
            f"micro_batch={lay.micro_batch} seq={lay.seq} m={lay.micro_batches} recompute={lay.recompute}",
            "  memory per GPU (GB = 1e9 bytes)",
        ]
        lines += [f"    {k:<12}{v / GB:9.2f}" for k, v in self.memory.items()]
        verdict = (f"fits, {self.headroom_bytes / GB:.2f} GB to spare" if self.fits
                   else f"does NOT fit, {-self.headroom_bytes / GB:.2f} GB over")
        lines.append(f"    {'total':<12}{self.total_memory_bytes / GB:9.2f}  of {self.gpu_memory_bytes / GB:.1f} "
                     f"({self.gpu_memory_bytes / GiB:.1f} GiB): {verdict}")
        lines.append("  time per step (s), what is on the critical path")
        lines += [f"    {k:<16}{v:9.3f}" + (f"  over {self.links[k]}" if k in self.links else "")
                  for k, v in self.time.terms.items() if v > 0]
        hidden = {k: v for k, v in self.time.hidden.items() if v > 0}
        if hidden:
            lines.append("    hidden behind compute: " + ", ".join(f"{k} {v:.3f}" for k, v in hidden.items()))
        lines.append(f"    {'step':<16}{self.step_time_s:9.3f}  ({self.sequences_per_step} sequences, "
                     f"{self.tokens_per_second:,.0f} tokens/s, MFU {100 * self.mfu:.1f}%, "
                     f"communication {100 * self.comm_share:.0f}% of the step)")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def resolve_layout(model: ModelShape, layout: Layout, n_gpus: int, *, global_batch: int | None = None) -> Layout:
    """Check ``layout`` against the model and GPU count (the course's one rule set, ``workers/layout/rules.py``);
    return it with dp, m and seq filled in.

    With ``global_batch`` (sequences per optimizer step), m = global_batch / (dp * micro_batch), so that
    layouts with different dp train on the same batch and their step times can be compared. Without one, m is
    4p with pipelining (GPipe, Huang et al. 2019, sec 2.3: the bubble is negligible for m >= 4p), else 1.
    ``virtual_stages`` > 1 with the default schedule means interleaved 1F1B.
    """
    _check_degree("n_gpus", n_gpus)
    if global_batch is not None:
        _check_degree("global_batch", global_batch)
    lay = replace(layout, seq=layout.seq or DEFAULT_SEQ, recompute=layout.recompute or "selective",
                  schedule="interleaved" if layout.virtual_stages > 1 and layout.schedule == "1f1b" else layout.schedule)
    dp = lay.dp
    rest = lay.tp * lay.pp * lay.cp if all(isinstance(getattr(lay, d), int) for d in ("tp", "pp", "cp")) else 0
    if dp is None and rest >= 1 and n_gpus % rest == 0:
        dp = n_gpus // rest
    m = lay.micro_batches
    if global_batch is not None and isinstance(dp, int) and dp >= 1 and isinstance(lay.micro_batch, int) \
            and lay.micro_batch >= 1 and global_batch % (dp * lay.micro_batch) == 0:
        whole = global_batch // (dp * lay.micro_batch)
        if m is not None and m != whole:
            raise LayoutError(f"micro_batches={m} gives {m * dp * lay.micro_batch} sequences per step, not "
                              f"global_batch={global_batch}: set only one of the two.")
        m = whole
    if m is None:
        m = 4 * lay.pp if isinstance(lay.pp, int) and lay.pp > 1 else 1
    lay = replace(lay, dp=dp, micro_batches=m)
    bad = problem(lay if dp is not None else replace(lay, dp=None), n_gpus, model, global_batch=global_batch)
    if bad:
        raise LayoutError(f"{model.name}: {bad}.")
    return lay


def plan(
    model: str | ModelShape,
    layout: Layout,
    n_gpus: int,
    *,
    cluster_name: str | Cluster = "h100-ib",
    inter_node: str | Link | None = None,
    gpu_memory_bytes: float | None = None,
    practice: Practice | None = None,
    sustained: float | None = None,
    weight_bytes: float = 2,
    grad_bytes: float = 2,
    optimizer_bytes_per_param: float = 12,
    global_batch: int | None = None,
    timed: bool = True,
) -> Plan:
    """Memory per GPU, compute and communication time per step, and whether ``layout`` fits.

    ``cluster_name`` picks GPU, node size and both network tiers from ``CLUSTERS``;
    ``inter_node`` swaps the between-node tier (a ``NETWORK_TIERS`` key such as "ethernet100");
    ``gpu_memory_bytes`` overrides the GPU's memory. The step's time is ``course_utils.step_time.step_time``'s,
    term by term (``Plan.time``); ``practice`` says what the layout leaves open (FlashAttention, overlap, fused
    kernels, ...) and ``sustained`` replaces the GPU generation's share of its benchmark GEMM rate
    (``hardware.SUSTAINED_GEMM_SHARE``). ``timed=False`` skips the time (a search checks memory first).
    Hardware FLOPs add, per token, 4 L H Q T for selective
    recomputation (the attention matmuls' forward again) or 2N + 4 L H Q T for full recomputation.
    ZeRO traffic follows ``zero_collectives_per_step``: stages 0 and 1 reduce gradients once per step,
    stages 2 and 3 after every micro-batch, and stage 3 gathers the weights for every micro-batch's
    forward and backward. ``global_batch`` (sequences per step) sets the micro-batches per replica to
    global_batch / (dp * micro_batch): give layouts the same global batch before comparing step times.
    """
    model = model_shape(model)
    cl = cluster(cluster_name)
    if inter_node is not None:
        if isinstance(inter_node, str) and inter_node not in NETWORK_TIERS:
            raise LayoutError(f"unknown network tier {inter_node!r}; use one of {', '.join(NETWORK_TIERS)}.")
        link = NETWORK_TIERS[inter_node] if isinstance(inter_node, str) else inter_node
        name = f"{cl.gpus_per_node}x {cl.gpu.name} per node, {cl.intra_node.name}, {link.name} between nodes"
        cl = replace(cl, name=name, inter_node=link)
    layout = resolve_layout(model, layout, n_gpus, global_batch=global_batch)
    memory_limit = cl.gpu.memory_bytes if gpu_memory_bytes is None else gpu_memory_bytes
    tp, pp, cp, dp, v = layout.tp, layout.pp, layout.cp, layout.dp, layout.virtual_stages
    b, seq, m = layout.micro_batch, layout.seq, layout.micro_batches
    s_local = seq // cp
    sp = layout.sequence_parallel and tp > 1
    notes: list[str] = []

    # --- memory of the first pipeline stage (it holds the most activations) ---------------------
    layers_per_stage = math.ceil(model.layers / pp)
    if model.layers % pp:
        notes.append(f"{model.layers} layers do not divide by pp={pp}; the fullest stage has {layers_per_stage}.")
    held = model.held_by_tp(tp)  # KV heads copied when tp is a multiple of them (the copies take memory too)
    if held.kv_heads > model.kv_heads:
        notes.append(f"tp={tp} > {model.kv_heads} KV heads: each KV head is copied onto {tp // model.kv_heads} ranks.")
    if pp == 1:
        stage_params = held.n_params
    else:  # first stage: its layers and the input embedding (Megatron keeps a copy even when tied)
        stage_params = layers_per_stage * held.params_per_layer + model.vocab * model.hidden
    states = model_state_bytes(
        stage_params, dp=dp * cp, tp=tp, pp=1, zero_stage=layout.zero, weight_bytes=weight_bytes,
        grad_bytes=grad_bytes, optimizer_bytes_per_param=optimizer_bytes_per_param,
    )
    params = states.params
    if layout.zero == 3:  # one layer gathered at a time (FSDP may prefetch a second)
        params += weight_bytes * held.params_per_layer / tp
        notes.append("ZeRO-3: parameters include one all-gathered layer.")
    flash = (practice or Practice()).flash_attention

    def layer_activations(recompute: str) -> float:
        # FlashAttention never stores the s x s scores (it keeps one log-sum-exp per row and recomputes them in its
        # backward): without recomputation a layer holds what Korthikanti's selective recomputation leaves
        if recompute == "none" and flash:
            recompute = "selective"
        act = activation_bytes_per_layer(s_local, b, model.hidden, model.heads, tp=tp, sequence_parallel=sp,
                                         recompute=recompute)
        if recompute == "none" and cp > 1 and not flash:  # local queries attend to all seq keys: 5 a b (s/cp) s / t
            act += 5 * model.heads * b * s_local * (seq - s_local) / tp
        return act

    per_layer = layer_activations(layout.recompute)
    in_flight = min(pp, m)  # 1F1B: the first stage holds p micro-batches (Korthikanti 4.2.3)
    interleave = 1 + (pp - 1) / (pp * v) if v > 1 else 1.0  # Korthikanti 4.2.3
    if layout.schedule in SPLIT_SCHEDULES and pp > 1:
        # a zero-bubble schedule's own table (chapter 13's): the most micro-batches' worth a rank holds from a
        # forward until its W, counting what W waits for (each linear layer's input and output gradient) as a whole
        # layer's activations: an upper bound
        table = split_stages(layout.schedule, pp, min(m, 8 * pp))  # past 8p micro-batches the peak no longer grows
        in_flight, interleave = max(peak_stashes(row)["held"] for row in table) / v, 1.0
    activations = per_layer * layers_per_stage * in_flight * interleave
    if layout.recompute == "full":  # the layer being recomputed holds its full set again
        activations += layer_activations("none")
    if pp == 1:  # final norm, output projection input and fp32 logits (Korthikanti 4.3)
        activations += 4 * s_local * b * model.hidden / tp * (1 + model.vocab / model.hidden)
    memory = {"params": params, "grads": states.grads, "optimizer": states.optimizer, "activations": activations}

    # --- time: course_utils.step_time, term by term ---------------------------------------------
    tokens_per_step = dp * m * b * seq
    model_flops = flops_per_token(model.n_params, model.layers, model.heads, model.head_dim, seq) * tokens_per_step
    attention_fwd = 4.0 * model.layers * model.heads * model.head_dim * seq  # QK^T and AV, per token
    extra = {"none": 0.0, "selective": attention_fwd, "full": 2.0 * model.n_params + attention_fwd}[layout.recompute]
    hardware_flops = model_flops + extra * tokens_per_step
    timing = step_time(model, layout, n_gpus, cl, practice or Practice(),
                       sustained=sustained_share(cl.gpu) if sustained is None else sustained) if timed else None
    tp_link, cp_link = _link(cl, 1, tp), _link(cl, tp, cp)
    pp_link, dp_link = _link(cl, tp * cp, pp), _link(cl, tp * cp * pp, dp)
    grad_link = dp_link if dp > 1 else cp_link  # gradients are reduced over DP x CP
    if cp > 1 and dp > 1 and cl.inter_node in (cp_link, dp_link):
        grad_link = cl.inter_node
    if tp > cl.gpus_per_node:
        notes.append(f"tp={tp} spans more than one {cl.gpus_per_node}-GPU node: TP traffic leaves NVLink.")
    links = {"tp": tp_link.name, "cp": cp_link.name, "pp": pp_link.name, "dp": grad_link.name}
    compute_time = timing.compute if timed else math.nan
    bubble_time = timing.terms["bubble"] if timed else math.nan
    comm = {dim: timing.terms[dim] if timed else math.nan for dim in ("tp", "cp", "pp", "dp")}
    return Plan(
        model=model, layout=layout, cluster=cl, n_gpus=n_gpus, gpu_memory_bytes=memory_limit, memory=memory,
        compute_time_s=compute_time, bubble_time_s=bubble_time, comm_time_s=comm, links=links,
        tokens_per_step=tokens_per_step, model_flops_per_step=model_flops, hardware_flops_per_step=hardware_flops,
        notes=tuple(notes), time=timing,
    )


def min_gpus_to_fit(
    model: str | ModelShape,
    layout: Layout,
    *,
    max_gpus: int = 1 << 20,
    **plan_kwargs,
) -> Plan:
    """The plan for the smallest GPU count at which ``layout`` fits, growing only data parallelism.

    tp, cp and pp stay as given and dp = n_gpus / (tp * cp * pp) grows (``layout.dp`` is ignored).
    Memory per GPU never grows with dp: ZeRO divides states by dp and nothing else depends on it, so
    the fitting counts are all those from the first one up, and bisection finds it (the same answer as
    trying 1, 2, 3, ... replicas in turn). ``plan_kwargs`` go to ``plan`` (``gpu_memory_bytes``,
    ``cluster_name``, ...). Raises ``LayoutError`` if even ``max_gpus`` GPUs are not enough, which is
    what happens when the part that does not shard (activations, or all states at ZeRO stage 0) is
    already larger than a GPU.
    """
    model = model_shape(model)
    group = _check_degree("tp", layout.tp) * _check_degree("cp", layout.cp) * _check_degree("pp", layout.pp)
    layout = replace(layout, dp=None)

    def at(dp: int) -> Plan:
        return plan(model, layout, group * dp, **plan_kwargs)

    low, high = 1, max(1, max_gpus // group)
    largest = at(high)
    if not largest.fits:
        raise LayoutError(
            f"{model.name} does not fit even on {group * high} GPUs with tp={layout.tp}, cp={layout.cp}, "
            f"pp={layout.pp}, zero={layout.zero}: {largest.total_memory_bytes / GB:.1f} GB per GPU "
            f"remain, most of it {max(largest.memory, key=largest.memory.get)}; split the model with tp/pp/cp, "
            f"shard more with a higher zero or recompute more."
        )
    if at(low).fits:
        return at(low)
    while high - low > 1:  # invariant: at(low) does not fit, at(high) fits
        middle = (low + high) // 2
        if at(middle).fits:
            high = middle
        else:
            low = middle
    return at(high)


def candidate_layouts(
    model: str | ModelShape,
    n_gpus: int,
    *,
    cluster_name: str | Cluster = "h100-ib",
    zero_stages: tuple[int, ...] = (1,),
    seq: int = 4096,
    micro_batch: int = 1,
    global_batch: int | None = None,
    recompute: str = "selective",
    gpu_memory_bytes: float | None = None,
) -> list[Plan]:
    """Every valid (tp, pp, dp, zero) layout without CP, with sequence parallelism, fitting ones first, fastest first.

    TP stays within one node and obeys the layout rules (it divides the heads; it and the KV heads divide one
    another); pp divides the layers' count only loosely (the fullest stage is used). With ``global_batch`` (sequences per step) the micro-batch count
    is global_batch / (dp * micro_batch); layouts for which that is not whole are skipped.
    """
    model = model_shape(model)
    cl = cluster(cluster_name)
    plans = []
    for tp in _divisors(cl.gpus_per_node):
        for pp in _divisors(n_gpus // tp if n_gpus % tp == 0 else 1):
            if n_gpus % (tp * pp) or pp > model.layers:
                continue
            dp = n_gpus // (tp * pp)
            m = None
            if global_batch is not None:
                if global_batch % (dp * micro_batch):
                    continue
                m = global_batch // (dp * micro_batch)
            for zero in zero_stages:
                layout = Layout(tp=tp, pp=pp, dp=dp, zero=zero, micro_batch=micro_batch, seq=seq,
                                micro_batches=m, recompute=recompute, sequence_parallel=True)
                try:
                    plans.append(plan(model, layout, n_gpus, cluster_name=cl, gpu_memory_bytes=gpu_memory_bytes))
                except LayoutError:
                    continue
    return sorted(plans, key=lambda p: (not p.fits, p.step_time_s))


def search_layouts(
    model: str | ModelShape,
    n_gpus: int,
    *,
    global_batch: int,
    cluster_name: str | Cluster = "h100-ib",
    seq: int = 4096,
    micro_batches: tuple[int, ...] = (1, 2),
    virtual_stages: tuple[int, ...] = (1, 2, 4),
    zero_stages: tuple[int, ...] = (1,),
    recompute: tuple[str, ...] = ("selective", "full"),
    cps: tuple[int, ...] = (1,),
    gpu_memory_bytes: float | None = None,
    practice: Practice | None = None,
    top: int | None = 10,
) -> list[Plan]:
    """The layouts of ``model`` on ``n_gpus`` that fit, ranked by predicted MFU (the same global batch for all, so
    MFU and tokens/s rank alike), each with its communication share (``Plan.comm_share``).

    Searched: TP within a node and obeying the head rules, CP from ``cps``, every PP that leaves a stage a layer,
    interleaving with ``virtual_stages`` chunks (m a multiple of pp), micro-batch sizes ``micro_batches`` (global
    batch divisible by dp x micro-batch), ZeRO stages, recomputation modes; sequence parallelism on with TP. Memory
    is checked first (cheap); only the layouts that fit are timed."""
    model = model_shape(model)
    cl = cluster(cluster_name)
    fitting = []
    for tp in _divisors(cl.gpus_per_node):
        for cp in cps:
            for pp in _divisors(n_gpus // (tp * cp)) if n_gpus % (tp * cp) == 0 else []:
                if pp > model.layers:
                    continue
                dp = n_gpus // (tp * cp * pp)
                for b in micro_batches:
                    if global_batch % (dp * b):
                        continue
                    m = global_batch // (dp * b)
                    for v in virtual_stages:
                        if v > 1 and (pp == 1 or m % pp or pp * v > model.layers):
                            continue
                        for zero in zero_stages:
                            for rc in recompute:
                                lay = Layout(tp=tp, cp=cp, pp=pp, dp=dp, zero=zero, micro_batch=b, seq=seq,
                                             micro_batches=m, virtual_stages=v, recompute=rc,
                                             schedule="interleaved" if v > 1 else "1f1b", sequence_parallel=tp > 1)
                                try:
                                    p = plan(model, lay, n_gpus, cluster_name=cl, gpu_memory_bytes=gpu_memory_bytes,
                                             timed=False)
                                except LayoutError:
                                    continue
                                if p.fits:
                                    fitting.append(lay)
    plans = [plan(model, lay, n_gpus, cluster_name=cl, gpu_memory_bytes=gpu_memory_bytes, practice=practice)
             for lay in fitting]
    plans.sort(key=lambda p: -p.mfu)
    return plans[:top] if top else plans
