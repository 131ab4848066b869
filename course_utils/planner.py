"""The overview planner: does a parallel layout fit, and where does a training step's time go.

``plan(model, layout, n_gpus)`` answers chapter 00's three questions for one layout:

- memory per GPU by state (parameters, gradients, optimizer states, activations) against the
  GPU's memory, for the most loaded GPU (the first pipeline stage, Korthikanti et al. 2022, 4.2.3);
- compute time per step (hardware FLOPs at an assumed fraction of peak) and the pipeline bubble;
- communication time per step for each parallelism (TP, CP, PP, DP), from the alpha-beta model
  over the network tier each group actually spans (groups are laid out [TP, CP, PP, DP] from the
  innermost, as in Llama 3, Figure 5).

Every formula is in ``course_utils.ledger`` with its citation; this module only does the
bookkeeping. A layout that cannot run (degrees whose product is not the GPU count, heads that do not
split over TP, ...) raises ``LayoutError`` with one sentence saying what to change.

Modelling choices, stated once: the activation count is Korthikanti's GPT block (dropout masks,
4h GeLU MLP, multi-head attention), used as an approximation for Llama-style blocks (no dropout,
SwiGLU, grouped-query attention); communication is not overlapped with compute (an upper bound: DP
and CP traffic usually overlap well in practice); framework overheads (CUDA context, allocator
fragmentation, temporary buffers) are not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from .ledger import (
    GB,
    GiB,
    RECOMPUTE_MODES,
    ZERO_STAGES,
    activation_bytes_per_layer,
    bus_bandwidth_factor,
    collective_time,
    flops_per_token,
    model_state_bytes,
    pipeline_bubble_fraction,
    tp_comm_bytes_per_layer,
)


class LayoutError(ValueError):
    """A parallel layout that cannot run; the message says what to change."""


# ----------------------------------------------------------------------------------------------
# Model shapes
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer, enough of it to count parameters, FLOPs and bytes."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    mlp: str = "swiglu"  # "swiglu": 3 matrices h x ffn (Llama); "gelu": 2 matrices (GPT)
    tied_embeddings: bool = False
    source: str = ""

    def __post_init__(self) -> None:
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise LayoutError(
                f"{self.name}: hidden ({self.hidden}) must be a multiple of heads ({self.heads}) and heads "
                f"a multiple of kv_heads ({self.kv_heads}); fix the shape."
            )
        if self.mlp not in ("swiglu", "gelu"):
            raise LayoutError(f"{self.name}: mlp must be 'swiglu' or 'gelu', got {self.mlp!r}.")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def params_per_layer(self) -> int:
        h = self.hidden
        attention = 2 * h * h + 2 * h * self.kv_dim  # W_q and W_o, plus W_k and W_v (GQA: kv_dim wide)
        mlp = (3 if self.mlp == "swiglu" else 2) * h * self.ffn
        return attention + mlp + 2 * h  # two norms

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def n_params(self) -> int:
        return self.layers * self.params_per_layer + self.embedding_params + self.hidden  # + final norm


MODEL_SHAPES: dict[str, ModelShape] = {
    # Touvron et al. 2023, "Llama 2": Table 1 (7B has no GQA), sec 2.2 "Tokenizer" (32k vocabulary);
    # shape from the Llama 1 paper's Table 2 (dimension 4096, 32 heads, 32 layers); ffn 11008 is the
    # released params.json / HF config. n_params = 6.74e9.
    "llama-2-7b": ModelShape("Llama 2 7B", layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008,
                             vocab=32_000, source="Touvron et al. 2023 (Llama 1 Table 2, Llama 2 Table 1)"),
    # Llama Team 2024, "The Llama 3 Herd of Models", Table 3; vocabulary 128,256 is the released
    # tokenizer (the paper rounds to "128K": 128,000 + 256 special tokens). n_params = 8.03e9.
    "llama-3-8b": ModelShape("Llama 3 8B", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336,
                             vocab=128_256, source="Llama 3 paper, Table 3"),
    # Same Table 3. n_params = 70.6e9.
    "llama-3-70b": ModelShape("Llama 3 70B", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672,
                              vocab=128_256, source="Llama 3 paper, Table 3"),
    # Same Table 3 (126 layers, model dimension 16,384, FFN 53,248, 128 heads, 8 KV heads). n_params = 405.9e9.
    "llama-3.1-405b": ModelShape("Llama 3.1 405B", layers=126, hidden=16384, heads=128, kv_heads=8,
                                 ffn=53248, vocab=128_256, source="Llama 3 paper, Table 3"),
    # Brown et al. 2020, Table 2.1 (96 layers, d_model 12288, 96 heads, ffn = 4 d_model); vocabulary
    # padded to 51,200 as in Narayanan et al. 2021 (sec 5.1) and Korthikanti et al. 2022 (sec 6),
    # embeddings tied (Korthikanti sec 3). n_params = 174.6e9 (GPT-3 Table D.1: 174,600M).
    "gpt-3-175b": ModelShape("GPT-3 175B", layers=96, hidden=12288, heads=96, kv_heads=96, ffn=49152,
                             vocab=51_200, mlp="gelu", tied_embeddings=True,
                             source="Brown et al. 2020, Table 2.1"),
}
_MODEL_ALIASES = {"7b": "llama-2-7b", "8b": "llama-3-8b", "70b": "llama-3-70b", "405b": "llama-3.1-405b",
                  "175b": "gpt-3-175b"}


def model_shape(name: str | ModelShape) -> ModelShape:
    """Look up a model by key (``"llama-3-70b"``) or size alias (``"70B"``)."""
    if isinstance(name, ModelShape):
        return name
    key = str(name).lower()
    key = _MODEL_ALIASES.get(key, key)
    if key not in MODEL_SHAPES:
        raise LayoutError(f"unknown model {name!r}; use one of {', '.join(MODEL_SHAPES)} or a ModelShape.")
    return MODEL_SHAPES[key]


# ----------------------------------------------------------------------------------------------
# Hardware: GPUs, network tiers, clusters
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: float
    peak_flops: float  # dense BF16 tensor-core FLOP/s
    source: str


@dataclass(frozen=True)
class Link:
    """One network tier as the alpha-beta model sees it."""

    name: str
    bandwidth: float  # bytes/s per GPU, one direction: what nccl-tests' busbw approaches
    latency: float  # seconds per ring step (alpha)
    source: str


GPUS: dict[str, GPU] = {
    # NVIDIA H100 datasheet (SXM5): BF16 tensor core 1,979 TFLOPS "with sparsity", so 989.5e12 dense;
    # 80 GB HBM3. The planner counts 80 GiB (85.9e9 bytes); nvidia-smi reports slightly less,
    # H100_80GB_NVIDIA_SMI_BYTES below (0.4% less), so fits within ~0.3 GB are optimistic.
    "h100": GPU("H100 SXM 80GB", 80 * GiB, 989.5e12, "NVIDIA H100 datasheet"),
    # NVIDIA H200 datasheet: 141 GB HBM3e, same BF16 tensor-core peak as H100 SXM.
    "h200": GPU("H200 SXM 141GB", 141 * GB, 989.5e12, "NVIDIA H200 datasheet"),
    # NVIDIA A100 datasheet: 312 TFLOPS BF16 dense (Narayanan et al. 2021, sec 5: "312 teraFLOP/s").
    "a100": GPU("A100 SXM 80GB", 80 * GiB, 312e12, "NVIDIA A100 datasheet"),
}

# What nvidia-smi / NVML report for an "NVIDIA H100 80GB HBM3": 81,559 MiB = 79.65 GiB = 85.52e9 bytes
# (Modal's table of NVML capacities, thundergolfer.com/blog/nvidia-gpu-memory-capacity; the same total
# appears in published nvidia-smi outputs). Pass it as ``gpu_memory_bytes`` to see how tight a fit is.
H100_80GB_NVIDIA_SMI_BYTES = 81_559 * 2**20

NETWORK_TIERS: dict[str, Link] = {
    # 900 GB/s total NVLink bandwidth per GPU (18 links; NVIDIA H100/H200 datasheets) = 450 GB/s each
    # way. Measured all_reduce busbw on 8x H200 (shared/reference/allreduce_8xH200_published.csv,
    # from stas00/ml-engineering): 367.6 GB/s with NVLS/SHARP off, up to 482 GB/s with NVLS.
    # alpha: NCCL's own cost model (src/graph/tuning.cc, 2020 version), hwLat[NVLink][Ring][Simple] = 3.4 us.
    "nvlink4": Link("NVLink 4 + NVSwitch (H100/H200)", 450e9, 3.4e-6,
                    "H100 datasheet 900 GB/s bidirectional; NCCL tuning.cc hwLat"),
    # A100 datasheet: 600 GB/s NVLink per GPU (12 links), 300 GB/s each way; alpha as above.
    "nvlink3": Link("NVLink 3 + NVSwitch (A100)", 300e9, 3.4e-6,
                    "A100 datasheet 600 GB/s bidirectional; NCCL tuning.cc hwLat"),
    # PCIe 4.0 x16: 16 GT/s x 16 lanes x 128/130 encoding / 8 = 31.5e9 B/s each way (PCI-SIG 4.0
    # spec rates); alpha: NCCL tuning.cc hwLat[PCI][Ring][Simple] = 5.7 us.
    "pcie4": Link("PCIe 4.0 x16", 31.5e9, 5.7e-6, "PCI-SIG PCIe 4.0 rates; NCCL tuning.cc hwLat"),
    # One 400 Gb/s NDR ConnectX-7 per GPU (DGX H100: 8 per node) = 50e9 B/s each way;
    # alpha: NCCL tuning.cc hwLat[NET][Ring][Simple] = 9.6 us.
    "ib-ndr400": Link("InfiniBand NDR 400 Gb/s per GPU", 50e9, 9.6e-6,
                      "400 Gb/s per GPU (DGX H100); NCCL tuning.cc hwLat"),
    # Selene: "eight NVIDIA Mellanox 200Gbps HDR Infiniband HCAs" per 8-GPU node (Narayanan et al.
    # 2021, sec 5; Korthikanti et al. 2022, sec 6) = 25e9 B/s per GPU each way.
    "ib-hdr200": Link("InfiniBand HDR 200 Gb/s per GPU", 25e9, 9.6e-6,
                      "Narayanan et al. 2021 sec 5; NCCL tuning.cc hwLat"),
    # Llama 3, sec 3.3.1: RoCE and InfiniBand clusters "leverage 400 Gbps interconnects between GPUs".
    "roce400": Link("RoCE 400 Gb/s per GPU", 50e9, 9.6e-6, "Llama 3 paper sec 3.3.1; NCCL tuning.cc hwLat"),
    # 100 Gb/s Ethernet (IEEE 802.3) = 12.5e9 B/s; alpha is NCCL's network floor, TCP sockets are slower.
    "ethernet100": Link("Ethernet 100 Gb/s", 12.5e9, 9.6e-6, "IEEE 802.3 100GbE; NCCL tuning.cc hwLat"),
}


@dataclass(frozen=True)
class Cluster:
    name: str
    gpu: GPU
    gpus_per_node: int
    intra_node: Link
    inter_node: Link


CLUSTERS: dict[str, Cluster] = {
    # DGX H100: 8 GPUs on NVSwitch, one 400 Gb/s NIC per GPU (NVIDIA DGX H100 datasheet).
    "h100-ib": Cluster("8x H100 per node, NVLink 4, InfiniBand NDR 400", GPUS["h100"], 8,
                       NETWORK_TIERS["nvlink4"], NETWORK_TIERS["ib-ndr400"]),
    "h200-ib": Cluster("8x H200 per node, NVLink 4, InfiniBand NDR 400", GPUS["h200"], 8,
                       NETWORK_TIERS["nvlink4"], NETWORK_TIERS["ib-ndr400"]),
    # Llama 3 405B: 8 GPUs per Grand Teton server on NVLink, RoCE 400 Gb/s between GPUs (sec 3.3.1).
    "h100-roce": Cluster("8x H100 per node, NVLink 4, RoCE 400 (Llama 3)", GPUS["h100"], 8,
                         NETWORK_TIERS["nvlink4"], NETWORK_TIERS["roce400"]),
    # Selene (Narayanan et al. 2021 sec 5, Korthikanti et al. 2022 sec 6): DGX A100 80GB, HDR 200.
    "a100-ib": Cluster("8x A100 per node, NVLink 3, InfiniBand HDR 200 (Selene)", GPUS["a100"], 8,
                       NETWORK_TIERS["nvlink3"], NETWORK_TIERS["ib-hdr200"]),
}


def cluster(name: str | Cluster) -> Cluster:
    if isinstance(name, Cluster):
        return name
    if name not in CLUSTERS:
        raise LayoutError(f"unknown cluster {name!r}; use one of {', '.join(CLUSTERS)} or a Cluster.")
    return CLUSTERS[name]


# ----------------------------------------------------------------------------------------------
# Layout and plan
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """How a training step is split: the 4D degrees, ZeRO stage, batch shape and recomputation."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int | None = None  # None: whatever the GPUs leave, n_gpus / (tp * cp * pp)
    zero_stage: int = 0
    micro_batch: int = 1  # sequences per micro-batch
    seq: int = 4096  # tokens per sequence
    num_microbatches: int | None = None  # per DP replica per step; None: 4 * pp (or 1 without PP),
    # or global_batch / (dp * micro_batch) when plan() is given a global_batch
    recompute: str = "selective"  # "none", "selective" (what FlashAttention effectively does), "full"
    sequence_parallel: bool = True  # Megatron sequence parallelism, used when tp > 1
    virtual_stages: int = 1  # interleaved 1F1B chunks per GPU


@dataclass(frozen=True)
class Plan:
    """What ``plan`` found for one layout. Bytes, seconds and FLOPs throughout."""

    model: ModelShape
    layout: Layout  # with dp and num_microbatches filled in
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
        """Compute + bubble + all communication, nothing overlapped (an upper bound)."""
        return self.compute_time_s + self.bubble_time_s + self.comm_total_s

    @property
    def mfu(self) -> float:
        """Model FLOPs utilization this step time implies (PaLM Appendix B definition)."""
        return self.model_flops_per_step / (self.step_time_s * self.n_gpus * self.cluster.gpu.peak_flops)

    def summary(self) -> str:
        lay = self.layout
        lines = [
            f"{self.model.name} on {self.n_gpus} GPUs ({self.cluster.name})",
            f"  layout  tp={lay.tp} cp={lay.cp} pp={lay.pp} dp={lay.dp} zero={lay.zero_stage} "
            f"micro_batch={lay.micro_batch} seq={lay.seq} m={lay.num_microbatches} recompute={lay.recompute}",
            "  memory per GPU (GB = 1e9 bytes)",
        ]
        lines += [f"    {k:<12}{v / GB:9.2f}" for k, v in self.memory.items()]
        verdict = (f"fits, {self.headroom_bytes / GB:.2f} GB to spare" if self.fits
                   else f"does NOT fit, {-self.headroom_bytes / GB:.2f} GB over")
        lines.append(f"    {'total':<12}{self.total_memory_bytes / GB:9.2f}  of {self.gpu_memory_bytes / GB:.1f} "
                     f"({self.gpu_memory_bytes / GiB:.1f} GiB): {verdict}")
        lines.append("  time per step (s)")
        lines.append(f"    {'compute':<12}{self.compute_time_s:9.3f}")
        lines.append(f"    {'bubble':<12}{self.bubble_time_s:9.3f}")
        lines += [f"    {'comm ' + k:<12}{v:9.3f}  over {self.links[k]}" for k, v in self.comm_time_s.items()]
        lines.append(f"    {'step':<12}{self.step_time_s:9.3f}  ({self.sequences_per_step} sequences, "
                     f"{self.tokens_per_second:,.0f} tokens/s, MFU {100 * self.mfu:.1f}%, no overlap)")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _check_degree(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LayoutError(f"{name} must be a whole number of at least 1, got {value!r}; set it to 1 or more.")
    return value


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def resolve_layout(model: ModelShape, layout: Layout, n_gpus: int, *, global_batch: int | None = None) -> Layout:
    """Check ``layout`` against the model and GPU count; return it with dp and m filled in.

    With ``global_batch`` (sequences per optimizer step), m = global_batch / (dp * micro_batch), so that
    layouts with different dp train on the same batch and their step times can be compared.
    """
    _check_degree("n_gpus", n_gpus)
    for name in ("tp", "pp", "cp", "micro_batch", "seq", "virtual_stages"):
        _check_degree(name, getattr(layout, name))
    tp, pp, cp, v = layout.tp, layout.pp, layout.cp, layout.virtual_stages
    model_parallel = tp * cp * pp
    if layout.dp is None:
        if n_gpus % model_parallel:
            raise LayoutError(
                f"{n_gpus} GPUs do not split into groups of tp*cp*pp = {tp}*{cp}*{pp} = {model_parallel}; "
                f"choose tp, cp and pp whose product divides {n_gpus}."
            )
        dp = n_gpus // model_parallel
    else:
        dp = _check_degree("dp", layout.dp)
        if model_parallel * dp != n_gpus:
            raise LayoutError(
                f"tp*cp*pp*dp = {tp}*{cp}*{pp}*{dp} = {model_parallel * dp} but there are {n_gpus} GPUs; "
                f"change the degrees so that their product is {n_gpus} (or leave dp=None to fill it in)."
            )
    if model.heads % tp:
        raise LayoutError(
            f"tp={tp} does not divide the {model.heads} attention heads of {model.name}; "
            f"use a tp from {_divisors(model.heads)}."
        )
    if model.kv_heads % tp:
        raise LayoutError(
            f"tp={tp} does not divide the {model.kv_heads} key/value heads of {model.name}, so a GPU "
            f"would hold a fraction of a KV head; use a tp from {_divisors(model.kv_heads)}."
        )
    if pp > model.layers:
        raise LayoutError(f"pp={pp} is more than the {model.layers} layers of {model.name}; use pp <= {model.layers}.")
    if layout.seq % cp:
        raise LayoutError(f"seq={layout.seq} does not split into cp={cp} equal chunks; choose a cp that divides it.")
    if layout.sequence_parallel and tp > 1 and (layout.seq // cp) % tp:
        raise LayoutError(
            f"sequence parallelism gives each of the tp={tp} ranks seq/(cp*tp) = {layout.seq}/{cp * tp} tokens, "
            f"which is not whole; pick seq divisible by cp*tp or set sequence_parallel=False."
        )
    if layout.zero_stage not in ZERO_STAGES:
        raise LayoutError(
            f"zero_stage={layout.zero_stage!r} is not a ZeRO stage (Rajbhandari et al. 2020, sec 5); use 0, 1, 2 or 3."
        )
    if layout.recompute not in RECOMPUTE_MODES:
        raise LayoutError(
            f"recompute={layout.recompute!r} is not a recompute mode (Korthikanti et al. 2022, Table 2); "
            f"use 'none', 'selective' or 'full'."
        )
    m = layout.num_microbatches
    if global_batch is not None:
        _check_degree("global_batch", global_batch)
        per_step = dp * layout.micro_batch
        if global_batch % per_step:
            raise LayoutError(
                f"global_batch={global_batch} sequences do not split into dp*micro_batch = {dp}*{layout.micro_batch} "
                f"= {per_step} equal shares; choose a global batch that is a multiple of {per_step}."
            )
        if m is not None and m * per_step != global_batch:
            raise LayoutError(
                f"num_microbatches={m} gives {m * per_step} sequences per step, not global_batch={global_batch}; "
                f"set only one of the two."
            )
        m = global_batch // per_step
    if m is None:
        m = 4 * pp if pp > 1 else 1  # GPipe (Huang et al. 2019, sec 2.3): bubble negligible for m >= 4p
    _check_degree("num_microbatches", m)
    if v > 1:
        if pp == 1:
            raise LayoutError(f"virtual_stages={v} interleaves pipeline stages, so it needs pp > 1; set pp or use 1.")
        if m % pp:
            raise LayoutError(
                f"the interleaved schedule needs the micro-batches per step ({m}) to be a multiple of pp={pp} "
                f"(Narayanan et al. 2021, sec 2.2.2); change num_microbatches."
            )
        if model.layers % (pp * v):
            raise LayoutError(
                f"{model.layers} layers do not split into pp*virtual_stages = {pp}*{v} equal chunks; "
                f"change pp or virtual_stages."
            )
    return replace(layout, dp=dp, num_microbatches=m)


def zero_collectives_per_step(zero_stage: int, num_microbatches: int = 1) -> dict[str, int]:
    """How often data parallelism runs each collective in one optimizer step of m micro-batches.

    Each count is one pass over the model slice a GPU holds (2 bytes per parameter); a real run splits a
    pass into buckets (DDP, ZeRO-1/2) or layers (ZeRO-3) with the same total bytes. Gradients are reduced
    once per step when a GPU keeps a full-size gradient anyway, and after every micro-batch's backward when
    it keeps only its shard:

    - stage 0 (DDP) and stage 1: gradients accumulate locally in full over the m micro-batches
      (``DistributedDataParallel.no_sync()``; Megatron's main_grad buffer; DeepSpeed ZeRO-1 reduces only at
      the accumulation boundary), then one all-reduce (stage 0) or one reduce-scatter (stage 1); stage 1
      all-gathers the updated weights once after the step.
    - stage 2: a GPU stores only its gradient shard, so it reduce-scatters after each micro-batch
      (DeepSpeed's stage_1_and_2.py reduces every micro-step when gradients are partitioned); one
      all-gather of the weights after the step.
    - stage 3 (FSDP): all-gather the weights before each micro-batch's forward and again before its
      backward, reduce-scatter the gradients after its backward: 2m + m. This is FSDP's default with
      gradient accumulation; FSDP's ``no_sync()`` (FSDP2: ``set_requires_gradient_sync(False)``) would
      reduce-scatter once per step but keep unsharded gradients, 2 bytes per parameter more per GPU than
      the ledger's stage 3 counts (pytorch/pytorch PR #126166 describes both flavours).

    Rajbhandari et al. 2020, section 7: with m = 1, stages 0-2 move 2 Psi per step and stage 3 moves 3 Psi.
    """
    if zero_stage not in ZERO_STAGES:
        raise LayoutError(
            f"zero_stage={zero_stage!r} is not a ZeRO stage (Rajbhandari et al. 2020, sec 5); use 0, 1, 2 or 3."
        )
    m = _check_degree("num_microbatches", num_microbatches)
    if zero_stage == 0:
        return {"all_reduce": 1, "reduce_scatter": 0, "all_gather": 0}
    reduce_scatters = 1 if zero_stage == 1 else m
    all_gathers = 2 * m if zero_stage == 3 else 1
    return {"all_reduce": 0, "reduce_scatter": reduce_scatters, "all_gather": all_gathers}


def _link(cl: Cluster, stride: int, size: int) -> Link:
    """Tier a group of ``size`` ranks, ``stride`` apart, crosses: NVLink if it fits in one node."""
    return cl.intra_node if stride * size <= cl.gpus_per_node else cl.inter_node


@dataclass(frozen=True)
class Collective:
    """One kind of collective a GPU runs in a training step: ``count`` calls on ``message_bytes`` over ``ranks``."""

    collective: str
    message_bytes: float
    ranks: int
    count: float

    @property
    def wire_bytes(self) -> float:
        """Bytes one GPU sends for all ``count`` calls, by the ring algorithms nccl-tests assumes."""
        return self.count * bus_bandwidth_factor(self.collective, self.ranks) * self.message_bytes


def step_collectives(model: ModelShape, layout: Layout, *, weight_bytes: float = 2, grad_bytes: float = 2,
                     bytes_per_element: float = 2) -> dict[str, list[Collective]]:
    """The collectives one GPU of the first pipeline stage runs in one optimizer step, per parallel dimension.

    ``layout`` must be resolved (``resolve_layout``: dp and m filled in). This is the whole communication model
    of ``plan``, which times each of these calls with the alpha-beta model of the link its group spans; chapter
    15 holds it to the bytes a composed run measures. Activations are ``bytes_per_element`` wide (bf16: 2).

    - tp: 4 all-reduces of ``b s/cp h`` per layer and micro-batch (Shoeybi et al. 2019, sec 3; with sequence
      parallelism the same bytes as all-gathers and reduce-scatters, Korthikanti et al. 2022, sec 4.2.2), 6 with
      full recomputation;
    - cp: per layer and micro-batch, K and V of the whole sequence all-gathered forward (again when recomputing)
      and their gradients reduce-scattered backward (Llama 3, sec 3.3.2);
    - pp: one activation forward and one gradient backward per micro-batch and chunk, 1/tp of ``b s/cp h`` each
      (the scatter-gather optimisation, Narayanan et al. 2021, sec 4.1);
    - dp: the stage's gradients (``grad_bytes`` per parameter, 1/tp of them) reduced over DP x CP and, from
      ZeRO-1 on, its weights all-gathered, as often as ``zero_collectives_per_step`` says (ZeRO, sec 7).
    """
    tp, pp, cp, dp, v = layout.tp, layout.pp, layout.cp, layout.dp, layout.virtual_stages
    b, seq, m = layout.micro_batch, layout.seq, layout.num_microbatches
    if dp is None or m is None:
        raise LayoutError("step_collectives needs a resolved layout (dp and num_microbatches filled in): "
                          "pass it through resolve_layout first.")
    s_local = seq // cp
    layers_per_stage = math.ceil(model.layers / pp)
    stage_params = model.n_params if pp == 1 else layers_per_stage * model.params_per_layer + model.vocab * model.hidden
    out: dict[str, list[Collective]] = {"tp": [], "cp": [], "pp": [], "dp": []}
    if tp > 1:
        tpb = tp_comm_bytes_per_layer(b, s_local, model.hidden, tp, bytes_per_element=bytes_per_element,
                                      full_recompute=layout.recompute == "full")
        out["tp"].append(Collective("all_reduce", tpb.message_bytes, tp, tpb.all_reduces * layers_per_stage * m))
    if cp > 1:
        kv_bytes = 2.0 * b * seq * model.kv_dim / tp * bytes_per_element  # K and V of the whole sequence
        gathers = 2 if layout.recompute == "full" else 1
        out["cp"] += [Collective("all_gather", kv_bytes, cp, gathers * layers_per_stage * m),
                      Collective("reduce_scatter", kv_bytes, cp, layers_per_stage * m)]
    if pp > 1:
        message = b * s_local * model.hidden * bytes_per_element / tp
        out["pp"].append(Collective("send_recv", message, 2, 2 * m * v))
    group = dp * cp
    if group > 1:
        counts = zero_collectives_per_step(layout.zero_stage, m)
        grads, weights = grad_bytes * stage_params / tp, weight_bytes * stage_params / tp
        for name, nbytes in (("all_reduce", grads), ("reduce_scatter", grads), ("all_gather", weights)):
            if counts[name]:
                out["dp"].append(Collective(name, nbytes, group, counts[name]))
    return out


def plan(
    model: str | ModelShape,
    layout: Layout,
    n_gpus: int,
    *,
    cluster_name: str | Cluster = "h100-ib",
    inter_node: str | Link | None = None,
    gpu_memory_bytes: float | None = None,
    compute_efficiency: float = 0.6,
    weight_bytes: float = 2,
    grad_bytes: float = 2,
    optimizer_bytes_per_param: float = 12,
    global_batch: int | None = None,
) -> Plan:
    """Memory per GPU, compute and communication time per step, and whether ``layout`` fits.

    ``cluster_name`` picks GPU, node size and both network tiers from ``CLUSTERS``;
    ``inter_node`` swaps the between-node tier (a ``NETWORK_TIERS`` key such as "ethernet100");
    ``gpu_memory_bytes`` overrides the GPU's memory. ``compute_efficiency`` is the fraction of peak
    the matmuls reach before any communication or bubble; 0.6 is about what one H200 gave for a
    whole bf16 transformer block (605-638 TFLOP/s, data/reference/h200_block_fp8_baseline.json,
    against a 989 TFLOP/s peak). Hardware FLOPs add, per token, 4 L H Q T for selective
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
    if not 0 < compute_efficiency <= 1:
        raise LayoutError(f"compute_efficiency is a fraction of peak in (0, 1], got {compute_efficiency!r}.")
    memory_limit = cl.gpu.memory_bytes if gpu_memory_bytes is None else gpu_memory_bytes
    tp, pp, cp, dp, v = layout.tp, layout.pp, layout.cp, layout.dp, layout.virtual_stages
    b, seq, m = layout.micro_batch, layout.seq, layout.num_microbatches
    s_local = seq // cp
    sp = layout.sequence_parallel and tp > 1
    notes: list[str] = []

    # --- memory of the first pipeline stage (it holds the most activations) ---------------------
    layers_per_stage = math.ceil(model.layers / pp)
    if model.layers % pp:
        notes.append(f"{model.layers} layers do not divide by pp={pp}; the fullest stage has {layers_per_stage}.")
    if pp == 1:
        stage_params = model.n_params
    else:  # first stage: its layers and the input embedding (Megatron keeps a copy even when tied)
        stage_params = layers_per_stage * model.params_per_layer + model.vocab * model.hidden
    states = model_state_bytes(
        stage_params, dp=dp * cp, tp=tp, pp=1, zero_stage=layout.zero_stage, weight_bytes=weight_bytes,
        grad_bytes=grad_bytes, optimizer_bytes_per_param=optimizer_bytes_per_param,
    )
    params = states.params
    if layout.zero_stage == 3:  # one layer gathered at a time (FSDP may prefetch a second)
        params += weight_bytes * model.params_per_layer / tp
        notes.append("ZeRO-3: parameters include one all-gathered layer.")
    def layer_activations(recompute: str) -> float:
        act = activation_bytes_per_layer(s_local, b, model.hidden, model.heads, tp=tp, sequence_parallel=sp,
                                         recompute=recompute)
        if recompute == "none" and cp > 1:  # local queries attend to all seq keys: 5 a b (s/cp) s / t
            act += 5 * model.heads * b * s_local * (seq - s_local) / tp
        return act

    per_layer = layer_activations(layout.recompute)
    in_flight = min(pp, m)  # 1F1B: the first stage holds p micro-batches (Korthikanti 4.2.3)
    interleave = 1 + (pp - 1) / (pp * v) if v > 1 else 1.0  # Korthikanti 4.2.3
    activations = per_layer * layers_per_stage * in_flight * interleave
    if layout.recompute == "full":  # the layer being recomputed holds its full set again
        activations += layer_activations("none")
    if pp == 1:  # final norm, output projection input and fp32 logits (Korthikanti 4.3)
        activations += 4 * s_local * b * model.hidden / tp * (1 + model.vocab / model.hidden)
    memory = {"params": params, "grads": states.grads, "optimizer": states.optimizer, "activations": activations}

    # --- compute -------------------------------------------------------------------------------
    tokens_per_step = dp * m * b * seq
    model_fpt = flops_per_token(model.n_params, model.layers, model.heads, model.head_dim, seq)
    attention_fwd = 4.0 * model.layers * model.heads * model.head_dim * seq  # QK^T and AV, per token
    extra = {"none": 0.0, "selective": attention_fwd, "full": 2.0 * model.n_params + attention_fwd}[layout.recompute]
    model_flops = model_fpt * tokens_per_step
    hardware_flops = (model_fpt + extra) * tokens_per_step
    peak = cl.gpu.peak_flops
    compute_time = hardware_flops / (n_gpus * peak * compute_efficiency)
    bubble_time = compute_time * pipeline_bubble_fraction(pp, m, v)

    # --- communication, groups ordered [TP, CP, PP, DP] (Llama 3, Figure 5) ---------------------
    tp_link, cp_link = _link(cl, 1, tp), _link(cl, tp, cp)
    pp_link, dp_link = _link(cl, tp * cp, pp), _link(cl, tp * cp * pp, dp)
    grad_link = dp_link if dp > 1 else cp_link  # gradients are reduced over DP x CP
    if cp > 1 and dp > 1 and cl.inter_node in (cp_link, dp_link):
        grad_link = cl.inter_node
    if tp > cl.gpus_per_node:
        notes.append(f"tp={tp} spans more than one {cl.gpus_per_node}-GPU node: TP traffic leaves NVLink.")
    link_of = {"tp": tp_link, "cp": cp_link, "pp": pp_link, "dp": grad_link}
    comm = {dim: sum(c.count * collective_time(c.collective, c.message_bytes, c.ranks, link_of[dim].bandwidth,
                                               link_of[dim].latency) for c in calls)
            for dim, calls in step_collectives(model, layout, weight_bytes=weight_bytes, grad_bytes=grad_bytes).items()}
    links = {"tp": tp_link.name, "cp": cp_link.name, "pp": pp_link.name, "dp": grad_link.name}
    return Plan(
        model=model, layout=layout, cluster=cl, n_gpus=n_gpus, gpu_memory_bytes=memory_limit, memory=memory,
        compute_time_s=compute_time, bubble_time_s=bubble_time, comm_time_s=comm, links=links,
        tokens_per_step=tokens_per_step, model_flops_per_step=model_flops, hardware_flops_per_step=hardware_flops,
        notes=tuple(notes),
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
            f"pp={layout.pp}, zero_stage={layout.zero_stage}: {largest.total_memory_bytes / GB:.1f} GB per GPU "
            f"remain, most of it {max(largest.memory, key=largest.memory.get)}; split the model with tp/pp/cp, "
            f"shard more with a higher zero_stage or recompute more."
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
    """Every valid (tp, pp, dp, zero) layout without CP, fitting ones first, fastest first.

    TP stays within one node and divides the KV heads; pp divides the layers' count only loosely
    (the fullest stage is used). With ``global_batch`` (sequences per step) the micro-batch count
    is global_batch / (dp * micro_batch); layouts for which that is not whole are skipped.
    """
    model = model_shape(model)
    cl = cluster(cluster_name)
    plans = []
    for tp in _divisors(math.gcd(model.kv_heads, cl.gpus_per_node)):
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
                layout = Layout(tp=tp, pp=pp, dp=dp, zero_stage=zero, micro_batch=micro_batch, seq=seq,
                                num_microbatches=m, recompute=recompute)
                try:
                    plans.append(plan(model, layout, n_gpus, cluster_name=cl, gpu_memory_bytes=gpu_memory_bytes))
                except LayoutError:
                    continue
    return sorted(plans, key=lambda p: (not p.fits, p.step_time_s))


# ----------------------------------------------------------------------------------------------
# Mixture of experts: parameters, expert parallelism, all-to-all traffic
# ----------------------------------------------------------------------------------------------


def _attention_params(cfg) -> int:
    """One layer's attention weights, no biases (neither Mixtral nor DeepSeek-V3 has any).

    "gqa": W_q and W_o (hidden x heads*head_dim), W_k and W_v (hidden x kv_heads*head_dim).
    "mla" (DeepSeek-V2/V3's multi-head latent attention, the released modeling_deepseek.py): q_a_proj
    hidden x q_lora_rank, its RMSNorm, q_b_proj q_lora_rank x heads*(nope + rope); kv_a_proj_with_mqa
    hidden x (kv_lora_rank + rope) (the latent and the shared RoPE key), its RMSNorm, kv_b_proj kv_lora_rank x
    heads*(nope + v); o_proj heads*v x hidden.
    """
    h = cfg.hidden
    if cfg.attention == "gqa":
        head_dim = cfg.head_dim or h // cfg.heads
        return 2 * h * cfg.heads * head_dim + 2 * h * cfg.kv_heads * head_dim
    if cfg.attention == "mla":
        qk_head = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        q = h * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * cfg.heads * qk_head
        kv = (h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank
              + cfg.kv_lora_rank * cfg.heads * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        return q + kv + cfg.heads * cfg.v_head_dim * h
    raise LayoutError(f"{cfg.name}: attention must be 'gqa' or 'mla', got {cfg.attention!r}.")


def moe_parameter_counts(cfg) -> dict[str, int]:
    """Exact parameter counts of an MoE decoder (a ``published_configs.PublishedMoE``), as Python ints.

    Keys: ``total``; ``active``, the parameters one token's forward pass uses; ``experts``, the routed experts'
    parameters over all layers (what expert parallelism shards); ``dense``, everything else (attention, norms,
    routers, shared experts, dense FFN layers, embedding and LM head: what every EP rank holds whole);
    ``active_experts``, the routed expert parameters one token uses (``top_k`` per MoE layer); and
    ``input_embedding``, the vocab x hidden table, so that ``active - input_embedding`` is the count without it.

    What is counted: every expert (shared or routed) and every dense FFN is SwiGLU, three hidden x ffn matrices
    (gate, up, down), no biases; two RMSNorm weight vectors per layer and a final one; the router, experts x
    hidden, plus, where ``router_bias`` (DeepSeek-V3), the per-expert bias its auxiliary-loss-free balancing adds
    to the routing scores (a parameter of the released checkpoint, so counted, though it takes no gradient);
    attention as ``_attention_params`` says; the embedding and a separate LM head unless ``tied_embeddings``.
    DeepSeek-V3's multi-token-prediction module is not part of the model counted (its 671B excludes it).

    ``active`` counts every parameter a token touches: the dense part whole, ``top_k`` routed experts per MoE
    layer, the embedding table and the LM head (as a matrix; the embedding is a lookup of one row, but it is
    counted whole, as parameter counts usually do). Against the published figures:

    - Mixtral 8x7B: total 46,702,792,704 and active 12,879,925,248, which round to the release post's 46.7B and
      12.9B (to the nearest 0.1B). Without the input embedding, active would be 12.75B, which would not: Mistral
      counts the embedding table as active.
    - DeepSeek-V3: total 671,026,419,200, which rounds to the report's 671B; active 37,552,297,472, which rounds
      to 38B, not the report's 37B. The report's 37B is what is left with one vocab x hidden table fewer
      (36,625,618,432 without the input embedding, a lookup that does no matmul, rounds to 37B), or 37.55B cut
      to 37B; the report does not say which. Either way the two publishers count "active" differently, and
      ``tests/test_planner_moe.py`` holds both facts.
    """
    h = cfg.hidden
    swiglu = lambda ffn: 3 * h * ffn  # noqa: E731  gate, up and down projections, no biases
    per_expert = swiglu(cfg.expert_ffn)
    moe_layers = cfg.layers - cfg.dense_layers
    norms = 2 * h  # before attention and before the FFN
    attention = _attention_params(cfg) + norms
    router = cfg.experts * h + (cfg.experts if cfg.router_bias else 0)
    dense_layer = attention + swiglu(cfg.ffn)
    moe_layer_dense_part = attention + router + cfg.shared_experts * per_expert
    input_embedding = cfg.vocab * h
    embeddings = input_embedding * (1 if cfg.tied_embeddings else 2)
    dense = cfg.dense_layers * dense_layer + moe_layers * moe_layer_dense_part + embeddings + h  # + final norm
    experts = moe_layers * cfg.experts * per_expert
    active_experts = moe_layers * cfg.top_k * per_expert
    return {"total": dense + experts, "active": dense + active_experts, "experts": experts, "dense": dense,
            "active_experts": active_experts, "input_embedding": input_embedding}


def ep_rank_parameters(cfg, ep: int) -> int:
    """Parameters one rank holds when each MoE layer's routed experts are split over ``ep`` ranks.

    Expert parallelism (Lepikhin et al. 2020, GShard, sec 3; Fedus et al. 2021, Switch Transformer, sec 5)
    gives every rank ``experts / ep`` whole routed experts of every MoE layer and replicates everything else
    (attention, routers, shared experts, dense layers, embeddings): ``dense + experts / ep``. No other
    parallelism is applied; with PP or TP as well, divide further.
    """
    ep = _check_degree("ep", ep)
    if cfg.experts % ep:
        raise LayoutError(
            f"ep={ep} does not divide the {cfg.experts} routed experts of {cfg.name}, so ranks would hold "
            f"different numbers of experts; use an ep from {_divisors(cfg.experts)}."
        )
    counts = moe_parameter_counts(cfg)
    return counts["dense"] + counts["experts"] // ep


def all_to_all_bytes(tokens: int, hidden: int, top_k: int, ep: int, bytes_per_element: int) -> float:
    """Bytes one rank sends in ONE all-to-all of the dispatch, under uniform routing.

    The rank holds ``tokens`` tokens (its micro-batch) of ``hidden`` elements, ``bytes_per_element`` wide (bf16:
    2), and sends one copy of each token to each of its ``top_k`` experts: ``tokens x top_k`` rows. With the
    experts spread evenly over ``ep`` ranks and the router picking them uniformly, a fraction 1/ep of the rows
    stay on the rank and (ep - 1)/ep cross the network:

        tokens x hidden x bytes_per_element x top_k x (ep - 1) / ep

    The combine brings the same rows back, another all-to-all of the same size; per MoE layer the forward pass
    is dispatch + combine (2x this) and the backward pass another 2x (the gradients travel the same routes in
    reverse), 4 all-to-alls per layer per micro-batch (6 if the MoE layer's forward is recomputed). Uniform
    routing is the model's assumption: a skewed router sends other amounts, and a rank that holds the popular
    experts receives more than it sends. Two copies of a token bound for experts on the same rank are counted
    twice, as a plain all-to-all sends them (DeepSeek-V3 instead sends a token over InfiniBand once per target
    node, at most 4 nodes, and forwards it there over NVLink: report sec 3.2.2).
    """
    for name, value in (("tokens", tokens), ("hidden", hidden), ("top_k", top_k), ("ep", ep),
                        ("bytes_per_element", bytes_per_element)):
        _check_degree(name, value)
    return tokens * hidden * bytes_per_element * top_k * (ep - 1) / ep


def ep_traffic_per_step(cfg, tokens_per_rank: int, ep: int, bytes_per_element: int = 2,
                        num_microbatches: int = 1) -> dict[str, float]:
    """All-to-all bytes one rank sends for expert parallelism, per MoE layer and per optimizer step.

    ``tokens_per_rank`` is the tokens of one micro-batch on this rank; ``num_microbatches`` how many it runs per
    step. Keys: ``per_all_to_all`` (``all_to_all_bytes``), ``all_to_alls_per_layer`` (4: dispatch and combine,
    forward and backward), ``per_layer`` (one MoE layer, one micro-batch, forward and backward), ``moe_layers``
    and ``per_step`` (every MoE layer of the model, every micro-batch: what the rank sends if it runs all the
    layers, i.e. without pipeline parallelism; with PP a rank sends its stage's share). Uniform routing, as in
    ``all_to_all_bytes``.
    """
    ep_rank_parameters(cfg, ep)  # the same refusal when ep does not divide the experts
    _check_degree("num_microbatches", num_microbatches)
    one = all_to_all_bytes(tokens_per_rank, cfg.hidden, cfg.top_k, ep, bytes_per_element)
    moe_layers = cfg.layers - cfg.dense_layers
    per_layer = 4 * one
    return {"per_all_to_all": one, "all_to_alls_per_layer": 4, "per_layer": per_layer, "moe_layers": moe_layers,
            "per_step": per_layer * moe_layers * num_microbatches}
