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
- Shapes: ``course_utils.planner.MODEL_SHAPES`` (Llama 2 7B, Llama 3 70B, GPT-3 175B); LLaMA 65B is
  Touvron et al. 2023 ("LLaMA", Table 2: dimension 8192, 64 heads, 80 layers), ffn 22016 and vocabulary
  32,000 from the released configuration.
"""
from __future__ import annotations

from dataclasses import dataclass

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
        s = model_state_bytes(n)
        return FinetuneMemory("full", s.params, 0.0, s.grads, s.optimizer, n)
    adapters = lora_params(shape, r, targets)
    s = model_state_bytes(adapters)  # the adapters train with mixed-precision Adam like any parameter
    base = n * (BF16_BYTES if method == "lora" else nf4_bits_per_param() / 8)
    return FinetuneMemory(method, base, s.params, s.grads, s.optimizer, adapters)


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
