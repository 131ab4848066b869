"""Where one training step's seconds go: the planner's time model, one small function per term, each with its source.

``step_time(model, layout, n_gpus, cluster)`` prices one optimizer step of a resolved ``Layout`` for the GPU that
sets the pace and returns a ``StepTime`` whose ``terms`` add up to the step:

- **matmul**: every GEMM of a layer (QKV, output projection, the MLP's two or three, the head on the last stage)
  and its two backward GEMMs (dX = dY W^T, dW = X^T dY), each at the device's measured throughput *for its shape*
  (``device_rates.GemmTable``), not at one efficiency for all;
- **attention**: the QK^T and AV work. With FlashAttention (``Practice.flash_attention``) a causal mask halves the
  work done (masked blocks are skipped) at FlashAttention's measured share of the device's best matmul rate (the
  course's H200 run, ``ATTENTION_SHARE``); without it the scores are batched GEMMs over the full square, as
  Megatron's 2021-22 kernels computed them. MFU still counts the square whole (PaLM, Appendix B: 12 L H Q T).
  A device that timed its fused kernel (a calibrated CPU: ``GPU.attention_rows``) is priced from those times;
- **memory-bound**: norms, residual adds, dropout, activation functions, RoPE, the unfused softmax and the
  loss's softmax over the vocabulary, as bytes moved over the achieved memory bandwidth (``memory_bound_bytes``);
  a device that timed its GELU (``GPU.activation_rows``: float64 erf on a CPU is compute-bound) takes that time;
- **recompute**: selective recomputation re-runs the attention core forward (Korthikanti et al. 2022, sec 5;
  nothing extra with FlashAttention, which recomputes inside its own backward), full recomputation a whole
  forward per layer, its TP collectives included;
- **kernel overhead**: a kernel (an eager op) takes at least ``kernel_overhead_s``; on a GPU that only bounds a
  layer's time from below, on a CPU rank it adds to it (``GPU.overhead_serial``), and so does the CPU of each
  message end the rank runs itself (``Practice.message_end_cpu_s``: the CP ring's, a pipeline stage's);
- **bubble** and **pp**: the pipeline's idle time, from simulating the very schedule tables chapter 13 executes
  (``workers/pipeline/schedules.py``; the zero-bubble ones, whose backward is split into an input gradient B and a
  weight gradient W that fills the gaps, from ``zero_bubble.py``, with W ``Practice.w_share`` of each backward)
  with each virtual stage's own forward and backward times (the first and last carry the embedding and the head;
  layers not dividing evenly go to the middle stages, as Llama 3 did), and the time its point-to-point messages
  add on the critical path;
- **tp**, **cp**, **dp**: communication left exposed. TP collectives wait inside every layer (no overlap); the CP
  exchange hides behind the attention it feeds, chapter 14's rule (on a CPU device, ``Practice.ring_exchanges``:
  exchange by exchange as chapter 14's ring makes them, each a one-way message); data-parallel and ZeRO traffic
  hides behind backward (gradients) and forward (weights) up to what those windows hold, a bucket at a time
  (chapters 02 and 11): what is left is ``max(last bucket, traffic - window)``;
- **optimizer**: AdamW's update, memory-bound over the parameters a GPU holds.

Collectives use the alpha-beta model over the tier each group spans (groups laid out [TP, CP, PP, DP] from the
innermost, Llama 3 Figure 5) at the bus bandwidth a published sweep achieved (``Link.achieved``); a group whose
members share nodes reduces hierarchically (reduce-scatter inside the node, all-reduce across, all-gather inside).

Modelling choices, stated once: backward elementwise work moves twice the forward bytes; gradients are reduced in
fp32 under bf16 (Megatron-LM forces ``accumulate_allreduce_grads_in_fp32`` with bf16) and in fp16 under fp16; AdamW
moves 30 bytes per parameter it updates (fp32 master weight, two moments and gradient read, three written, a 16-bit
copy written); ranks that share a machine's cores slow each other's compute by ranks / cores.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache

from workers.layout.rules import Layout
from workers.pipeline.schedules import Plan, all_stages
from workers.pipeline.validity import split_plan
from workers.pipeline.zero_bubble import SPLIT_SCHEDULES, placed_stage, placement_of, split_stages

from .device_rates import GemmRow, GemmTable, gemm_table
from .hardware import GPU, Cluster, Link
from .ledger import collective_time, flops_per_token
from .model_shapes import ModelShape

TERMS = ("matmul", "attention", "memory-bound", "kernel overhead", "recompute", "tp", "cp", "ep", "bubble", "pp",
         "dp", "optimizer")
COMPUTE_TERMS = ("matmul", "attention", "memory-bound", "kernel overhead", "recompute")
COMM_TERMS = ("tp", "cp", "ep", "pp", "dp")

# FlashAttention (PyTorch SDPA's flash backend, FlashAttention-2) on the course's H200, bf16, batch 2, 16 heads of
# 128, against an 8192^3 bf16 matmul of the same run (796 TFLOP/s): forward and forward+backward TFLOP/s with the
# causal work halved (shared/reference/h200_attention_baseline.json). The share of the best matmul it reaches is
# taken as FlashAttention's share on any device; by sequence length, interpolated in log2.
_MATMUL_TFLOPS = 795.7
ATTENTION_SHARE = {  # seq: (forward share, forward+backward share), causal
    1024: (141.5 / _MATMUL_TFLOPS, 125.5 / _MATMUL_TFLOPS),
    4096: (271.7 / _MATMUL_TFLOPS, 249.0 / _MATMUL_TFLOPS),
    16384: (344.0 / _MATMUL_TFLOPS, 318.0 / _MATMUL_TFLOPS),
}
# cuDNN's fused attention (PyTorch SDPA's cudnn backend; Transformer Engine's default in Megatron-Core), same run
ATTENTION_SHARE_CUDNN = {
    1024: (254.4 / _MATMUL_TFLOPS, 54.6 / _MATMUL_TFLOPS),
    4096: (541.0 / _MATMUL_TFLOPS, 473.0 / _MATMUL_TFLOPS),
    16384: (648.0 / _MATMUL_TFLOPS, 582.0 / _MATMUL_TFLOPS),
}
FLASH_BACKWARD_FLOPS = 2.5  # backward = 2.5 x forward FLOPs (FlashAttention-2, sec 4: fwd+bwd counted as 3.5x fwd)
ADAMW_BYTES_PER_PARAM = 30.0
# Kernels per layer (forward, backward) of an unfused pre-LN block in eager PyTorch: the aten ops of chapter 15's
# block counted with torch's dispatch mode (course_utils/machine_device.py counts the learner's own model the same
# way); on a GPU they only bound a layer's time from below, which no published run's layer comes near.
OPS_PER_LAYER = (38, 69)


@dataclass(frozen=True)
class Practice:
    """How a run executes what its layout leaves open (each published run says which it used)."""

    flash_attention: bool = True  # a fused attention kernel that never writes the scores
    attention_kernel: str = "flash"  # which one: "flash" (FlashAttention-2) or "cudnn" (Transformer Engine's default)
    dtype: str = "bf16"  # matmul precision: "bf16", "fp16", "fp8" (FP8 GEMMs at the FP8 rate, plus casts)
    grad_overlap: bool = True  # DP gradient reduction overlapped with backward (DDP, Megatron overlap_grad_reduce)
    param_gather_overlap: bool = True  # ZeRO weight all-gather overlapped with the next forward
    bucket_bytes: float = 40e6  # Megatron's default gradient bucket (40M elements' worth is larger; bytes here)
    stage_layers: tuple[int, ...] | None = None  # layers per virtual stage, first to last; None: balanced
    ops_per_layer: tuple[int, int] = OPS_PER_LAYER
    activation_bytes: float = 2.0
    dropout: bool | None = None  # None: GPT-style blocks (GeLU MLP) have dropout, Llama-style do not
    grad_bytes: float | None = None  # None: 4 under bf16 (fp32 reduction), 2 under fp16
    extra_ops_per_microbatch: int = 0  # ops outside the layers (a CPU trainer's loss, embedding, bookkeeping)
    imbalance: float = 1.0  # mixture of experts: the busiest expert's rows over the mean
    dualpipe: bool = False  # DeepSeek-V3's DualPipe: its bubble formula, all-to-alls overlapped with compute
    ep_overlap: bool = False  # one micro-batch's all-to-alls hidden behind another's compute (Megatron-Core's
    #                           overlap_moe_expert_parallel_comm); DualPipe implies it
    fused: bool = True  # elementwise work fused (Megatron's kernels, torch.compile); False: eager PyTorch passes
    recompute_matmuls: float = 0.0  # under "selective": the share of forward matmul time recomputed too
    # context parallelism's attention: "ring" (chapter 14's ring, its K/V exchange hidden behind the blocks it feeds)
    # or "ulysses" (DeepSpeed-Ulysses, Jacobs et al. 2023: all-to-alls of q, k, v and out that nothing hides)
    cp_attention: str = "ring"
    # a device whose transfers wait for a core (a CPU): the ring priced exchange by exchange as chapter 14's ring
    # makes them (each rank's K/V chunk one way: cp - 1 forward and cp - 1 backward, posted before the blocks they
    # overlap, and cp of the dK/dV accumulator that backward waits for at once), each one the device's one-way
    # message, hidden behind the attention math and the dispatch of the ring's own ops (``ring_ops_per_layer``,
    # forward and backward: on a CPU a block of tiny ops takes as long as their dispatch)
    ring_exchanges: bool = False
    ring_ops_per_layer: tuple[int, int] = (0, 0)
    # a CPU rank runs its messages' ends itself: each end (a send or a receive of the ring's exchanges, of a
    # pipeline stage's activation or gradient) costs it this much, serial with its compute
    message_end_cpu_s: float = 0.0
    # the loss computed from each TP rank's block of the vocabulary (Megatron's vocab_parallel_cross_entropy, three
    # [s, b] all-reduces); False: the logits all-gathered over TP first, then a replicated softmax
    loss_parallel: bool = True
    # TP's all-gather / reduce-scatter decomposed around the GEMMs they feed (collective matmul, Wang et al. 2023;
    # PyTorch's async TP): hidden up to the layer's matmul time, one ring step always exposed
    tp_overlap: bool = False
    # the weight gradient's share of a backward, for the schedules that split it (zero bubble): per linear layer dX
    # and dW are one GEMM each of the same FLOPs (Qi et al. 2023 take T_B = T_W); attention's core and the
    # elementwise backward belong to B, which this share leaves to the GEMMs' even split
    w_share: float = 0.5
    pp_outermost: bool = False  # rank order tp-cp-dp-pp (Megatron, torchtitan, DeepSpeed) instead of Llama 3's [TP, CP, PP, DP]


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step by term (they add up to ``total``), and what was hidden behind compute."""

    terms: dict[str, float]
    hidden: dict[str, float]
    stage_busy: tuple[float, ...]  # per pipeline rank: seconds of forward and backward work
    model_flops: float  # per step, all GPUs (PaLM's convention)
    n_gpus: int
    peak_flops: float
    notes: tuple[str, ...] = field(default=())

    @property
    def total(self) -> float:
        return sum(self.terms.values())

    @property
    def compute(self) -> float:
        return sum(self.terms[t] for t in COMPUTE_TERMS)

    @property
    def exposed_comm(self) -> float:
        return sum(self.terms[t] for t in COMM_TERMS)

    @property
    def comm_share(self) -> float:
        """Exposed communication / step: the chapter's second question."""
        return self.exposed_comm / self.total

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.total * self.n_gpus * self.peak_flops)

    def dominant(self) -> str:
        return max(self.terms, key=self.terms.get)


# -- compute pieces ---------------------------------------------------------------------------------------------

def _table(gpu: GPU, dtype: str) -> GemmTable:
    if gpu.gemm_rows:
        rows = tuple(GemmRow(m, n, k, f) for d, m, n, k, f in gpu.gemm_rows if d == dtype)
        if not rows:
            rows = tuple(GemmRow(m, n, k, f) for _, m, n, k, f in gpu.gemm_rows)
        return GemmTable(gpu.name, dtype, rows)
    return gemm_table(gpu.gemm, "bf16" if dtype in ("fp8", "fp16") and gpu.gemm else dtype) if dtype != "fp16" \
        else _fp16_table(gpu)


def _fp16_table(gpu: GPU) -> GemmTable:
    """FP16 and BF16 tensor cores share one peak; a device measured in one dtype stands for the other."""
    for dtype in ("fp16", "bf16"):
        try:
            return gemm_table(gpu.gemm, dtype)
        except ValueError:
            continue
    raise ValueError(f"no fp16 or bf16 matmul measurements for {gpu.name}.")


def gemm_seconds(table: GemmTable, m: float, n: float, k: float, *, backward: bool = False, scale: float = 1.0) -> float:
    """One (m x k) @ (k x n) forward product, or its two backward products: dX (m x n)(n x k), dW (k x m)(m x n)."""
    if not backward:
        return table.seconds(m, n, k) / scale
    return (table.seconds(m, k, n) + table.seconds(k, n, m)) / scale


def layer_gemms(model: ModelShape, tokens: float, tp: int, moe=None, ep: int = 1, expert_layer: bool = False,
                imbalance: float = 1.0) -> list[tuple[float, float, float, float]]:
    """(m, n, k, count) of one layer's forward GEMMs on one TP rank for ``tokens`` rows (Megatron's column/row split).

    With ``moe`` (a ``PublishedMoE``), multi-head latent attention's five projections replace Q, K, V and O when the
    model has them, and an expert layer (``expert_layer``) replaces the MLP by its shared experts (on every token)
    and its routed experts: each rank holds experts / ep of them, whole (no TP inside an expert), and receives the
    tokens/tp rows of each of the ep ranks it serves, top_k copies each, spread over its experts; ``imbalance``
    multiplies the rows of the busiest expert (1: the router's load is even)."""
    held = model.held_by_tp(tp)
    h = model.hidden
    if moe is not None and moe.attention == "mla":
        qk = moe.qk_nope_head_dim + moe.qk_rope_head_dim
        attention = [(tokens, moe.q_lora_rank, h, 1), (tokens, moe.heads * qk / tp, moe.q_lora_rank, 1),
                     (tokens, moe.kv_lora_rank + moe.qk_rope_head_dim, h, 1),
                     (tokens, moe.heads * (moe.qk_nope_head_dim + moe.v_head_dim) / tp, moe.kv_lora_rank, 1),
                     (tokens, h, moe.heads * moe.v_head_dim / tp, 1)]
    else:
        attention = [(tokens, (h + 2 * held.kv_dim) / tp, h, 1),  # QKV (column parallel)
                     (tokens, h, h / tp, 1)]  # output projection (row parallel)
    if moe is not None and expert_layer:
        mlp = []
        if moe.shared_experts:
            width = moe.shared_experts * moe.expert_ffn / tp
            mlp += [(tokens, 2 * width, h, 1), (tokens, h, width, 1)]
        local = moe.experts / ep
        rows = tokens / tp * moe.top_k / local * imbalance  # rows per local expert
        mlp += [(rows, 2 * moe.expert_ffn, h, local), (rows, h, moe.expert_ffn, local)]
        mlp.append((tokens / tp, moe.experts, h, 1))  # the router
        return attention + mlp
    up = (2 if model.mlp == "swiglu" else 1) * model.ffn / tp
    return attention + [(tokens, up, h, 1),  # MLP up (and gate)
                        (tokens, h, model.ffn / tp, 1)]  # MLP down


def attention_share(seq: float, kernel: str = "flash") -> tuple[float, float]:
    """A fused attention kernel's (forward, forward+backward) share of the best matmul rate at ``seq`` ("flash":
    FlashAttention-2, "cudnn": cuDNN's), log2-interpolated between the measured lengths."""
    table = ATTENTION_SHARE_CUDNN if kernel == "cudnn" else ATTENTION_SHARE
    keys = sorted(table)
    x = min(max(math.log2(seq), math.log2(keys[0])), math.log2(keys[-1]))
    for a, b in zip(keys, keys[1:]):
        if x <= math.log2(b):
            w = (x - math.log2(a)) / (math.log2(b) - math.log2(a))
            return tuple((1 - w) * table[a][i] + w * table[b][i] for i in range(2))
    return table[keys[-1]]


def interpolated(points, x: float) -> float:
    """``y`` at ``x`` on the broken line through measured ``(x, y)`` points, its end segments extended past them
    (one point: proportional to x); never below 0."""
    pts = sorted(points)
    if len(pts) == 1:
        return pts[0][1] * x / pts[0][0]
    i = min(max(sum(1 for px, _ in pts if px <= x) - 1, 0), len(pts) - 2)
    (x0, y0), (x1, y1) = pts[i], pts[i + 1]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def timed_attention(rows, batch_heads: float, seq: float, head_dim: float) -> tuple[float, float]:
    """(forward, forward + backward) seconds of fused causal attention from a device's timed calls, ``rows`` of
    ``(batch x heads, seq, head_dim, forward_s, forward_backward_s)``: along batch x heads through the rows of the
    same sequence and head width (a call's time grows with its heads), else the row nearest in work
    (heads x seq^2 x head_dim), scaled by the work."""
    same = [(bh, f, fb) for bh, s, d, f, fb in rows if s == seq and d == head_dim]
    if same:
        return tuple(interpolated([(bh, t[i]) for bh, *t in same], batch_heads) for i in range(2))
    work = batch_heads * seq * seq * head_dim
    bh, s, d, f, fb = min(rows, key=lambda r: abs(math.log(work / (r[0] * r[1] * r[1] * r[2]))))
    scale = work / (bh * s * s * d)
    return f * scale, fb * scale


def attention_seconds(model: ModelShape, layout: Layout, table: GemmTable, practice: Practice,
                      head_dim: float | None = None, timed: tuple = ()) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's attention core for one micro-batch on one rank (``head_dim``:
    the mean of the QK and V head widths when they differ, as in multi-head latent attention). A fused kernel the
    device timed (``timed``: ``timed_attention``'s rows, in the practice's dtype) is priced from those times: a
    causal ring over cp ranks computes 1/cp of the square on each."""
    b, seq, cp, tp = layout.micro_batch, layout.seq, layout.cp, layout.tp
    heads = model.heads / tp
    sq, hd = seq / cp, head_dim or model.head_dim
    square = 4.0 * b * heads * sq * seq * hd  # QK^T and AV, every query against every key (the ring brings all)
    if practice.flash_attention and timed:
        forward, both = timed_attention(timed, b * heads, seq, hd)
        return forward / cp, max(both - forward, 0.0) / cp
    if practice.flash_attention:
        fwd_share, both_share = attention_share(seq, practice.attention_kernel)
        work = square / 2  # causal: FlashAttention skips the masked blocks
        forward = work / (table.best * fwd_share)
        both = (1 + FLASH_BACKWARD_FLOPS) * work / (table.best * both_share)
        return forward, max(both - forward, 0.0)
    batch = b * heads  # batched GEMMs over the whole square, as unfused kernels compute them
    forward = batch * (table.seconds(sq, seq, hd) + table.seconds(sq, hd, seq))
    backward = batch * (table.seconds(sq, hd, seq) + table.seconds(seq, hd, sq) + table.seconds(sq, seq, hd)
                        + table.seconds(hd, seq, sq))
    return forward, backward


def memory_bound_bytes(model: ModelShape, layout: Layout, practice: Practice) -> dict[str, float]:
    """Bytes one rank moves per layer and micro-batch outside matmuls, forward (backward moves twice as many).

    Per token, with 2-byte activations and d the width a rank's norms and residuals see (h, or h/tp under sequence
    parallelism): two LayerNorms read and write d (8d); two residual adds read two and write one (12d), with dropout
    also a 1-byte mask (14d in all, Megatron's fused bias-dropout-add); the activation function
    reads and writes the MLP's width (GeLU 4 ffn/tp, SwiGLU 6 ffn/tp); RoPE rewrites q and k; an unfused softmax
    reads and writes the scores (4 bytes per score, 9 with attention dropout) over every key of every local head.
    """
    tp, cp, b = layout.tp, layout.cp, layout.micro_batch
    tokens = b * layout.seq / cp
    h = model.hidden
    e = practice.activation_bytes
    dropout = practice.dropout if practice.dropout is not None else model.mlp == "gelu"
    d = h / tp if layout.sequence_parallel and tp > 1 else h
    norms = 2 * 2 * e * d
    residual = 2 * (3 * e * d + (d if dropout else 0))
    act = (3 if model.mlp == "swiglu" else 2) * e * model.ffn / tp
    rope = 0.0 if model.mlp == "gelu" else 2 * e * (h + model.held_by_tp(tp).kv_dim) / tp
    if not practice.fused and model.mlp == "swiglu":
        # eager PyTorch, one kernel per op: RMSNorm upcasts to fp32, squares, averages, scales, casts back and
        # multiplies by its weight (2+4, 4+4, 4, 4+4, 4+2, 2+2 bytes: 36 per element, not 4); SwiGLU's silu and product
        # are two passes (10 bytes per element of ffn, not 6); RoPE through complex fp32 views ~30 bytes per element
        # of q and k, not 4 (torchtitan's Llama and Meta's reference model.py are written this way)
        norms = 2 * 36 * d
        act = 10 * model.ffn / tp
        rope = 30 * (h + model.held_by_tp(tp).kv_dim) / tp
    softmax = 0.0
    if not practice.flash_attention:
        softmax = (2 * e + (e + 1 + e if dropout else 0)) * model.heads / tp * layout.seq
    return {"norms": norms * tokens, "residual": residual * tokens, "activation": act * tokens, "rope": rope * tokens,
            "softmax": softmax * tokens}


# -- communication pieces ----------------------------------------------------------------------------------------

def link_time(collective: str, nbytes: float, ranks: int, link: Link) -> float:
    """One collective over one tier: the tier's fitted (alpha, beta) when it was measured, else the ring formula."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    for name, n, alpha, beta in link.fitted:
        if name == collective and n == ranks:
            return alpha + beta * nbytes
    if link.fitted:  # measured at other group sizes only: scale the nearest fit by the ring's hop and byte counts
        same = [f for f in link.fitted if f[0] == collective]
        name, n, alpha, beta = min(same or list(link.fitted), key=lambda f: abs(f[1] - ranks))
        ring = collective_time(collective, nbytes, ranks, 1.0, 1.0) / max(collective_time(collective, nbytes, n, 1.0, 1.0), 1e-30)
        return (alpha + beta * nbytes) * ring
    return collective_time(collective, nbytes, ranks, link.achieved, link.latency)


def group_time(collective: str, nbytes: float, ranks: int, stride: int, cluster: Cluster) -> float:
    """A collective over ``ranks`` GPUs ``stride`` apart: inside a node on NVLink, across nodes on the fabric, and
    hierarchically when several members share a node (reduce-scatter inside, the collective across on 1/k of the
    bytes with k NICs at once, all-gather inside)."""
    if ranks <= 1:
        return 0.0
    per_node = max(1, cluster.gpus_per_node // stride) if stride < cluster.gpus_per_node else 1
    if collective == "all_to_all" and stride * ranks > cluster.gpus_per_node:
        # each rank sends 1/ranks of its buffer to every other: the share bound for other nodes leaves on its own
        # NIC, the share for its node's k - 1 peers goes over NVLink, at the same time
        k = min(per_node, ranks)
        off = nbytes * (ranks - k) / ranks
        on = nbytes * (k - 1) / ranks
        across = link_time("send_recv", off, 2, cluster.inter_node) + (ranks // k - 1) * cluster.inter_node.latency
        inside = link_time("send_recv", on, 2, cluster.intra_node) if k > 1 else 0.0
        return max(across, inside)
    if stride * ranks <= cluster.gpus_per_node:
        return link_time(collective, nbytes, ranks, cluster.intra_node)
    if per_node == 1:
        return link_time(collective, nbytes, ranks, cluster.inter_node)
    k = min(per_node, ranks)
    nodes = ranks // k
    inside = link_time("reduce_scatter", nbytes, k, cluster.intra_node) if collective != "all_gather" else 0.0
    outside = link_time(collective, nbytes / k, nodes, cluster.inter_node)
    after = link_time("all_gather", nbytes, k, cluster.intra_node) if collective != "reduce_scatter" else 0.0
    return inside + outside + after


def exposed(traffic: float, window: float, tail: float) -> float:
    """What a bucketed collective leaves on the critical path when it can start as ``window`` seconds of compute
    run: its last bucket (``tail``) always, and whatever does not fit under the window."""
    return max(min(tail, traffic), traffic - window) if traffic > 0 else 0.0


# -- stages ---------------------------------------------------------------------------------------------------------

@lru_cache(maxsize=64)
def schedule_plan(schedule: str, p: int, m: int, chunks: int) -> Plan:
    """Chapter 13's tables for ``schedule`` compiled once (``schedules.Plan``; a table that splits the backward
    checked first: ``validity.split_plan``, what ``simulate_split`` runs): the planner prices the same table at every GEMM share and
    layout it tries, and a compiled table prices in a twentieth of a simulation's time. A plan of a published run's
    step is a few MB (flat arrays of its hundreds of thousands of actions)."""
    if schedule in SPLIT_SCHEDULES:
        return split_plan(split_stages(schedule, p, m), placement_of(schedule))
    return Plan(all_stages(schedule, p, m, chunks))


def pipeline_makespan(schedule: str, p: int, m: int, v: int, fwd: list[float], bwd: list[float],
                      message: float, w_share: float = 0.5) -> float:
    """Seconds from the first forward to the last backward of one step: chapter 13's action lists for ``schedule``
    simulated with each virtual stage's own times (``workers/pipeline/schedules.simulate``, through the table's
    compiled ``schedule_plan``; a schedule that splits the backward as ``validity.simulate_split`` replays it, with
    B and W ``1 - w_share`` and ``w_share`` of it).

    Past the warm-up every further group of p micro-batches adds about the same time (the pipeline is in its steady
    state), so a step of more than 8pv micro-batches is simulated at 4pv and 8pv and extended along that line: within
    0.1% of the full simulation on stages of random, unequal times (tests/test_step_time.py), and it keeps a long
    step's pricing to a fraction of a second."""
    chunks = v if schedule in ("interleaved", *SPLIT_SCHEDULES) else 1
    if p == 1:
        return m * (fwd[0] + bwd[0])

    def makespan(micro: int) -> float:
        plan = schedule_plan(schedule, p, micro, chunks)
        if schedule in SPLIT_SCHEDULES:
            return plan.run(list(fwd), [b * (1 - w_share) for b in bwd], message,
                            weight_time=[b * w_share for b in bwd], boxes=False)["makespan"]
        return plan.run(fwd, bwd, message, boxes=False)["makespan"]

    low, high = 4 * p * chunks, 8 * p * chunks  # the interleaved warm-up grows with the chunks
    if m <= high:
        return makespan(m)
    t_low, t_high = makespan(low), makespan(high)
    return t_low + (m - low) * (t_high - t_low) / (high - low)


def held_stages(schedule: str, rank: int, p: int, v: int) -> list[int]:
    """The virtual stages pipeline rank ``rank`` holds: round the ranks (chunk c is virtual stage c p + rank), or in a
    V for ZB-V and DualPipeV (``rank`` and 2p - 1 - rank: the first rank holds the embedding and the head)."""
    placement = placement_of(schedule) if p > 1 else "loop"
    return [placed_stage(rank, c, p, placement) for c in range(v)]


def stage_layers(layers: int, virtual_stages: int) -> list[int]:
    """Layers per virtual stage: equal when they divide; otherwise the first and last get fewer (they also carry the
    embedding and the head), the middle ones one more (Llama 3, sec 3.3.2: one layer fewer on the first and last)."""
    base, extra = divmod(layers, virtual_stages)
    counts = [base] * virtual_stages
    middle = list(range(1, virtual_stages - 1)) or list(range(virtual_stages))
    order = sorted(middle, key=lambda i: abs(i - (virtual_stages - 1) / 2))  # nearest the middle first
    for i in order[:extra]:
        counts[i] += 1
    if extra > len(order):
        for i in (0, virtual_stages - 1)[: extra - len(order)]:
            counts[i] += 1
    return counts


@dataclass(frozen=True)
class _Piece:
    """Seconds of one layer (or the head) for one micro-batch on one rank, by term, forward and backward."""

    forward: dict
    backward: dict


def _add(a: dict, b: dict, times: float = 1.0) -> dict:
    return {k: a.get(k, 0.0) + times * b.get(k, 0.0) for k in {**a, **b}}  # in a fixed order: sums of its values repeat


def _layer_piece(model: ModelShape, layout: Layout, cluster: Cluster, practice: Practice, table: GemmTable,
                 contention: float, moe=None, expert_layer: bool = False) -> tuple[_Piece, dict]:
    gpu = cluster.gpu
    tp, cp, b = layout.tp, layout.cp, layout.micro_batch
    tokens = b * layout.seq / cp
    scale = 1.0 / contention
    fp8 = practice.dtype == "fp8" and gpu.fp8_flops > 0
    speed = gpu.fp8_flops / gpu.peak_flops if fp8 else 1.0
    gemms = layer_gemms(model, tokens, tp, moe, layout.ep, expert_layer, practice.imbalance)
    mm_f = sum(c * gemm_seconds(table, m, n, k, scale=speed * scale) for m, n, k, c in gemms)
    mm_b = sum(c * gemm_seconds(table, m, n, k, backward=True, scale=speed * scale) for m, n, k, c in gemms)
    head_dim = None
    if moe is not None and moe.attention == "mla":
        head_dim = (moe.qk_nope_head_dim + moe.qk_rope_head_dim + moe.v_head_dim) / 2
    timed = tuple(r[1:] for r in gpu.attention_rows if r[0] == practice.dtype)
    at_f, at_b = attention_seconds(model, layout, table, practice, head_dim, timed)
    at_f, at_b = at_f * contention, at_b * contention
    bw = gpu.memory_bandwidth * gpu.stream_efficiency
    moved = memory_bound_bytes(model, layout, practice)
    mem = sum(moved.values())
    if fp8:  # each GEMM's two inputs cast to FP8: read 2 bytes, write 1, forward and backward
        mem += sum(c * 3.0 * (m * k + k * n) for m, n, k, c in gemms)
    act_f = act_b = 0.0
    act_rows = [(n, f, fb) for d, n, f, fb in gpu.activation_rows if d == practice.dtype]
    if act_rows and model.mlp == "gelu":  # the device timed its GELU: that time instead of its bytes
        mem -= moved["activation"]
        elements = tokens * model.ffn / tp
        act_f = interpolated([(n, f) for n, f, _ in act_rows], elements)
        act_b = max(interpolated([(n, fb) for n, _, fb in act_rows], elements) - act_f, 0.0)
    mem_f, mem_b = (mem / bw + act_f) * contention, (2 * mem / bw + act_b) * contention
    ops_f, ops_b = practice.ops_per_layer
    over = gpu.kernel_overhead_s * contention

    def with_overhead(work: float, ops: int) -> tuple[float, float]:
        if gpu.overhead_serial:
            return work, ops * over
        return work, max(0.0, ops * over - work)

    # TP: 2 collectives forward, 2 backward per layer (all-reduces, or all-gather + reduce-scatter under SP)
    msg = b * layout.seq / cp * model.hidden * practice.activation_bytes
    if layout.sequence_parallel and tp > 1:  # each all-reduce becomes its two halves: same bytes, two launches
        tp_one = 2 * (group_time("all_gather", msg, tp, 1, cluster) + group_time("reduce_scatter", msg, tp, 1, cluster))
    else:
        tp_one = 2 * group_time("all_reduce", msg, tp, 1, cluster)
    tp_f = tp_b = tp_one
    tp_hidden = 0.0
    if practice.tp_overlap and tp > 1:  # each shard's transfer runs under the previous shard's GEMM chunk
        tp_f, tp_b = exposed(tp_one, mm_f, tp_one / tp), exposed(tp_one, mm_b, tp_one / tp)
        tp_hidden = 2 * tp_one - tp_f - tp_b
    # CP: K and V of the whole sequence gathered forward, their gradients reduce-scattered backward; the exchange
    # hides behind the attention it feeds, one ring step's transfer always exposed (chapter 14)
    cp_f = cp_b = cp_hidden = 0.0
    exchanges = (0, 0)  # the ring's exchanges per layer (forward, backward), when they are priced one by one
    if cp > 1 and practice.cp_attention == "ulysses":
        # each rank's [s/cp] rows of q, k, v sent as heads/cp heads of every row, out back (chapter 14's counts):
        # KV heads fewer than cp travel as cp copies; nothing overlaps an all-to-all that attention waits for
        heads, kv_heads = model.heads / tp, max(1.0, model.kv_heads / tp)
        if heads % cp:
            raise ValueError(f"cp={cp} does not divide the {heads:g} query heads a TP rank holds: Ulysses gives each "
                             "rank whole heads")
        kv_sent = kv_heads if kv_heads % cp == 0 else cp
        rows = b * layout.seq / cp * model.head_dim * practice.activation_bytes
        cp_f = cp_b = group_time("all_to_all", (heads + 2 * kv_sent) * rows, cp, tp, cluster) \
            + group_time("all_to_all", heads * rows, cp, tp, cluster)
    elif cp > 1 and practice.ring_exchanges:
        one = group_time("send_recv", 2.0 * tokens * model.held_by_tp(tp).kv_dim / tp * practice.activation_bytes,
                         2, tp, cluster)  # this rank's K/V chunk, one way to the next rank of the ring
        ring_f, ring_b = (n * over if gpu.overhead_serial else 0.0 for n in practice.ring_ops_per_layer)
        cp_f = exposed((cp - 1) * one, at_f + ring_f, one)
        cp_b = exposed((cp - 1) * one, at_b + ring_b, one) + cp * one
        cp_hidden = (3 * cp - 2) * one - cp_f - cp_b
        exchanges = (cp - 1, 2 * cp - 1)
    elif cp > 1:
        kv = 2.0 * b * layout.seq * model.held_by_tp(tp).kv_dim / tp * practice.activation_bytes
        gather = group_time("all_gather", kv, cp, tp, cluster)
        scatter = group_time("reduce_scatter", kv, cp, tp, cluster)
        cp_f = exposed(gather, at_f, gather / cp)
        cp_b = exposed(scatter, at_b, scatter / cp)
        cp_hidden = gather + scatter - cp_f - cp_b
    # EP: the dispatch and the combine, each an all-to-all of the tokens/tp rows top_k times over the EP group
    # (forward, and again backward); DualPipe and Megatron's A2A overlap hide them behind the other direction's compute
    ep_f = ep_b = ep_hidden = 0.0
    if moe is not None and expert_layer and layout.ep > 1:
        rows = b * layout.seq / cp / tp * moe.top_k * practice.imbalance
        dispatch = rows * model.hidden * (1.0 if practice.dtype == "fp8" else practice.activation_bytes)
        combine = rows * model.hidden * practice.activation_bytes
        stride = tp * cp * (1 if practice.pp_outermost else layout.pp) if layout.dp > 1 else tp
        a2a = group_time("all_to_all", dispatch, layout.ep, stride, cluster) \
            + group_time("all_to_all", combine, layout.ep, stride, cluster)
        ep_f = ep_b = a2a
        if practice.dualpipe or practice.ep_overlap:
            ep_f = exposed(a2a, mm_f + at_f, a2a / layout.ep)
            ep_b = exposed(a2a, mm_b + at_b, a2a / layout.ep)
            ep_hidden = 2 * a2a - ep_f - ep_b
    forward = {"matmul": mm_f, "attention": at_f, "memory-bound": mem_f, "tp": tp_f, "cp": cp_f, "ep": ep_f}
    work_f = mm_f + at_f + mem_f
    _, forward["kernel overhead"] = with_overhead(work_f, ops_f)
    backward = {"matmul": mm_b, "attention": at_b, "memory-bound": mem_b, "tp": tp_b, "cp": cp_b, "ep": ep_b}
    _, backward["kernel overhead"] = with_overhead(mm_b + at_b + mem_b, ops_b)
    # the exchanges' message ends, a send and a receive each
    forward["kernel overhead"] += 2 * exchanges[0] * practice.message_end_cpu_s * contention
    backward["kernel overhead"] += 2 * exchanges[1] * practice.message_end_cpu_s * contention
    recompute = 0.0
    if layout.recompute == "full":
        recompute = work_f + forward["kernel overhead"] + tp_one
    elif layout.recompute == "selective":
        if not practice.flash_attention:
            soft = memory_bound_bytes(model, layout, practice)["softmax"] / bw * contention
            recompute = at_f + soft
        # torchtitan's per-op policy saves every other matmul's output and recomputes the rest with the elementwise
        # work around them (torchtitan, activation_checkpoint.py: _save_list, "every other mm")
        recompute += practice.recompute_matmuls * (mm_f + mem_f)
    backward["recompute"] = recompute
    return _Piece(forward, backward), {"cp": cp_hidden, "ep": ep_hidden, "tp": tp_hidden}


def layer_seconds(model: ModelShape, layout: Layout, cluster: Cluster, practice: Practice = Practice(), *,
                  sustained: float = 1.0) -> dict[str, dict[str, float]]:
    """One layer, one micro-batch, one rank: ``{"forward": {term: s}, "backward": {term: s}}`` as ``step_time``
    prices it (``layout`` needs micro_batch and seq)."""
    table = _table(cluster.gpu, practice.dtype)
    if sustained != 1.0:
        table = replace(table, rows=tuple(replace(r, flops=r.flops * sustained) for r in table.rows))
    piece, _ = _layer_piece(model, layout, cluster, practice, table, 1.0)
    return {"forward": dict(piece.forward), "backward": dict(piece.backward)}


def _head_piece(model: ModelShape, layout: Layout, cluster: Cluster, practice: Practice, table: GemmTable,
                contention: float) -> _Piece:
    """The output projection to the vocabulary (column parallel over TP) and the loss's softmax in fp32."""
    tokens = layout.micro_batch * layout.seq / layout.cp
    n = model.vocab / layout.tp
    f = gemm_seconds(table, tokens, n, model.hidden) * contention
    bkw = gemm_seconds(table, tokens, n, model.hidden, backward=True) * contention
    bw = cluster.gpu.memory_bandwidth * cluster.gpu.stream_efficiency
    if practice.loss_parallel or layout.tp == 1:
        logits = tokens * n * (practice.activation_bytes + 4 + 4)  # logits written, read and softmaxed in fp32
        return _Piece({"matmul": f, "memory-bound": logits / bw * contention},
                      {"matmul": bkw, "memory-bound": 2 * logits / bw * contention})
    # without loss parallelism every TP rank gathers the whole [s, b, V] logits and softmaxes all of them
    gather = group_time("all_gather", tokens * model.vocab * practice.activation_bytes, layout.tp, 1, cluster)
    logits = tokens * model.vocab * (practice.activation_bytes + 4 + 4)
    return _Piece({"matmul": f, "memory-bound": logits / bw * contention, "tp": gather},
                  {"matmul": bkw, "memory-bound": 2 * logits / bw * contention})


def model_flops_per_token(model: ModelShape, seq: int, moe=None) -> float:
    """PaLM's model FLOPs per token (Appendix B): 6 N + 12 L H Q T; for a mixture of experts N is the parameters one
    token uses without the input embedding (a lookup), Q the mean of the QK and V head widths."""
    if moe is None:
        return flops_per_token(model.n_params, model.layers, model.heads, model.head_dim, seq)
    from .moe_counts import moe_parameter_counts

    counts = moe_parameter_counts(moe)
    q = (moe.qk_nope_head_dim + moe.qk_rope_head_dim + moe.v_head_dim) / 2 if moe.attention == "mla" \
        else (moe.head_dim or moe.hidden // moe.heads)
    return 6.0 * (counts["active"] - counts["input_embedding"]) + 12.0 * moe.layers * moe.heads * q * seq


def stage_params(model: ModelShape, layers: int, tp: int, first: bool, last: bool, pp: int) -> float:
    """Parameters one rank of a stage holding ``layers`` layers keeps (1/tp of them), embeddings where they live."""
    held = model.held_by_tp(tp)
    emb = model.vocab * model.hidden
    count = layers * held.params_per_layer
    if pp == 1:
        count = held.n_params
    else:  # the first stage holds the embedding, the last the head (a copy of it when tied, as Megatron keeps)
        count += (emb if first else 0) + (emb if last else 0)
    return count / tp


def step_time(model: ModelShape, layout: Layout, n_gpus: int, cluster: Cluster,
              practice: Practice = Practice(), *, sustained: float = 1.0, moe=None) -> StepTime:
    """Seconds of one optimizer step of a resolved ``layout`` (dp, micro_batches and seq filled in), by term.

    ``sustained``: the share of its isolated benchmark rate a matmul keeps inside a long training step (one constant
    per GPU generation, ``planner_runs.SUSTAINED``); 1 for a device calibrated by running its own steps.
    ``moe``: a ``PublishedMoE`` whose first ``dense_layers`` layers are dense and the rest expert layers
    (``model`` then carries its hidden size, heads, dense FFN width and vocabulary)."""
    gpu = cluster.gpu
    table = _table(gpu, practice.dtype)
    if sustained != 1.0:
        table = replace(table, rows=tuple(replace(r, flops=r.flops * sustained) for r in table.rows))
    tp, pp, cp, dp, v = layout.tp, layout.pp, layout.cp, layout.dp, layout.virtual_stages
    m = layout.micro_batches
    contention = max(1.0, n_gpus / gpu.cores) if gpu.cores else 1.0
    notes = []
    piece, hidden = _layer_piece(model, layout, cluster, practice, table, contention, moe)
    expert_piece = piece
    if moe is not None:
        expert_piece, expert_hidden = _layer_piece(model, layout, cluster, practice, table, contention, moe, True)
        hidden["ep"] = expert_hidden["ep"] * (model.layers - moe.dense_layers) / model.layers
    dense_layers = moe.dense_layers if moe is not None else model.layers
    head = _head_piece(model, layout, cluster, practice, table, contention)
    chunks = pp * v
    counts = list(practice.stage_layers) if practice.stage_layers else stage_layers(model.layers, chunks)
    if len(counts) != chunks or sum(counts) != model.layers:
        raise ValueError(f"stage_layers {counts} must give {chunks} virtual stages {model.layers} layers in all.")
    extra = practice.extra_ops_per_microbatch * gpu.kernel_overhead_s * contention if gpu.overhead_serial else 0.0
    fwd, bwd, parts = [], [], []
    starts = [sum(counts[:vs]) for vs in range(chunks)]
    for vs, n in enumerate(counts):
        dense = max(0, min(n, dense_layers - starts[vs]))  # the model's first layers are its dense ones
        f = _add({k: dense * x for k, x in piece.forward.items()},
                 {k: (n - dense) * x for k, x in expert_piece.forward.items()})
        bk = _add({k: dense * x for k, x in piece.backward.items()},
                  {k: (n - dense) * x for k, x in expert_piece.backward.items()})
        if vs == chunks - 1:
            f, bk = _add(f, head.forward), _add(bk, head.backward)
        if vs == 0:
            f["kernel overhead"] = f.get("kernel overhead", 0.0) + extra
        if pp > 1 and practice.message_end_cpu_s:  # a stage receives its input and sends its output, each way
            ends = (vs > 0) + (vs < chunks - 1)
            f["kernel overhead"] = f.get("kernel overhead", 0.0) + ends * practice.message_end_cpu_s * contention
            bk["kernel overhead"] = bk.get("kernel overhead", 0.0) + ends * practice.message_end_cpu_s * contention
        fwd.append(sum(f.values()))
        bwd.append(sum(bk.values()))
        parts.append((f, bk))
    # the pipeline: chapter 13's schedule tables, simulated with each virtual stage's own times
    schedule = layout.schedule if pp > 1 else "1f1b"
    message = 0.0
    if pp > 1:
        msg = layout.micro_batch * layout.seq / cp * model.hidden * practice.activation_bytes / tp
        message = group_time("send_recv", msg, 2, tp * cp * (dp if practice.pp_outermost else 1), cluster)
    flat = pipeline_makespan(schedule, pp, m, v, fwd, bwd, 0.0, practice.w_share)
    timed = pipeline_makespan(schedule, pp, m, v, fwd, bwd, message, practice.w_share) if message else flat
    busy = [m * sum(fwd[vs] + bwd[vs] for vs in held_stages(schedule, r, pp, v)) for r in range(pp)]
    critical = max(range(pp), key=lambda r: busy[r])
    terms = dict.fromkeys(TERMS, 0.0)
    for r_vs in held_stages(schedule, critical, pp, v):  # the virtual stages the critical rank holds
        f, bk = parts[r_vs]
        for k, x in _add(f, bk).items():
            terms[k] += m * x
    terms["bubble"] = max(0.0, flat - busy[critical])  # (a line through two simulations can dip a hair below)
    if practice.dualpipe and pp > 1:
        # DeepSeek-V3 report, Table 2: DualPipe's bubble is (PP/2 - 1)(F&B + B - 3W) for chunks of F, B and W (the
        # weight-gradient part of B); with W = B/2 (dW is half of a backward's GEMMs) and F&B, a forward and a
        # backward chunk overlapped, taken as F + B: (PP/2 - 1)(F + B/2) per stage's micro-batch. Chapter 13 runs
        # DualPipeV, DualPipe cut in half into a V on the same ranks (schedule "dualpipev", simulated from its table
        # like the others); DeepSeek-V3's bidirectional DualPipe, two copies of the stages, is priced by its formula
        f_stage, b_stage = max(fwd), max(bwd)
        terms["bubble"] = max(0.0, (pp / 2 - 1) * (f_stage + b_stage / 2))
    terms["pp"] = max(0.0, timed - flat)
    # data parallelism and ZeRO, over DP x CP, for the first stage's rank (it finishes its backward last)
    group = dp * cp
    zero = layout.zero
    grad_bytes = practice.grad_bytes or (2.0 if practice.dtype == "fp16" else 4.0)
    weight_bytes = practice.activation_bytes
    first_layers = sum(counts[vs] for vs in held_stages(layout.schedule, 0, pp, v))
    params = stage_params(model, first_layers, tp, True, pp == 1, pp)
    if moe is not None:  # attention and shared parts split by TP, routed experts by EP (what one rank holds)
        from .moe_counts import _attention_params

        h = model.hidden
        expert = _attention_params(moe) / tp + 3 * h * (moe.shared_experts * moe.expert_ffn / tp
                                                         + moe.experts / layout.ep * moe.expert_ffn)
        dense_layer = _attention_params(moe) / tp + 3 * h * model.ffn / tp
        layers_here = [i for vs in held_stages(layout.schedule, 0, pp, v)
                       for i in range(starts[vs], starts[vs] + counts[vs])]
        params = sum(dense_layer if i < dense_layers else expert for i in layers_here) \
            + model.vocab * h / tp * ((1 if pp == 1 else 0) + 1)
    stride = tp * cp * (1 if practice.pp_outermost else pp) if dp > 1 else tp
    last_b = bwd[0]  # the first stage's last action: the backward of its first chunk
    first_f = fwd[0]
    dp_exposed = dp_hidden = 0.0
    if group > 1:
        grads, weights = grad_bytes * params, weight_bytes * params
        bucket = min(1.0, practice.bucket_bytes / max(grads, 1.0))
        if zero == 0:
            traffic = group_time("all_reduce", grads, group, stride, cluster)
            window = last_b if practice.grad_overlap else 0.0
            dp_exposed = exposed(traffic, window, traffic * bucket)
            dp_hidden = traffic - dp_exposed
        elif zero in (1, 2):
            rs = group_time("reduce_scatter", grads, group, stride, cluster)
            ag = group_time("all_gather", weights, group, stride, cluster)
            if zero == 1:
                window = last_b if practice.grad_overlap else 0.0
                rs_exposed = exposed(rs, window, rs * bucket)
            else:
                window = m * sum(bwd[vs] for vs in held_stages(layout.schedule, 0, pp, v)) if practice.grad_overlap else 0.0
                rs_exposed = exposed(m * rs, window, rs * bucket)
                rs = m * rs
            ag_exposed = exposed(ag, first_f if practice.param_gather_overlap else 0.0, ag * bucket)
            dp_exposed = rs_exposed + ag_exposed
            dp_hidden = rs + ag - dp_exposed
        else:  # ZeRO-3: every layer gathered before its forward and its backward, its gradients reduce-scattered
            per_layer = params / max(first_layers, 1)
            ag = group_time("all_gather", weight_bytes * per_layer, group, stride, cluster)
            rs = group_time("reduce_scatter", grad_bytes * per_layer, group, stride, cluster)
            lf, lb = sum(piece.forward.values()), sum(piece.backward.values())
            per_micro = first_layers * (max(0.0, ag - lf) + max(0.0, ag + rs - lb)) + ag
            dp_exposed = m * per_micro
            dp_hidden = m * first_layers * (2 * ag + rs) - dp_exposed
    terms["dp"] = dp_exposed
    hidden["dp"] = max(dp_hidden, 0.0)
    held = params / (group if zero >= 1 else 1)
    terms["optimizer"] = ADAMW_BYTES_PER_PARAM * held / (gpu.memory_bandwidth * gpu.stream_efficiency) * contention
    model_flops = model_flops_per_token(model, layout.seq, moe) * dp * m * layout.micro_batch * layout.seq
    return StepTime(terms=terms, hidden=hidden, stage_busy=tuple(busy), model_flops=model_flops, n_gpus=n_gpus,
                    peak_flops=gpu.peak_flops, notes=tuple(notes))
