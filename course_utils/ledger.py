"""The cost ledger: bytes, FLOPs and seconds for training a transformer, each formula from its paper.

Pure Python (no torch): notebooks, widgets and graders call it on any machine. Units are always
bytes, FLOPs and seconds, and model sizes are numbers of parameters (``7.5e9``, not ``7.5``).
``GB`` below is the decimal gigabyte (1e9 bytes), which is what the ZeRO paper prints; ``GiB``
(2**30) is what ``torch.cuda.memory_allocated`` and ``nvidia-smi`` report.

Sources, cited again next to each formula:

- ZeRO: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
  Models", sections 3 and 5, Figure 1.
- Activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", section 4, Table 2, Appendix A.
- Megatron FLOPs: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", sections 2.2 and 5.1, equations (2) and (3).
- 6ND: Kaplan et al. 2020, "Scaling Laws for Neural Language Models", section 2.1.
- MFU: Chowdhery et al. 2022, "PaLM", section 4.1 and Appendix B.
- Bus bandwidth: NVIDIA/nccl-tests, doc/PERFORMANCE.md.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

GB = 1e9  # decimal gigabyte; the ZeRO paper's "GB" (7.5e9 params * 16 bytes = 120 GB)
GiB = 2**30  # binary gigabyte; what CUDA memory counters report
SECONDS_PER_DAY = 86_400.0

ZERO_STAGES = (0, 1, 2, 3)
RECOMPUTE_MODES = ("none", "selective", "full")


def _positive_int(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    return value


def _non_negative(name: str, value: float) -> float:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool)) or value < 0 or math.isnan(value):
        raise ValueError(f"{name} must be a non-negative number, got {value!r}.")
    return value


# ----------------------------------------------------------------------------------------------
# Memory: model states (ZeRO)
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelStateBytes:
    """Per-GPU bytes of the three model states, and their sum."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


def model_state_bytes(
    n_params: float,
    *,
    dp: int = 1,
    tp: int = 1,
    pp: int = 1,
    zero_stage: int = 0,
    weight_bytes: float = 2,
    grad_bytes: float = 2,
    optimizer_bytes_per_param: float = 12,
) -> ModelStateBytes:
    """Per-GPU bytes of parameters, gradients and optimizer states under ZeRO-DP.

    Rajbhandari et al. 2020, section 3.1: mixed-precision Adam keeps fp16 parameters (2 bytes) and
    fp16 gradients (2 bytes) plus K = 12 bytes of optimizer state per parameter (fp32 master copy,
    momentum and variance), 16 bytes per parameter in all. Section 5.1 / Figure 1, with Psi the
    parameters and N_d the data-parallel degree:

    - stage 0 (plain DP):  (2 + 2 + K) * Psi
    - stage 1 (P_os):      2 Psi + 2 Psi + K Psi / N_d
    - stage 2 (P_os+g):    2 Psi + (2 + K) Psi / N_d
    - stage 3 (P_os+g+p):  (2 + 2 + K) Psi / N_d

    Tensor and pipeline parallelism first split the parameters ``tp * pp`` ways (each GPU holds
    ``n_params / (tp * pp)``, assuming an even split; a real first/last pipeline stage also holds the
    embeddings); ZeRO then shards over the ``dp`` ranks that hold the same slice. In Megatron-LM the
    distributed optimizer shards over data x context parallel ranks, so pass ``dp * cp`` there.
    Figure 1's example, 7.5e9 parameters on 64 GPUs, gives 120, 31.4, 16.6 and 1.9 GB (1e9 bytes).
    """
    _non_negative("n_params", n_params)
    _positive_int("dp", dp)
    _positive_int("tp", tp)
    _positive_int("pp", pp)
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage must be one of 0, 1, 2, 3 (ZeRO section 5), got {zero_stage!r}.")
    for name, value in (("weight_bytes", weight_bytes), ("grad_bytes", grad_bytes),
                        ("optimizer_bytes_per_param", optimizer_bytes_per_param)):
        _non_negative(name, value)
    local = n_params / (tp * pp)
    params = weight_bytes * local / (dp if zero_stage >= 3 else 1)
    grads = grad_bytes * local / (dp if zero_stage >= 2 else 1)
    optimizer = optimizer_bytes_per_param * local / (dp if zero_stage >= 1 else 1)
    return ModelStateBytes(params=params, grads=grads, optimizer=optimizer)


# ----------------------------------------------------------------------------------------------
# Memory: activations (Korthikanti et al. 2022)
# ----------------------------------------------------------------------------------------------


def activation_bytes_per_layer(
    seq: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
) -> float:
    """Bytes of activations one transformer layer keeps for the backward pass (one micro-batch).

    Korthikanti et al. 2022, Table 2 (s sequence, b micro-batch, h hidden, a heads, t tensor
    parallel); 16-bit activations (2 bytes) and 1-byte dropout masks, a GPT block with a 4h MLP:

    ===================================  =======================  ===========================
    recompute                            sequence_parallel=False  sequence_parallel=True
    ===================================  =======================  ===========================
    "none"      (eq. 1, eq. 2, eq. 4)    sbh(10 + 24/t + 5as/ht)  sbh(34/t + 5as/ht)
    "selective" (section 5, eq. 6)       sbh(10 + 24/t)           sbh * 34/t
    "full"      (section 5)              2sbh                     2sbh
    ===================================  =======================  ===========================

    With t = 1 the first row is eq. 1, sbh(34 + 5as/h). The 10 sbh that tensor parallelism leaves
    unsplit is the LayerNorms and dropouts; sequence parallelism splits it along s. The 5as/h term
    is the s x s attention scores, softmax and its dropout mask: selective recomputation drops it
    (and so does FlashAttention, which never stores the scores). Full recomputation keeps only each
    layer's input; the paper notes 2sbh/t is possible with an extra all-gather but does not use it,
    and neither do we. Pipeline schedules multiply this by the layers and micro-batches in flight
    (section 4.2.3); that bookkeeping is in ``course_utils.planner``.
    """
    for name, value in (("seq", seq), ("micro_batch", micro_batch), ("hidden", hidden),
                        ("heads", heads), ("tp", tp)):
        _positive_int(name, value)
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(
            f"recompute must be one of {', '.join(map(repr, RECOMPUTE_MODES))} "
            f"(Korthikanti et al. 2022, Table 2), got {recompute!r}."
        )
    sbh = seq * micro_batch * hidden
    if recompute == "full":
        return 2.0 * sbh
    replicated = 10.0 / tp if sequence_parallel else 10.0  # LayerNorm + dropout region
    split = 24.0 / tp
    scores = 5.0 * heads * seq / (hidden * tp) if recompute == "none" else 0.0
    return sbh * (replicated + split + scores)


# Korthikanti et al. 2022, section 4.1, the terms of eq. (1) for one layer (t = 1), in units of sbh bytes
# (16-bit activations, 1-byte dropout masks), and the s x s terms in units of a s^2 b bytes.
ACTIVATION_TERMS_SBH = {
    "layernorm inputs": 4,  # "Layer norm": each of the two stores its 2sbh input
    "qkv input": 2,  # "QKV matrix multiplies": their shared input
    "q and k": 4,  # "QK^T matrix multiply": Q and K
    "v": 2,  # "Attention over Values": V (with the dropout output below)
    "projection input": 2,  # "Linear projection stores its input activations"
    "attention dropout mask": 1,  # "attention dropout requires a mask"
    "fc1 input": 2,  # "The two linear layers store their inputs with size 2sbh and 8sbh"
    "gelu input": 8,  # "The GeLU non-linearity also needs its input"
    "fc2 input": 8,
    "mlp dropout mask": 1,  # "dropout stores its mask"
}
ACTIVATION_TERMS_AS2B = {"softmax output": 2, "softmax dropout mask": 1, "softmax dropout output": 2}
LINEAR_INPUT_TERMS = ("qkv input", "projection input", "fc1 input", "fc2 input")  # 14 sbh of the 34
DROPOUT_TERMS = ("attention dropout mask", "mlp dropout mask", "softmax dropout mask", "softmax dropout output")


def activation_terms_per_layer(
    seq: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    *,
    recompute: str = "none",
    dropout: bool = True,
    bytes_per_element: float = 2,
) -> dict[str, float]:
    """Bytes one transformer layer keeps for backward, term by term: Korthikanti et al. 2022, section 4.1.

    Without tensor or sequence parallelism (t = 1), eq. (1) is the sum of these terms, per layer:

    - attention block, 11 sbh + 5 as^2 b: QKV input 2sbh, Q and K 4sbh, V 2sbh, projection input 2sbh,
      attention dropout mask sbh; softmax output 2as^2b, its dropout mask as^2b, the dropout output 2as^2b;
    - MLP block, 19 sbh: fc1 input 2sbh, GeLU input 8sbh, fc2 input 8sbh, dropout mask sbh;
    - LayerNorms, 4 sbh: each of the two stores its 2sbh input;

    34 sbh + 5 as^2 b in all. ``recompute="selective"`` (section 5, eq. 6 at t = 1) drops the three s x s
    terms (recomputed; FlashAttention never stores them either), leaving 34 sbh; ``"full"`` keeps only the
    layer's input, 2sbh (one term, "layer input"). ``dropout=False`` drops the masks and the softmax dropout
    output, for a block without dropout (then 32 sbh with selective recomputation). ``bytes_per_element``
    rescales the 16-bit terms (4 for fp32 activations; the 1-byte masks stay 1 byte). With ``dropout=True``
    the sum equals ``activation_bytes_per_layer(..., tp=1)`` for every ``recompute``.
    """
    for name, value in (("seq", seq), ("micro_batch", micro_batch), ("hidden", hidden), ("heads", heads)):
        _positive_int(name, value)
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(
            f"recompute must be one of {', '.join(map(repr, RECOMPUTE_MODES))} "
            f"(Korthikanti et al. 2022, Table 2), got {recompute!r}."
        )
    _non_negative("bytes_per_element", bytes_per_element)
    sbh = float(seq * micro_batch * hidden)
    scale = bytes_per_element / 2
    if recompute == "full":
        return {"layer input": 2 * sbh * scale}
    terms = {}
    for name, units in ACTIVATION_TERMS_SBH.items():
        if dropout or name not in DROPOUT_TERMS:
            terms[name] = units * sbh * (1 if "mask" in name else scale)
    if recompute == "none":
        as2b = float(heads * seq * seq * micro_batch)
        for name, units in ACTIVATION_TERMS_AS2B.items():
            if dropout or name not in DROPOUT_TERMS:
                terms[name] = units * as2b * (1 if "mask" in name else scale)
    return terms


def fp8_linear_inputs_activation_bytes_per_layer(
    seq: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    *,
    recompute: str = "selective",
    dropout: bool = True,
    attention_keeps_output: bool = False,
) -> float:
    """Bytes per layer when the four linear layers save their inputs in FP8 (1 byte) instead of bf16 (2 bytes).

    The terms of ``activation_terms_per_layer`` (Korthikanti et al. 2022, section 4.1) with the linear layers'
    saved inputs halved: QKV input 2sbh, projection input 2sbh, fc1 input 2sbh and fc2 input 8sbh, 14 of
    the 34 sbh, become 7 sbh, so 34 sbh -> 27 sbh with selective recomputation. That is what FP8 recipes
    change in the ledger (DeepSeek-V3, section 3.3.1: with the weight-gradient GEMM in FP8, the activations a
    linear layer saves can be stored in FP8 for the backward pass); the per-tensor or per-tile fp32 scales are
    left out (4 bytes per 128 values at most).

    ``attention_keeps_output=True``: a fused attention kernel (FlashAttention, torch's SDPA) saves its own
    bf16 output O for its backward, and O is the projection's input, so the projection's FP8 copy replaces
    nothing and comes on top (2sbh + sbh for that term): 34 sbh -> 29 sbh.
    """
    terms = activation_terms_per_layer(seq, micro_batch, hidden, heads, recompute=recompute, dropout=dropout)
    sbh = float(seq * micro_batch * hidden)
    for name in LINEAR_INPUT_TERMS:
        if name in terms:
            terms[name] /= 2
    if attention_keeps_output and "projection input" in terms:
        terms["projection input"] = 2 * sbh + sbh
    return sum(terms.values())


# ----------------------------------------------------------------------------------------------
# FLOPs and time
# ----------------------------------------------------------------------------------------------


def training_flops(n_params: float, tokens: float) -> float:
    """C = 6 N D: FLOPs to train N parameters on D tokens.

    Kaplan et al. 2020, section 2.1: a forward pass costs about 2N FLOPs per token (one multiply and
    one add per parameter) and the backward pass twice that, so C ~ 6N per token (the attention and
    embedding terms are dropped). GPT-3 175B on 300e9 tokens gives 3.14e23 FLOPs, the figure in
    Brown et al. 2020, Table D.1.
    """
    _non_negative("n_params", n_params)
    _non_negative("tokens", tokens)
    return 6.0 * n_params * tokens


def megatron_params(layers: int, hidden: int, vocab: int, seq: int) -> float:
    """Parameters of a GPT model, Narayanan et al. 2021, section 5.1, eq. (2).

    P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)): 12h^2 + 13h per layer (QKV, projection, 4h MLP,
    biases and LayerNorms), plus the V x h word and s x h position embeddings. Reproduces the
    paper's Table 1 column, e.g. 174.6e9 for l=96, h=12288 and 1008.0e9 for l=128, h=25600.
    """
    for name, value in (("layers", layers), ("hidden", hidden), ("vocab", vocab), ("seq", seq)):
        _positive_int(name, value)
    l, h = layers, hidden
    return 12.0 * l * h**2 * (1 + 13 / (12 * h) + (vocab + seq) / (12 * l * h))


def megatron_flops_per_iteration(
    batch: int,
    seq: int,
    layers: int,
    hidden: int,
    vocab: int,
    *,
    recompute: bool | str = True,
) -> float:
    """FLOPs of one training iteration of a GPT model, counting only the matrix multiplies.

    A layer's forward pass costs 24 B s h^2 + 4 B s^2 h and the logit layer 2 B s h V; backward
    costs twice the forward (Narayanan et al. 2021, section 5.1; Korthikanti et al. 2022, Appendix A).

    - ``recompute=True`` or ``"full"``: Narayanan et al. 2021, eq. (3), an extra forward pass for
      full activation recomputation: 96 B s l h^2 (1 + s/(6h) + V/(16 l h)).
    - ``recompute=False`` or ``"none"``: Korthikanti et al. 2022, eq. (7), the "model FLOPs":
      72 B s l h^2 (1 + s/(6h) + V/(12 l h)).
    - ``"selective"``: Korthikanti et al. 2022, eq. (8), the attention scores recomputed:
      72 B s l h^2 (1 + s/(3h) + V/(12 l h)).

    B is the global batch in sequences. The logit layer is never recomputed, hence V/(16lh) in the
    first form. Dividing model FLOPs by (time x GPUs x peak) is Korthikanti's Table 5 MFU.

    A caution on eq. (8): Appendix A says selective recomputation adds one forward pass of the
    attention matmuls, 4 B s^2 h per layer, but s/(3h) in place of s/(6h) adds 12 B s^2 h per layer,
    three times that. Eq. (8) is kept as printed because the paper's own numbers use it: Table 5's
    HFU column and section 5's "2.7% and 1.6% FLOPs overhead" both follow from it. The planner
    counts the physical 4 B s^2 h instead.
    """
    for name, value in (("batch", batch), ("seq", seq), ("layers", layers), ("hidden", hidden),
                        ("vocab", vocab)):
        _positive_int(name, value)
    mode = {True: "full", False: "none"}.get(recompute, recompute) if isinstance(recompute, bool) else recompute
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be True, False, 'none', 'selective' or 'full', got {recompute!r}.")
    B, s, l, h, V = batch, seq, layers, hidden, vocab
    if mode == "full":
        return 96.0 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    attention = s / (3 * h) if mode == "selective" else s / (6 * h)
    return 72.0 * B * s * l * h**2 * (1 + attention + V / (12 * l * h))


def megatron_training_time(tokens: float, n_params: float, n_gpus: int, flops_per_gpu: float) -> float:
    """Seconds to train on ``tokens`` tokens, Narayanan et al. 2021, section 5.1: ~ 8 T P / (n X).

    Eq. (3) divided by the B*s tokens of an iteration is 96 l h^2 (1 + ...) ~ 8P FLOPs per token
    when 6h >> s and 16lh >> V (full recomputation: 4 passes of 2P). X is the achieved FLOP/s per GPU.
    The paper's examples: GPT-3 (P=175e9, T=300e9, n=1024, X=140e12) 34 days; the 1T model
    (T=450e9, n=3072, X=163e12) 84 days.
    """
    _non_negative("tokens", tokens)
    _non_negative("n_params", n_params)
    _positive_int("n_gpus", n_gpus)
    if flops_per_gpu <= 0:
        raise ValueError(f"flops_per_gpu must be positive, got {flops_per_gpu!r}.")
    return 8.0 * tokens * n_params / (n_gpus * flops_per_gpu)


def flops_per_token(n_params: float, layers: int, heads: int, head_dim: int, seq: int) -> float:
    """Model FLOPs per token for a forward and backward pass: 6N + 12 L H Q T (PaLM, Appendix B).

    Chowdhery et al. 2022: N parameters (6N for the dense matmuls), L layers, H heads, Q head
    dimension and T sequence length; 12 L H Q T is the attention QK^T and AV matmuls (2 x 2 LHQT
    forward, twice that backward). Rematerialisation is not counted: these are model FLOPs, the
    numerator of MFU.
    """
    _non_negative("n_params", n_params)
    for name, value in (("layers", layers), ("heads", heads), ("head_dim", head_dim), ("seq", seq)):
        _positive_int(name, value)
    return 6.0 * n_params + 12.0 * layers * heads * head_dim * seq


def mfu(tokens_per_second: float, flops_per_token: float, n_gpus: int, peak_flops_per_gpu: float) -> float:
    """Model FLOPs utilization (PaLM, section 4.1 and Appendix B), a fraction in [0, 1].

    MFU = observed tokens/s x model FLOPs per token / (n_gpus x peak FLOP/s per GPU). PaLM 540B:
    238.3e3 tokens/s on 6144 TPU v4 chips (275e12 peak) gives 46.2%.
    """
    _non_negative("tokens_per_second", tokens_per_second)
    _non_negative("flops_per_token", flops_per_token)
    _positive_int("n_gpus", n_gpus)
    if peak_flops_per_gpu <= 0:
        raise ValueError(f"peak_flops_per_gpu must be positive, got {peak_flops_per_gpu!r}.")
    return tokens_per_second * flops_per_token / (n_gpus * peak_flops_per_gpu)


def training_days(total_flops: float, n_gpus: int, peak_flops_per_gpu: float, utilization: float) -> float:
    """Days = FLOPs / (GPUs x peak x MFU) / 86400, the back-of-envelope used in chapter 00.

    ``utilization`` is the MFU as a fraction (0.4 for 40%).
    """
    _non_negative("total_flops", total_flops)
    _positive_int("n_gpus", n_gpus)
    if peak_flops_per_gpu <= 0 or not 0 < utilization <= 1:
        raise ValueError("peak_flops_per_gpu must be positive and utilization a fraction in (0, 1].")
    return total_flops / (n_gpus * peak_flops_per_gpu * utilization) / SECONDS_PER_DAY


# ----------------------------------------------------------------------------------------------
# Communication
# ----------------------------------------------------------------------------------------------

# Canonical collective names; bus_bandwidth_factor also accepts "allreduce", "AllReduce", "all-reduce".
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "send_recv")
_ALIASES = {name.replace("_", ""): name for name in COLLECTIVES} | {"alltoall": "all_to_all", "sendrecv": "send_recv"}


def _collective_name(collective: str) -> str:
    key = str(collective).lower().replace("_", "").replace("-", "").replace(" ", "")
    if key not in _ALIASES:
        raise ValueError(
            f"unknown collective {collective!r}; use one of {', '.join(COLLECTIVES)}."
        )
    return _ALIASES[key]


def bus_bandwidth_factor(collective: str, n: int) -> float:
    """busbw / algbw for a collective on n ranks (NVIDIA/nccl-tests, doc/PERFORMANCE.md).

    all_reduce 2(n-1)/n; reduce_scatter, all_gather and all_to_all (n-1)/n; broadcast and reduce 1;
    send_recv 1 (src/sendrecv.cu). nccl-tests reports busbw = algbw x factor so that the number can
    be compared with the link's hardware bandwidth whatever n is; algbw = S / t, where S is the size
    of the whole array (for all_gather and reduce_scatter, count per rank x n).
    """
    name = _collective_name(collective)
    _positive_int("n", n)
    if name == "all_reduce":
        return 2.0 * (n - 1) / n
    if name in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def _latency_steps(name: str, n: int) -> int:
    """Sequential hops of a ring (the count NCCL's own model uses, src/graph/tuning.cc)."""
    if name == "all_reduce":
        return 2 * (n - 1)  # reduce-scatter then all-gather around the ring
    if name == "send_recv":
        return 1
    return n - 1  # one ring pass; for broadcast/reduce the first chunk crosses n-1 hops


def collective_time(collective: str, nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Alpha-beta time of a ring collective, in seconds.

    t = steps x latency + factor x nbytes / bandwidth, where ``factor`` is
    ``bus_bandwidth_factor(collective, n)`` and ``bandwidth`` is the bus bandwidth each GPU gets
    (bytes/s, one direction). This is nccl-tests' definition read backwards (t = S/algbw =
    factor x S / busbw) plus a latency ``latency`` (alpha, seconds) per sequential ring step:
    2(n-1) steps for all_reduce, n-1 for all_gather, reduce_scatter, all_to_all, broadcast and
    reduce, 1 for send_recv. For a ring all_reduce: t = 2(n-1) alpha + 2(n-1)/n x S/B.
    ``nbytes`` is nccl-tests' S: the full buffer (for all_gather the gathered output, for
    reduce_scatter the unreduced input). One rank (n=1) communicates nothing and takes 0 s.
    """
    name = _collective_name(collective)
    _positive_int("n", n)
    _non_negative("nbytes", nbytes)
    _non_negative("latency", latency)
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be positive bytes/s, got {bandwidth!r}.")
    if n == 1:
        return 0.0
    return _latency_steps(name, n) * latency + bus_bandwidth_factor(name, n) * nbytes / bandwidth


@dataclass(frozen=True)
class TPCommBytes:
    """Tensor-parallel traffic of one transformer layer for one micro-batch (per GPU)."""

    message_bytes: float  # size of each all-reduced activation, b*s*h*bytes
    all_reduces_forward: int
    all_reduces_backward: int
    all_reduces_recompute: int
    wire_bytes_per_all_reduce: float  # bytes each GPU sends in one ring all-reduce, 2(t-1)/t * message

    @property
    def all_reduces(self) -> int:
        return self.all_reduces_forward + self.all_reduces_backward + self.all_reduces_recompute

    @property
    def total_wire_bytes(self) -> float:
        return self.all_reduces * self.wire_bytes_per_all_reduce

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "all_reduces": self.all_reduces, "total_wire_bytes": self.total_wire_bytes}


def tp_comm_bytes_per_layer(
    batch: int, seq: int, hidden: int, tp: int, *, bytes_per_element: float = 2, full_recompute: bool = False
) -> TPCommBytes:
    """Bytes a GPU sends for Megatron tensor parallelism in one layer (one micro-batch).

    Shoeybi et al. 2019, section 3 (Figures 3 and 4): the attention block and the MLP each have one
    ``g`` (all-reduce forward, identity backward) and one ``f`` (identity forward, all-reduce
    backward), so a layer does 2 all-reduces in the forward and 2 in the backward pass
    (Korthikanti et al. 2022, section 4.2.2: "four all-reduces in a single forward and backward
    pass"). Each all-reduces a b x s x h activation; a ring all-reduce sends 2(t-1)/t of it per GPU.
    Sequence parallelism swaps each all-reduce for a reduce-scatter + all-gather pair with the same
    bytes on the wire. ``full_recompute=True`` adds the 2 all-reduces of the recomputed forward.
    """
    for name, value in (("batch", batch), ("seq", seq), ("hidden", hidden), ("tp", tp)):
        _positive_int(name, value)
    _non_negative("bytes_per_element", bytes_per_element)
    message = float(batch * seq * hidden * bytes_per_element)
    return TPCommBytes(
        message_bytes=message,
        all_reduces_forward=2,
        all_reduces_backward=2,
        all_reduces_recompute=2 if full_recompute else 0,
        wire_bytes_per_all_reduce=2.0 * (tp - 1) / tp * message,
    )


# ----------------------------------------------------------------------------------------------
# Pipeline bubble
# ----------------------------------------------------------------------------------------------


def pipeline_bubble_fraction(p: int, m: int, v: int = 1, *, denominator: str = "ideal") -> float:
    """Pipeline bubble of a synchronous (GPipe / 1F1B / interleaved 1F1B) schedule.

    Narayanan et al. 2021, section 2.2: with p stages, m micro-batches per batch and v model chunks
    per GPU (interleaved schedule, section 2.2.2), the bubble time is (p-1)/v times a micro-batch's
    forward+backward time, and the ideal (bubble-free) time is m times that, so

    - ``denominator="ideal"`` (default, the paper's "bubble time fraction"):
      bubble / ideal compute = (1/v) (p-1)/m.
    - ``denominator="total"``: the share of the whole step that is idle,
      bubble / (ideal + bubble) = (p-1) / (v m + p - 1); for v = 1, (p-1)/(m+p-1).

    The first can exceed 1 (m < p - 1); the second is always below 1. Both are 0 for p = 1.
    """
    _positive_int("p", p)
    _positive_int("m", m)
    _positive_int("v", v)
    if denominator == "ideal":
        return (p - 1) / (v * m)
    if denominator == "total":
        return (p - 1) / (v * m + p - 1)
    raise ValueError(f"denominator must be 'ideal' or 'total', got {denominator!r}.")
