"""The post-training memory ledger: bytes per GPU for full fine-tuning, LoRA and QLoRA, and LoRA's
parameter counts. Pure Python (no torch), like ``course_utils.ledger``, which it builds on.

Sources, cited again next to each number:

- Full fine-tuning: mixed-precision Adam, 16 bytes per parameter (ZeRO, Rajbhandari et al. 2020, sec. 3.1),
  ``ledger.model_state_bytes``.
- LoRA: Hu et al. 2021, sec. 4.1 (r (d + k) trainable numbers per d x k matrix) and sec. 7.1 / Table 5
  (GPT-3 175B, "a parameter budget of 18M ... r = 8 if we adapt one type of attention weights or r = 4 if we
  adapt two types, for all 96 layers").
- QLoRA: Dettmers et al. 2023, sec. 3: NF4 stores 4 bits per weight; one fp32 absmax constant per block of
  64 weights adds 32/64 = 0.5 bits per weight; Double Quantization (8-bit constants, one fp32 constant per
  256 of them) brings that to 8/64 + 32/(64*256) = 0.127 bits. Abstract: 65B finetuning "on a single 48GB
  GPU"; "from >780GB of GPU memory to <48GB".
- Precision is one assumption, ``BytesPerParam``: ``MIXED_BF16`` for the 7B/70B rows; ``FP32_ADAM`` (4 + 4 + 8
  bytes, the fp32 weight being its own master copy) for the chapter's toy, whose ranks count the real tensors
  (``workers/posttrain/state.py``) so that ``against_measured`` can check the ledger against them.
- Shapes: ``course_utils.planner.MODEL_SHAPES`` (Llama 2 7B, Llama 3 70B, GPT-3 175B); LLaMA 65B is
  Touvron et al. 2023 ("LLaMA", Table 2: dimension 8192, 64 heads, 80 layers), ffn 22016 and vocabulary
  32,000 from the released configuration.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from course_utils.ledger import GB, model_state_bytes
from course_utils.planner import ModelShape, model_shape

METHODS = ("full", "lora", "qlora")
LLAMA_65B = ModelShape("LLaMA 65B", layers=80, hidden=8192, heads=64, kv_heads=64, ffn=22016, vocab=32_000,
                       source="Touvron et al. 2023, LLaMA, Table 2")
ATTENTION = ("q", "k", "v", "o")
ALL_LINEAR = ("q", "k", "v", "o", "gate", "up", "down")
NF4_BITS = 4
BF16_BYTES = 2


def matrix_shapes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(d_out, k_in) of every weight matrix of one transformer layer, by name."""
    h, kv, f = shape.hidden, shape.kv_dim, shape.ffn
    mats = {"q": (h, h), "k": (kv, h), "v": (kv, h), "o": (h, h), "up": (f, h), "down": (h, f)}
    if shape.mlp == "swiglu":
        mats["gate"] = (f, h)
    return mats


def lora_params(shape: ModelShape | str, r: int, targets=("q", "v")) -> int:
    """Trainable LoRA numbers over the whole model: layers x sum over targets of r (d + k) (Hu et al. sec. 4.1)."""
    shape = model_shape(shape)
    mats = matrix_shapes(shape)
    missing = [t for t in targets if t not in mats]
    if missing:
        raise ValueError(f"{shape.name} has no matrix {missing}: choose from {', '.join(mats)}")
    return shape.layers * sum(r * (mats[t][0] + mats[t][1]) for t in targets)


def nf4_bits_per_param(block: int = 64, double_quant: bool = True, block2: int = 256) -> float:
    """Bits per weight of an NF4 base, constants included (QLoRA sec. 3, "Double Quantization")."""
    constants = 8 / block + 32 / (block * block2) if double_quant else 32 / block
    return NF4_BITS + constants


@dataclass(frozen=True)
class FinetuneMemory:
    method: str
    base_weights: float  # the frozen (or, for full FT, trained) model weights
    adapter_weights: float
    grads: float
    optimizer: float
    trainable: float  # number of trainable parameters

    @property
    def total(self) -> float:
        return self.base_weights + self.adapter_weights + self.grads + self.optimizer

    def gb(self) -> dict[str, float]:
        return {k: getattr(self, k) / GB for k in ("base_weights", "adapter_weights", "grads", "optimizer", "total")}


@dataclass(frozen=True)
class BytesPerParam:
    """The ledger's whole assumption about precision: bytes per parameter, by role."""

    weight: float  # a trained weight, as forward and backward read it
    grad: float
    optimizer: float  # Adam's m and v (4 + 4 in fp32), plus a fp32 master copy (4) when weights are 16-bit
    frozen: float  # a frozen base weight: it has no gradient and no optimizer state at all


MIXED_BF16 = BytesPerParam(weight=2, grad=2, optimizer=12, frozen=BF16_BYTES)  # ZeRO sec. 3.1; bf16 LoRA base
# Plain fp32 AdamW (the toy): the fp32 weight is its own master copy, so Adam adds only m and v
FP32_ADAM = BytesPerParam(weight=4, grad=4, optimizer=8, frozen=4)


def memory_from_counts(method: str, trainable: int, frozen: int = 0, per: BytesPerParam = MIXED_BF16) -> FinetuneMemory:
    """Model-state bytes of ``trainable`` parameters trained with Adam next to ``frozen`` ones, at ``per``
    bytes each. For "full" the trained parameters are the model (``base_weights``); for LoRA / QLoRA they are
    the adapters and ``frozen`` is the base."""
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not one of {', '.join(METHODS)}")
    if method == "full" and frozen:
        raise ValueError(f"full fine-tuning freezes nothing: frozen={frozen} must be 0")
    s = model_state_bytes(trainable, weight_bytes=per.weight, grad_bytes=per.grad,
                          optimizer_bytes_per_param=per.optimizer)
    if method == "full":
        return FinetuneMemory("full", s.params, 0.0, s.grads, s.optimizer, trainable)
    return FinetuneMemory(method, frozen * per.frozen, s.params, s.grads, s.optimizer, trainable)


def finetune_memory(shape: ModelShape | str, method: str, r: int = 16, targets=ALL_LINEAR) -> FinetuneMemory:
    """Model-state bytes on one GPU (no sharding; activations not counted: they depend on batch and sequence).

    - full: 16 bytes/param (bf16 weights + bf16 grads + 12 bytes of fp32 Adam state, ZeRO sec. 3.1);
    - lora: bf16 frozen base (2 bytes/param, no grads, no optimizer state) + adapters at 16 bytes each;
    - qlora: NF4 base at ``nf4_bits_per_param()`` bits + adapters at 16 bytes each.
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not one of {', '.join(METHODS)}")
    shape = model_shape(shape)
    n = shape.n_params
    if method == "full":
        return memory_from_counts("full", n)
    adapters = lora_params(shape, r, targets)  # the adapters train with mixed-precision Adam like any parameter
    per = MIXED_BF16 if method == "lora" else replace(MIXED_BF16, frozen=nf4_bits_per_param() / 8)
    return memory_from_counts(method, adapters, n, per)


# -- the chapter's tiny GPT (the course's ``workers/model/gpt.py``), so that the ledger can be checked against what a
# rank holds --

def toy_matrices(hidden: int, vocab: int) -> dict[str, tuple[int, int]]:
    """(d_out, k_in) of each nn.Linear of the tiny GPT: fused qkv, proj, the GELU MLP's fc1 and fc2 (per
    layer), and the untied LM head (once)."""
    d = hidden
    return {"qkv": (3 * d, d), "proj": (d, d), "fc1": (4 * d, d), "fc2": (d, 4 * d), "head": (vocab, d)}


def toy_params(hidden: int, layers: int, vocab: int, seq: int) -> int:
    """Every parameter of the tiny GPT. Unlike ``ModelShape.n_params`` it counts biases, LayerNorm biases
    and the learned position table, which a 7B model's count can ignore and a 58k-parameter one cannot."""
    d = hidden
    linears = sum(dd * kk + dd for name, (dd, kk) in toy_matrices(d, vocab).items() if name != "head")  # W + bias
    per_layer = linears + 2 * 2 * d  # + two LayerNorms, each a gain and a bias
    return vocab * d + seq * d + layers * per_layer + 2 * d + vocab * d  # embed, pos, blocks, ln_f, head (no bias)


def toy_lora_params(hidden: int, layers: int, vocab: int, r: int, targets) -> int:
    """Trainable LoRA numbers on the tiny GPT: r (d + k) per adapted matrix, per layer except the head."""
    mats = toy_matrices(hidden, vocab)
    missing = [t for t in targets if t not in mats]
    if missing:
        raise ValueError(f"the tiny GPT has no Linear {missing}: choose from {', '.join(mats)}")
    return sum(r * sum(mats[t]) * (1 if t == "head" else layers) for t in targets)


def ledger_table(shapes=("7B", "70B"), r: int = 16, targets=ALL_LINEAR) -> list[dict]:
    """One row per (model, method): GB per component and in total."""
    rows = []
    for name in shapes:
        shape = model_shape(name) if isinstance(name, str) else name
        for method in METHODS:
            m = finetune_memory(shape, method, r, targets)
            rows.append({"model": shape.name, "method": method, "trainable": m.trainable, **m.gb()})
    return rows


def render_ledger(rows: list[dict]) -> str:
    head = f"{'model':<14}{'method':<8}{'trainable':>14}{'base GB':>10}{'adapter':>9}{'grads':>9}{'Adam':>9}{'total GB':>10}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['model']:<14}{r['method']:<8}{r['trainable']:>14,.0f}{r['base_weights']:>10.1f}"
                     f"{r['adapter_weights']:>9.2f}{r['grads']:>9.1f}{r['optimizer']:>9.1f}{r['total']:>10.1f}")
    return "\n".join(lines)


def against_measured(memory: FinetuneMemory, state: dict) -> list[tuple[str, int, float]]:
    """(quantity, counted on the rank, ledger) for each part the ledger prices. ``state`` is a
    ``workers.posttrain.state.measured_state_bytes`` dict. Adam's ``step`` counters are left out: the ledger
    counts bytes per parameter, and they are 4 bytes per parameter *tensor*."""
    full = memory.method == "full"
    return [
        ("trainable parameters", state["trainable_params"], memory.trainable),
        ("trained weights, bytes", state["trained_weight_bytes"], memory.base_weights if full else memory.adapter_weights),
        ("frozen weights, bytes", state["frozen_weight_bytes"], 0.0 if full else memory.base_weights),
        ("gradients, bytes", state["grad_bytes"], memory.grads),
        ("Adam m + v, bytes", state["optimizer_moment_bytes"], memory.optimizer),
    ]


def render_against_measured(checks: dict[str, list[tuple[str, int, float]]]) -> str:
    """``checks``: label -> ``against_measured`` rows; one pair of columns (rank, ledger) per label."""
    labels = list(checks)
    head = f"{'':<24}" + "".join(f"{label + ': rank':>18}{'ledger':>10}" for label in labels)
    lines = [head, "-" * len(head)]
    for i, (quantity, _, _) in enumerate(checks[labels[0]]):
        lines.append(f"{quantity:<24}" + "".join(f"{checks[label][i][1]:>18,}{checks[label][i][2]:>10,.0f}"
                                                 for label in labels))
    return "\n".join(lines)
