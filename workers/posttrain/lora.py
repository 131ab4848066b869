"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", sec. 4.1, eq. 3).

h = W0 x + (alpha / r) * B A x, with W0 (d x k) frozen, A (r x k) and B (d x r) trainable. A starts
random (Kaiming uniform, as the reference implementation does) and B starts at zero, so at step 0 the
adapted layer *is* the base layer: fine-tuning starts exactly from the pretrained model. Only
r * (d + k) numbers per matrix train. After training, W = W0 + (alpha/r) B A is one matrix of the same
shape: ``merge()`` folds the adapter in, so inference costs nothing extra.
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn

# Every nn.Linear of the tiny GPT, by attribute name: the default LoRA targets and the only names allowed.
# The LM head is included because this base is a random init: with the head and final LayerNorm frozen, the
# answer-token loss cannot go below ~1.7 nats whatever the blocks learn (course_utils.ch12_floor).
LORA_TARGETS = ("qkv", "proj", "fc1", "fc2", "head")
LORA_ALPHA = 8.0


class LoRALinear(nn.Module):
    """Wrap an ``nn.Linear`` (in_features k, out_features d): frozen base, trainable rank-r update."""

    def __init__(self, base: nn.Linear, r: int = 4, alpha: float = 8.0):
        super().__init__()
        if r < 1:
            raise ValueError(f"LoRA rank r={r} must be at least 1")
        self.base, self.r, self.alpha = base, r, alpha
        for p in self.base.parameters():
            p.requires_grad_(False)  # W0 and its bias stay what pretraining left
        d, k = base.out_features, base.in_features
        self.lora_A = nn.Parameter(torch.empty(r, k, device=base.weight.device))  # [r, k]
        self.lora_B = nn.Parameter(torch.zeros(d, r, device=base.weight.device))  # [d, r]: zero, so B A = 0 at init
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # what nn.Linear uses for its own weight

    @property
    def scale(self) -> float:
        return self.alpha / self.r  # keeps the update's size roughly independent of r (sec. 4.1)

    def delta_weight(self) -> torch.Tensor:
        return self.scale * self.lora_B @ self.lora_A  # [d, r] @ [r, k] -> [d, k]

    def forward(self, x):  # [..., k] -> [..., d]
        return self.base(x) + self.scale * (x @ self.lora_A.t()) @ self.lora_B.t()  # [..., r] -> [..., d]

    def merge(self) -> nn.Linear:
        """A plain ``nn.Linear`` with W = W0 + (alpha/r) B A and the base bias: same output, no adapter."""
        merged = nn.Linear(self.base.in_features, self.base.out_features, bias=self.base.bias is not None,
                           device=self.base.weight.device, dtype=self.base.weight.dtype)
        with torch.no_grad():
            merged.weight.copy_(self.base.weight + self.delta_weight())
            if self.base.bias is not None:
                merged.bias.copy_(self.base.bias)
        return merged


def lora_param_count(d: int, k: int, r: int) -> int:
    """Trainable numbers LoRA adds to one d x k matrix: B (d x r) plus A (r x k) = r (d + k)."""
    return r * (d + k)


def apply_lora(model: nn.Module, targets=("qkv", "proj"), r: int = 4, alpha: float = 8.0) -> list[str]:
    """Freeze every parameter of ``model``, then wrap the ``nn.Linear`` children whose attribute name is in
    ``targets`` with ``LoRALinear``. Returns the wrapped modules' qualified names."""
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped = []
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if name in targets and isinstance(child, nn.Linear):
                setattr(parent, name, LoRALinear(child, r=r, alpha=alpha))
                wrapped.append(f"{parent_name}.{name}" if parent_name else name)
    if not wrapped:
        raise ValueError(f"no nn.Linear named one of {targets} in the model: name layers that exist")
    return wrapped


def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every ``LoRALinear`` in ``model`` by its merged ``nn.Linear`` (in place); returns the model."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, LoRALinear):
                setattr(parent, name, child.merge())
    return model


def trainable_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@torch.no_grad()
def merged_copy_and_gap(model: nn.Module, tokens: torch.Tensor) -> tuple[nn.Module, float, float]:
    """Merge a deep copy of ``model`` (``merge_lora``; the adapter model is left as it is). Returns it, the
    max |logits(merged) - logits(adapted)| over ``tokens`` [n, s], and the max |logit| (the gap's scale).
    The gap is 0 up to fp32 rounding, because (W0 + s B A) x and W0 x + s B (A x) are the same sum taken
    in a different order."""
    merged = merge_lora(copy.deepcopy(model))
    adapted = model(tokens)  # [n, s, V]
    gap = (merged(tokens) - adapted).abs().max().item()
    return merged, gap, adapted.abs().max().item()
