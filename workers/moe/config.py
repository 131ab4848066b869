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
        from workers.runtime import at_least, batch_over_world, divides, divides_world, refusal

        shape = refusal(at_least("hidden", self.hidden), at_least("ffn", self.ffn), at_least("experts", self.experts))
        if shape:
            return shape
        experts = divides("ep", ep, "experts", self.experts)
        return refusal(
            None if 1 <= self.top_k <= self.experts else
            (f"top_k={self.top_k} must be between 1 and experts={self.experts}: a token cannot choose more "
             "experts than there are"),
            (low := at_least("capacity_factor", self.capacity_factor, 0)) and f"{low} (0: no token dropped)",
            at_least("aux_coeff", self.aux_coeff, 0), at_least("z_coeff", self.z_coeff, 0),
            at_least("shared_experts", self.shared_experts, 0),
            experts and f"{experts} (every expert-parallel rank holds the same number of experts)",
            None if world is None else divides_world("ep", ep, world),
            None if world is None or tokens is None else batch_over_world(tokens, world, "tokens"))

    def capacity(self, tokens: int) -> int | None:
        """Slots per expert for ``tokens`` tokens of one group (None: dropless). Switch Transformer's
        ``capacity = tokens / experts * capacity_factor``, times k for top-k (GShard: each token takes k slots)."""
        if not self.capacity_factor:
            return None
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.experts)

    def as_dict(self) -> dict:
        return asdict(self)
