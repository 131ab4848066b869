"""Chapter 09's tiny GPT with an MoE FFN in every block, trained on expert-parallel ranks.

Each block's MLP becomes a ``MoELayer`` (its own router and experts, built from ``seed`` and the block's index);
everything else is the course's GPT (``workers/model/gpt.py``, made by ``make_model``'s ``mlp`` factory, so every
other weight is the dense model's) and chapter 09's data (the seeded Markov chain). Rank r of W
reads its B/W samples of each global batch; the loss is its tokens' mean cross-entropy plus every layer's
auxiliary losses; gradients are averaged by ``layer.reduce_gradients`` (dense over the world, experts over their
expert-data-parallel group, both divided by W); AdamW steps on every rank.

Each step reports, for the whole batch (counts all-reduced): tokens per expert in every layer, the fraction of
token choices dropped (zero when dropless), the fraction that *would* be dropped at each capacity factor of
``CAPACITY_FACTORS`` (from the same routing, GShard's queue order, per rank's group), the load-balancing loss,
the bytes each rank's dispatch all-to-alls sent to other ranks, and the CPU seconds each rank spent in its experts (the rank with the busiest experts sets the step's pace: the
others wait for it in the combine's all-to-all).
"""
from __future__ import annotations

import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from workers.gpt.data import Loader, MarkovDataset, rank_rows
from workers.model import GPTConfig, make_model
from workers.moe.config import MoEConfig
from workers.layout import Mesh
from workers.moe.layer import MoELayer, reduce_gradients
from workers.moe.router import keep_mask

CAPACITY_FACTORS = (1.0, 1.25, 1.5, 2.0)


def make_moe_gpt(gcfg: GPTConfig, moe: MoEConfig, mesh: Mesh | None, seed: int = 0,
                 device="cpu"):
    """The course's GPT (fp32, nanoGPT's init from ``seed``) with block i's MLP an MoE layer."""
    return make_model(gcfg, seed=seed, device=device,
                      mlp=lambda i: MoELayer(moe, mesh, seed=seed * 1000 + i + 1, device=device, dtype=torch.float32))


class MoETrainer:
    def __init__(self, gcfg: GPTConfig, moe: MoEConfig, mesh: Mesh, *, steps: int,
                 global_batch: int, lr: float, seed: int = 0, data_seed: int = 1234, device="cpu"):
        self.gcfg, self.moe, self.mesh, self.global_batch = gcfg, moe, mesh, global_batch
        self.rank, self.world = mesh.rank, mesh.grid.world
        self.model = make_moe_gpt(gcfg, moe, mesh, seed, device)
        self.layers = [block.mlp for block in self.model.blocks]
        self.expert_params = [p for layer in self.layers for p in layer.expert_parameters()]
        self.router_params = [p for layer in self.layers for p in layer.router.parameters()]
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0, foreach=True)
        self.data = MarkovDataset(gcfg.vocab, gcfg.seq, steps * global_batch, data_seed)
        self.loader = Loader(steps * global_batch, global_batch)
        self.device = torch.device(device)

    def step(self) -> dict:
        tokens = self.data.batch(rank_rows(self.loader.next_ids(), self.rank, self.world)).to(self.device)  # [B/W, s+1]
        t0 = time.perf_counter()
        logits = self.model(tokens[:, :-1])  # [B/W, s, V]
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        aux = sum(layer.aux_loss for layer in self.layers)
        self.opt.zero_grad(set_to_none=True)
        (ce + aux).backward()
        reduce_gradients(self.model.parameters(), self.expert_params, self.mesh, router_params=self.router_params)
        self.opt.step()
        step_s = time.perf_counter() - t0
        return self._record(ce.detach(), step_s)

    def _record(self, ce: torch.Tensor, step_s: float) -> dict:
        """The step's routing over the whole batch: one all-reduce of every count, one all-gather of timings."""
        n = self.moe.experts
        records = [layer.last for layer in self.layers]
        choices = records[0].experts.numel()  # this rank's token choices per layer
        would_drop = [[int((~keep_mask(r.experts, n, replace(self.moe, capacity_factor=c).capacity(len(r.experts))))
                            .sum()) for c in CAPACITY_FACTORS] for r in records]  # [L, len(CAPACITY_FACTORS)]
        stats = torch.cat([torch.stack([r.counts for r in records]).reshape(-1).double(),  # [L E]
                           torch.tensor([int((~r.keep).sum()) for r in records], dtype=torch.float64),  # [L]
                           torch.tensor(would_drop, dtype=torch.float64).reshape(-1),
                           torch.tensor([r.aux for r in records] + [float(ce), choices], dtype=torch.float64)])
        # bytes this rank's dispatch all-to-alls sent to other ranks, all layers (the combine sends as many back)
        ep_rank = self.layers[0].ep_rank
        rows_out = sum(sum(r.send_splits) - r.send_splits[ep_rank] for r in records)
        sent = rows_out * self.gcfg.hidden * 4  # fp32 activations
        cpu = torch.tensor([sum(r.expert_cpu_s for r in records), step_s, sent], dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(stats)
            gathered = [torch.empty_like(cpu) for _ in range(self.world)]
            dist.all_gather(gathered, cpu)
            cpu = torch.stack(gathered)  # [W, 3]
        else:
            cpu = cpu[None]
        L, W, F_ = len(records), self.world, len(CAPACITY_FACTORS)
        counts = stats[:L * n].view(L, n)
        dropped = stats[L * n:L * n + L]
        would = stats[L * n + L:L * n + L + L * F_].view(L, F_)
        tail = stats[L * n + L + L * F_:]
        total_choices = float(tail[-1])  # per layer, over the world
        return {"loss": float(tail[-2]) / W, "aux": [float(a) / W for a in tail[:L]],
                "counts": counts.long().tolist(), "dropped": (dropped / total_choices).tolist(),
                "would_drop": (would / total_choices).tolist(),
                "max_load": [float(c.max() / (c.sum() / n)) for c in counts],  # busiest expert / perfectly even
                "expert_cpu_s": cpu[:, 0].tolist(), "step_s": cpu[:, 1].tolist(),
                "dispatch_bytes": [int(b) for b in cpu[:, 2].tolist()]}
