"""The router: a linear layer scoring every expert for every token, softmax, top-k, capacity, and the two
auxiliary losses that keep it healthy.

    logits = x W_r^T                    [T, E]   (no bias: Switch Transformer, Mixtral, Megatron's TopKRouter)
    probs  = softmax(logits)            [T, E]   in the input's dtype (float64 in the checks)
    top_k  -> weights, experts          [T, k]   the k largest probabilities; for k > 1 renormalised to sum to 1
                                                 (Mixtral: softmax over the top-k logits, the same thing); for
                                                 k = 1 the raw probability (Switch: renormalising one weight
                                                 would make it 1 and give the router no gradient)

**Capacity** (Switch Transformer, Fedus et al. 2021, sec. 2.2; GShard, Lepikhin et al. 2020, Algorithm 1): an
expert takes at most ``ceil(capacity_factor * T * k / E)`` of a group's T tokens; the rest of its queue is
dropped (the token's output from that expert is 0; the residual stream carries the token on). The queue order
is GShard's: every token's first choice before any token's second choice, tokens in order within a choice. The
group is what one rank routes (GShard's "group"): the one-process reference splits its batch into the same
groups, so it drops the same tokens.

**Load-balancing loss** (Switch eq. 4): ``aux = E * sum_i f_i * P_i`` with ``f_i`` the fraction of the batch's
token choices routed to expert i (counted before drops, as Megatron does) and ``P_i`` the mean router
probability of expert i. It is 1 at perfect balance and grows to E when one expert takes everything. Both are
statistics of the **global** batch: ``f_i`` comes from counts summed over every rank (an all-reduce), while
each rank's ``P_i`` is over its own tokens, whose average over ranks is the global mean; a loss built on one
rank's counts alone is another loss (Qiu et al. 2025, "Demons in the Detail: On Implementing Load Balancing
Loss for Training Specialized Mixture-of-Expert Models", sec. 3).

**Router z-loss** (ST-MoE, Zoph et al. 2022, eq. 5): ``mean_t (logsumexp_i logits_ti)^2``: keeps the router's
logits small, so its softmax stays in a range where rounding does not decide the top-k.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from workers.moe.config import MoEConfig


class TopKRouter(nn.Module):
    def __init__(self, cfg: MoEConfig, device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.experts, cfg.hidden, device=device, dtype=dtype))  # [E, h]

    def forward(self, x: torch.Tensor):
        """``x`` ``[T, h]`` -> (logits ``[T, E]``, probs ``[T, E]``, weights ``[T, k]``, experts ``[T, k]``)."""
        logits = F.linear(x, self.weight)  # [T, E]
        probs = torch.softmax(logits, dim=-1)  # [T, E]
        weights, experts = probs.topk(self.cfg.top_k, dim=-1)  # [T, k], largest first
        if self.cfg.top_k > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, probs, weights, experts


def keep_mask(experts: torch.Tensor, n_experts: int, capacity: int | None) -> torch.Tensor:
    """``[T, k]`` bool: which of a group's token choices fit in their expert's capacity (all, when dropless).

    The queue is choice-major (every first choice, then every second choice), tokens in order within a choice.
    """
    if capacity is None:
        return torch.ones_like(experts, dtype=torch.bool)
    tokens, k = experts.shape
    queue = experts.t().reshape(-1)  # [k T]: first choices of tokens 0..T-1, then second choices
    onehot = F.one_hot(queue, n_experts)  # [k T, E]
    position = (onehot.cumsum(dim=0) - 1).gather(1, queue[:, None]).squeeze(1)  # place in its expert's queue
    return (position < capacity).view(k, tokens).t()  # [T, k]


def tokens_per_expert(experts: torch.Tensor, n_experts: int, keep: torch.Tensor | None = None) -> torch.Tensor:
    """``[E]`` int64: token choices per expert (those kept, when ``keep`` is given)."""
    chosen = experts.reshape(-1) if keep is None else experts[keep]
    return torch.bincount(chosen, minlength=n_experts)


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor, cfg: MoEConfig, group=None,
                        local_statistics: bool = False) -> torch.Tensor:
    """This rank's term of the Switch loss, ``E * sum_i f_i * P_i^local`` (a scalar with the router's gradient).

    ``f`` is computed from the token counts of every rank in ``group`` (summed by an all-reduce; no gradient
    flows through a count), ``P^local`` over this rank's tokens. With equal tokens per rank, the average of the
    ranks' terms is the loss of the global batch, and so is its gradient once the ranks' gradients are averaged.
    ``local_statistics=True``: ``f`` from these tokens' counts alone (one process holding a whole batch; on ranks
    that hold parts of one, the fault ``aux_loss_local_statistics``).
    """
    counts = tokens_per_expert(experts, cfg.experts).to(probs.dtype)  # [E], before drops
    tokens = torch.tensor(float(experts.shape[0]), dtype=probs.dtype, device=probs.device)
    if not local_statistics and group_size(group) > 1:
        stats = torch.cat([counts, tokens[None]])
        dist.all_reduce(stats, group=group)
        counts, tokens = stats[:-1], stats[-1]
    f = counts / (tokens * cfg.top_k)  # [E], sums to 1
    return cfg.experts * (f * probs.mean(dim=0)).sum()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss over this rank's tokens: ``mean_t logsumexp(logits_t)^2``."""
    return (torch.logsumexp(logits, dim=-1) ** 2).mean()


def group_size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1
