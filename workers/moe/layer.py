"""The MoE layer on expert-parallel ranks, and the one-process reference it must equal.

    x [T, h] -> router -> (weights, experts) [T, k] -> capacity -> dispatch (all-to-all) -> my experts
             -> combine (all-to-all) -> y [T, h]  (+ the shared experts, on every token, on every rank)

Each expert is chapter 04's SwiGLU FFN (``workers/model/dense.py: DenseMLP``, fused ``[gate; up]``, no bias).
Every rank builds the whole layer from ``seed`` (``build_weights``) and keeps the router, the shared experts and
its own routed experts: EP rank r holds experts ``[r E/ep, (r+1) E/ep)`` under their global names
(``experts.5.fc1.weight``), so a rank's parameter and the reference's share one name.

Which ranks are which: the world's ranks are all data-parallel for the dense parameters (router, shared experts:
replicated everywhere, every rank routes its own tokens). For the experts the data-parallel ranks are viewed as
``[edp, ep]``, ep innermost (Megatron-LM's expert grid, ``--order tp-cp-ep-dp-pp`` folds ep out of dp the same
way): an EP group is ``ep`` consecutive ranks, an expert-data-parallel group the ranks that hold the same experts.
The course's rank grid carves them out of dp x cp (``workers/layout/grid.py``) and its one group holder makes them:
``Mesh(RankGrid.for_world(world, ep=ep), rank, EXPERT_GROUPS)``.

Chapter 16's injected faults (``workers/moe/faults.py``) replace one method or function here each: the layer never
branches on a fault's name.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from workers.layout import Mesh, RankGrid
from workers.layout.grid import EXPERT_GROUPS
from workers.model.dense import DenseMLP
from workers.moe.config import MoEConfig
from workers.moe.dispatch import MoEAlltoAllTokenDispatcher
from workers.moe.router import TopKRouter, keep_mask, load_balancing_loss, tokens_per_expert, z_loss


def expert_mesh(world: int, ep: int, rank: int) -> Mesh:
    """This rank's EP and expert-data-parallel groups (``with expert_mesh(world, ep, rank) as mesh``)."""
    return Mesh(RankGrid.for_world(world, ep=ep), rank, EXPERT_GROUPS)


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
    dispatch_s: float = 0.0  # wall seconds from the forward's start to the experts' (routing, the dispatch all-to-all)
    expert_s: float = 0.0  # wall seconds in this rank's experts


class MoELayer(nn.Module):
    """One MoE layer on this rank: ``forward(x [.., h]) -> y [.., h]``; ``aux_loss`` holds the auxiliary losses.

    ``mesh``: this rank's ``expert_mesh`` (None: one process holding every expert).
    """

    def __init__(self, cfg: MoEConfig, mesh: Mesh | None = None, *,
                 weights: dict[str, torch.Tensor] | None = None, seed: int = 0, device=None,
                 dtype=torch.float64):
        super().__init__()
        ep, ep_rank = (mesh.size("ep"), mesh.rank_in("ep")) if mesh else (1, 0)
        self.cfg, self.ep, self.ep_rank = cfg, ep, ep_rank
        self.local = list(range(ep_rank * cfg.experts // ep, (ep_rank + 1) * cfg.experts // ep))
        self.router = TopKRouter(cfg, device, dtype)
        self.experts = nn.ModuleDict({str(e): _expert(cfg, device, dtype) for e in self.local})
        self.shared = nn.ModuleDict({str(s): _expert(cfg, device, dtype) for s in range(cfg.shared_experts)})
        weights = build_weights(cfg, seed, dtype) if weights is None else weights
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(weights[name])
        self.dispatcher = MoEAlltoAllTokenDispatcher(cfg.experts, mesh.group("ep") if mesh else None, ep, ep_rank)
        self.aux_loss = torch.zeros((), dtype=dtype, device=device)
        self.last: RoutingRecord | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        start_s = time.perf_counter()
        x = x.reshape(-1, shape[-1])  # [T, h]: the batch's tokens, wherever they sat
        logits, probs, weights, experts = self.router(x)  # [T, E], [T, E], [T, k], [T, k]
        keep = keep_mask(experts, self.cfg.experts, self.cfg.capacity(x.shape[0]))  # [T, k]
        aux = self.balance_loss(probs, experts)
        z = z_loss(logits)
        self.aux_loss = self.cfg.aux_coeff * aux + self.cfg.z_coeff * z
        rows, state = self.dispatcher.dispatch(x, experts, weights, keep)  # [R, h]
        t0, cpu0 = time.perf_counter(), time.process_time()
        outs, start = [], 0
        for e, n in zip(self.local, state.tokens_per_local_expert):  # each expert reads one contiguous block
            outs.append(self.experts[str(e)](rows[start:start + n]))  # [n, h]
            start += n
        expert_out = torch.cat(outs) if outs else rows  # [R, h]
        cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - t0
        y = self.dispatcher.combine(expert_out, state, x.shape[0])  # [T, h]
        for shared in self.shared.values():
            y = y + shared(x)
        self.last = RoutingRecord(experts.detach(), weights.detach(), keep, tokens_per_expert(experts, self.cfg.experts),
                                  aux.item(), z.item(), state.send_splits, state.recv_splits,
                                  state.tokens_per_local_expert, cpu_s, self.dispatcher.combine_s,
                                  dispatch_s=t0 - start_s, expert_s=wall_s)
        return y.view(shape)

    def balance_loss(self, probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The Switch load-balancing term, its counts over every token of the batch (group None: the whole world, the
        ranks that hold the batch's other tokens)."""
        return load_balancing_loss(probs, experts, self.cfg, group=None)

    def expert_parameters(self) -> list[nn.Parameter]:
        """The routed experts' parameters: averaged over the expert-data-parallel group (everything else over the
        world)."""
        return list(self.experts.parameters())


def reduce_gradients(layer_params, expert_params, mesh: Mesh, router_params=()) -> None:
    """Average gradients the way the loss is defined: the mean over the world's ranks of each rank's loss.

    A dense parameter saw one contribution per rank: all-reduce over the world, divide by the world's size. An
    expert's gradient already sums what every rank of its EP group routed to it (the all-to-all's backward brought
    those tokens' gradients home), so it is all-reduced over the expert-data-parallel group only, and divided by
    the world's size too, not by that group's: ``ep`` ranks' data reached it before any collective ran
    (Megatron-LM's ``expert_gradient_scaling_factor``; averaging over the expert-DP group alone, the fault
    ``expert_grads_averaged_over_edp``, leaves expert gradients ``ep`` times too large: Megatron-LM PR #5956).
    """
    experts = {id(p) for p in expert_params}
    dense, expert = [], []
    for p in layer_params:
        if p.grad is not None:
            (expert if id(p) in experts else dense).append(p)
    world = mesh.grid.world
    _average([p.grad for p in dense_to_average(dense, router_params)], world, None, world)
    _average([p.grad for p in expert], mesh.size("edp"), mesh.group("edp"), expert_divisor(mesh))


def dense_to_average(dense: list, router_params) -> list:
    """The dense parameters whose gradients are averaged over the world: all of them, the router's included."""
    return dense


def expert_divisor(mesh: Mesh) -> int:
    """What an expert's summed gradient is divided by: the world's size (see ``reduce_gradients``)."""
    return mesh.grid.world


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
