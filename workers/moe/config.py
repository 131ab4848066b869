"""The shape of one MoE layer, and what makes a layer and an expert-parallel size impossible.

Names follow the course's one spelling of a model's shape (``hidden``, ``ffn``) plus the MoE fields, in the
order of Megatron-LM's ``TransformerConfig`` (``num_moe_experts``, ``moe_router_topk``,
``moe_expert_capacity_factor``, ``moe_aux_loss_coeff``, ``moe_z_loss_coeff``, ``moe_shared_expert_intermediate_size``).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class MoEConfig:
    hidden: int = 16
    ffn: int = 32  # each expert's SwiGLU width: h -> [gate; up] 2 ffn -> ffn -> h
    experts: int = 4
    top_k: int = 2
    capacity_factor: float = 0.0  # 0: dropless; c > 0: each expert takes at most ceil(c * tokens * k / experts)
    aux_coeff: float = 0.0  # the load-balancing loss's weight (Switch Transformer, Fedus et al. 2021, eq. 4)
    z_coeff: float = 0.0  # the router z-loss's weight (ST-MoE, Zoph et al. 2022, eq. 5)
    shared_experts: int = 0  # experts every token goes through (DeepSeekMoE, Dai et al. 2024): 0 or more

    def problem(self, ep: int = 1, world: int | None = None, tokens: int | None = None) -> str | None:
        """One sentence naming what to change, or None. ``tokens``: the tokens of the whole batch."""
        if min(self.hidden, self.ffn, self.experts) < 1:
            return f"hidden={self.hidden}, ffn={self.ffn} and experts={self.experts} must be >= 1"
        if not 1 <= self.top_k <= self.experts:
            return (f"top_k={self.top_k} must be between 1 and experts={self.experts}: a token cannot choose more "
                    "experts than there are")
        if self.capacity_factor < 0 or self.aux_coeff < 0 or self.z_coeff < 0 or self.shared_experts < 0:
            return (f"capacity_factor={self.capacity_factor}, aux_coeff={self.aux_coeff}, z_coeff={self.z_coeff} "
                    f"and shared_experts={self.shared_experts} must be >= 0 (capacity_factor 0: no token dropped)")
        if ep < 1 or self.experts % ep:
            return (f"experts={self.experts} is not divisible by ep={ep}: every expert-parallel rank holds the same "
                    f"number of experts, so choose ep among {', '.join(str(d) for d in divisors(self.experts))}")
        if world is not None and (world % ep):
            return f"ep={ep} does not divide the world's {world} ranks: choose ep among {', '.join(str(d) for d in divisors(world))}"
        if world is not None and tokens is not None and tokens % world:
            return f"the batch's {tokens} tokens do not split evenly over {world} ranks: choose a batch divisible by {world}"
        return None

    def capacity(self, tokens: int) -> int | None:
        """Slots per expert for ``tokens`` tokens of one group (None: dropless). Switch Transformer's
        ``capacity = tokens / experts * capacity_factor``, times k for top-k (GShard: each token takes k slots)."""
        if not self.capacity_factor:
            return None
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.experts)

    def as_dict(self) -> dict:
        return asdict(self)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
