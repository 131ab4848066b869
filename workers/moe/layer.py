"""The MoE layer on expert-parallel ranks, and the one-process reference it must equal.

    x [T, h] -> router -> (weights, experts) [T, k] -> capacity -> dispatch (all-to-all) -> my experts
             -> combine (all-to-all) -> y [T, h]  (+ the shared experts, on every token, on every rank)

Each expert is chapter 04's SwiGLU FFN (``workers/parallel/dense.py: DenseMLP``, fused ``[gate; up]``, no bias).
Every rank builds the whole layer from ``seed`` (``build_weights``) and keeps the router, the shared experts and
its own routed experts: EP rank r holds experts ``[r E/ep, (r+1) E/ep)`` under their global names
(``experts.5.fc1.weight``), so a rank's parameter and the reference's share one name.

Which ranks are which (``expert_groups``): the world's ranks are all data-parallel for the dense parameters
(router, shared experts: replicated everywhere, every rank routes its own tokens). For the experts the data-
parallel ranks are viewed as ``[edp, ep]``, ep innermost (Megatron-LM's expert grid, ``--order tp-cp-ep-dp-pp``
folds ep out of dp the same way): an EP group is ``ep`` consecutive ranks, an expert-data-parallel group the
ranks that hold the same experts.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from workers.moe.config import MoEConfig
from workers.moe.dispatch import MoEAlltoAllTokenDispatcher
from workers.moe.router import TopKRouter, keep_mask, load_balancing_loss, tokens_per_expert, z_loss
from workers.parallel.dense import DenseMLP
from workers.parallel.grid import RankGrid
from workers.runtime import collective_timeout

DRILLS = ("none", "router_not_reduced", "expert_grads_averaged_over_edp", "combine_order_not_restored",
          "aux_loss_local_statistics")


def expert_groups(world: int, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """(EP groups, expert-data-parallel groups) of ``world`` ranks: the dense data-parallel ranks viewed ``[edp, ep]``."""
    dense = RankGrid.for_world(world).groups("dp")[0]  # every rank replicates the dense parameters
    return [dense[i:i + ep] for i in range(0, world, ep)], [dense[j::ep] for j in range(ep)]


class ExpertParallelGroups:
    """This rank's EP and expert-data-parallel process groups (``with ExpertParallelGroups(world, ep, rank) as g``).

    Every rank creates every group, in the same order (``dist.new_group`` is collective over the world); a group
    of one rank is never created (its collectives would do nothing) and one of the whole world is the default
    group. The groups are destroyed on the way out: warm ranks outlive a run.
    """

    def __init__(self, world: int, ep: int, rank: int):
        self.world, self.ep, self.edp, self.rank = world, ep, world // ep, rank
        self.ep_rank, self.edp_rank = rank % ep, rank // ep  # place in the EP group, which EP group
        self.ep_group = self.edp_group = None  # None: the world (or a group of one, never used)
        self._created = []

    def __enter__(self) -> "ExpertParallelGroups":
        ep_groups, edp_groups = expert_groups(self.world, self.ep)
        for attr, groups in (("ep_group", ep_groups), ("edp_group", edp_groups)):
            if 1 < len(groups[0]) < self.world:
                for members in groups:
                    pg = dist.new_group(members, timeout=collective_timeout())  # never torch's 30 min
                    self._created.append(pg)
                    if self.rank in members:
                        setattr(self, attr, pg)
        return self

    def __exit__(self, *exc) -> None:
        for pg in self._created:
            dist.destroy_process_group(pg)
        self._created = []


def build_weights(cfg: MoEConfig, seed: int = 0, dtype=torch.float64) -> dict[str, torch.Tensor]:
    """The whole layer's parameters, a deterministic function of ``seed`` (every rank and the reference build it)."""
    gen = torch.Generator().manual_seed(seed)
    h, f = cfg.hidden, cfg.ffn

    def normal(*shape, fan_in):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) / fan_in ** 0.5).to(dtype)

    out = {"router.weight": normal(cfg.experts, h, fan_in=h)}  # [E, h]
    names = [f"experts.{e}" for e in range(cfg.experts)] + [f"shared.{s}" for s in range(cfg.shared_experts)]
    for name in names:
        out[f"{name}.fc1.weight"] = normal(2 * f, h, fan_in=h)  # [2 ffn, h]: [gate; up]
        out[f"{name}.fc2.weight"] = normal(h, f, fan_in=f)  # [h, ffn]
    return out


def _expert(cfg: MoEConfig, device, dtype) -> DenseMLP:
    return DenseMLP(cfg.hidden, cfg.ffn, "swiglu", bias=False, device=device, dtype=dtype)


@dataclass
class RoutingRecord:
    """What one forward routed, for the checks and the figures (detached)."""

    experts: torch.Tensor  # [T, k]
    weights: torch.Tensor  # [T, k]
    keep: torch.Tensor  # [T, k]
    counts: torch.Tensor  # [E] choices per expert on this rank, before drops
    aux: float = 0.0  # this rank's load-balancing term
    z: float = 0.0
    send_splits: list[int] = field(default_factory=list)
    recv_splits: list[int] = field(default_factory=list)
    tokens_per_local_expert: list[int] = field(default_factory=list)
    expert_cpu_s: float = 0.0  # CPU seconds this rank spent in its experts (process time: robust to a busy machine)
    combine_s: float = 0.0  # wall seconds in the combine's all-to-all: mostly waiting for the slowest rank


class MoELayer(nn.Module):
    """One MoE layer on this rank: ``forward(x [.., h]) -> y [.., h]``; ``aux_loss`` holds the auxiliary losses.

    ``groups``: this rank's ``ExpertParallelGroups`` (None: one process holding every expert). ``drill`` injects
    one of the known bugs (``DRILLS``).
    """

    def __init__(self, cfg: MoEConfig, groups: "ExpertParallelGroups | None" = None, *,
                 weights: dict[str, torch.Tensor] | None = None, seed: int = 0, device=None,
                 dtype=torch.float64, drill: str = "none"):
        super().__init__()
        if drill not in DRILLS:
            raise ValueError(f"drill={drill!r} is not one of {', '.join(DRILLS)}")
        ep, ep_rank = (groups.ep, groups.ep_rank) if groups else (1, 0)
        self.cfg, self.ep, self.ep_rank, self.drill = cfg, ep, ep_rank, drill
        self.local = list(range(ep_rank * cfg.experts // ep, (ep_rank + 1) * cfg.experts // ep))
        self.router = TopKRouter(cfg, device, dtype)
        self.experts = nn.ModuleDict({str(e): _expert(cfg, device, dtype) for e in self.local})
        self.shared = nn.ModuleDict({str(s): _expert(cfg, device, dtype) for s in range(cfg.shared_experts)})
        weights = build_weights(cfg, seed, dtype) if weights is None else weights
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(weights[name])
        self.dispatcher = MoEAlltoAllTokenDispatcher(cfg.experts, groups.ep_group if groups else None, ep, ep_rank,
                                                     restore_order=drill != "combine_order_not_restored")
        self.aux_loss = torch.zeros((), dtype=dtype, device=device)
        self.last: RoutingRecord | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [T, h]: the batch's tokens, wherever they sat
        logits, probs, weights, experts = self.router(x)  # [T, E], [T, E], [T, k], [T, k]
        keep = keep_mask(experts, self.cfg.experts, self.cfg.capacity(x.shape[0]))  # [T, k]
        # the aux statistics are over every token of the batch: the ranks that hold other tokens of it
        aux = load_balancing_loss(probs, experts, self.cfg, group=None,
                                  local_statistics=self.drill == "aux_loss_local_statistics")
        z = z_loss(logits)
        self.aux_loss = self.cfg.aux_coeff * aux + self.cfg.z_coeff * z
        rows, state = self.dispatcher.dispatch(x, experts, weights, keep)  # [R, h]
        t0 = time.process_time()
        outs, start = [], 0
        for e, n in zip(self.local, state.tokens_per_local_expert):  # each expert reads one contiguous block
            outs.append(self.experts[str(e)](rows[start:start + n]))  # [n, h]
            start += n
        expert_out = torch.cat(outs) if outs else rows  # [R, h]
        cpu_s = time.process_time() - t0
        y = self.dispatcher.combine(expert_out, state, x.shape[0])  # [T, h]
        for shared in self.shared.values():
            y = y + shared(x)
        self.last = RoutingRecord(experts.detach(), weights.detach(), keep, tokens_per_expert(experts, self.cfg.experts),
                                  aux.item(), z.item(), state.send_splits, state.recv_splits,
                                  state.tokens_per_local_expert, cpu_s, self.dispatcher.combine_s)
        return y.view(shape)

    def expert_parameters(self) -> list[nn.Parameter]:
        """The routed experts' parameters: averaged over the expert-data-parallel group (everything else over the
        world)."""
        return list(self.experts.parameters())


def reduce_gradients(layer_params, expert_params, groups: ExpertParallelGroups, drill: str = "none",
                     router_params=()) -> None:
    """Average gradients the way the loss is defined: the mean over the world's ranks of each rank's loss.

    A dense parameter saw one contribution per rank: all-reduce over the world, divide by the world's size. An
    expert's gradient already sums what every rank of its EP group routed to it (the all-to-all's backward brought
    those tokens' gradients home), so it is all-reduced over the expert-data-parallel group only, and divided by
    the world's size too, not by that group's: ``ep`` ranks' data reached it before any collective ran
    (Megatron-LM's ``expert_gradient_scaling_factor``; averaging over the expert-DP group alone, the drill
    ``expert_grads_averaged_over_edp``, leaves expert gradients ``ep`` times too large: Megatron-LM PR #5956).
    """
    experts = {id(p) for p in expert_params}
    router = {id(p) for p in router_params}
    dense, expert = [], []
    for p in layer_params:
        if p.grad is None or (drill == "router_not_reduced" and id(p) in router):
            continue  # the drill: the router's gradient left as this rank computed it
        (expert if id(p) in experts else dense).append(p.grad)
    _average(dense, groups.world, None, groups.world)
    divisor = groups.edp if drill == "expert_grads_averaged_over_edp" else groups.world
    _average(expert, groups.edp, groups.edp_group, divisor)


def _average(grads: list[torch.Tensor], size: int, group, divisor: int) -> None:
    """Sum ``grads`` over ``group`` (``size`` ranks) in one all-reduce of a flat copy, as DDP's buckets do, then
    divide by ``divisor``."""
    if not grads:
        return
    if size > 1:
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=group)
        for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(reduced)
    for g in grads:
        g.div_(divisor)


# -- the one-process reference ------------------------------------------------------------------------------------

def reference_forward(cfg: MoEConfig, weights: dict[str, torch.Tensor], x: torch.Tensor, groups: int):
    """The layer written token by token: ``x`` ``[T, h]`` (leaf tensors with gradients wanted) -> (y, records).

    The batch is split into ``groups`` equal, consecutive groups (one per rank of the parallel run: the unit the
    capacity counts in). In each group every token's choices join their expert's queue, first choices before
    second ones; a choice past its expert's capacity is dropped. Each token's output is the weighted sum of its
    kept experts' outputs, each expert applied to that one token, plus the shared experts. The load-balancing
    loss uses the whole batch's counts and probabilities; the z-loss the whole batch's mean.
    Returns ``y`` ``[T, h]`` and, per group, ``(experts [t, k], keep [t, k])``, and the two losses.
    """
    w = weights
    tokens = x.shape[0]
    per = tokens // groups
    swiglu = lambda name, t: w[f"{name}.fc2.weight"] @ _silu_gate(w[f"{name}.fc1.weight"] @ t)  # noqa: E731
    rows, records, all_probs, all_experts, log_z = [], [], [], [], []
    for g in range(groups):
        queue_len = [0] * cfg.experts
        cap = cfg.capacity(per)
        choices = []
        for t in range(g * per, (g + 1) * per):
            logits = w["router.weight"] @ x[t]  # [E]
            probs = torch.softmax(logits, dim=0)
            top = sorted(range(cfg.experts), key=lambda e: -float(probs[e].detach()))[:cfg.top_k]
            gate = probs[top] / probs[top].sum() if cfg.top_k > 1 else probs[top]
            choices.append((t, top, gate))
            all_probs.append(probs)
            all_experts += top
            log_z.append(torch.logsumexp(logits, dim=0))
        kept = {}
        for j in range(cfg.top_k):  # every first choice before any second choice
            for t, top, _ in choices:
                e = top[j]
                kept[(t, j)] = cap is None or queue_len[e] < cap
                queue_len[e] += 1
        for t, top, gate in choices:
            y = sum(swiglu(f"shared.{s}", x[t]) for s in range(cfg.shared_experts)) if cfg.shared_experts \
                else torch.zeros_like(x[t])
            for j, e in enumerate(top):
                if kept[(t, j)]:
                    y = y + gate[j] * swiglu(f"experts.{e}", x[t])
            rows.append(y)
        records.append((torch.tensor([c[1] for c in choices]),
                        torch.tensor([[kept[(t, j)] for j in range(cfg.top_k)] for t, _, _ in choices])))
    counts = torch.bincount(torch.tensor(all_experts), minlength=cfg.experts).to(x.dtype)
    f = counts / (tokens * cfg.top_k)
    aux = cfg.experts * (f * torch.stack(all_probs).mean(dim=0)).sum()
    z = (torch.stack(log_z) ** 2).mean()
    return torch.stack(rows), records, aux, z


def _silu_gate(h2: torch.Tensor) -> torch.Tensor:
    gate, up = h2.chunk(2)
    return torch.nn.functional.silu(gate) * up
