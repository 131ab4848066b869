"""What each replica trains on, keyed so that anyone can recompute it: a step's batch and dropout belong to (step,
replica), not to a process.

Chapter 08's model and data (``workers/checkpointing/training.py``: the two-layer MLP with dropout, the regression
problem, AdamW, warmup + cosine) in float64, cut for replicas that come and go. A process that dies takes its RNG
streams and its position in the data with it; a replacement that heals at step t gets the weights and AdamW's moments
from a live peer, but nothing of the dead process's streams. So nothing here is a stream: step ``k``'s rows for replica
``r`` are a slice of one permutation drawn from ``seed`` and ``k`` (every replica draws the same permutation and takes
its own slice: no row is in two replicas' batches of one step), its dropout mask is drawn from a seed made of
``(seed, k, r)``, and the learning rate is a function of ``k``. The same three functions drive the replicas and the
single-process ``reference`` below, which is what makes the quorum run checkable.

    data = make_data(cfg)
    batch = replica_batch(data, cfg, step, replica)      # {"x": [b, d_in], "y": [b, d_out], "key": int}
    loss = forward_loss(model, batch, step)              # the faults aim at this (workers/resilience/faults.py)
    weights, losses = reference(cfg, {1: [0, 1, 2], 2: [0, 1], ...})

Nothing here imports torchft or ``course_utils``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from workers.checkpointing.training import RunConfig, lr_factor, make_dataset, make_model


@dataclass(frozen=True)
class ReplicaConfig:
    replicas: int = 3  # replica groups the run is planned for (the lighthouse decides who is in each step)
    steps: int = 12
    batch: int = 4  # rows per replica per step: the effective batch is batch x the step's participants
    n_samples: int = 64
    dropout: float = 0.2
    lr: float = 3e-3
    warmup_steps: int = 3
    seed: int = 0

    def run_config(self) -> RunConfig:
        """Chapter 08's config with this run's sizes (its model width and dataset come from there)."""
        return RunConfig(n_samples=self.n_samples, global_batch=self.batch * self.replicas, dropout=self.dropout,
                         lr=self.lr, warmup_steps=self.warmup_steps, total_steps=self.steps, seed=self.seed)


def make_data(cfg: ReplicaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = make_dataset(cfg.run_config())
    return x.double(), y.double()  # [n, d_in], [n, d_out] float64


def make_replica_model(cfg: ReplicaConfig) -> nn.Module:
    """Every replica (and the reference) starts from the same weights: chapter 08's init from ``seed``, in float64."""
    return make_model(cfg.run_config()).double()


def make_inner_optimizer(model: nn.Module, cfg: ReplicaConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.run_config().weight_decay)


def set_lr(optimizer: torch.optim.Optimizer, cfg: ReplicaConfig, step: int) -> None:
    """The learning rate of step ``step`` (1-based): warmup + cosine as chapter 08's LambdaLR gives it, but computed
    from the step, so a replica that healed to step t needs no scheduler state of its own."""
    for group in optimizer.param_groups:
        group["lr"] = cfg.lr * lr_factor(step - 1, cfg.warmup_steps, cfg.steps)


def replica_batch(data, cfg: ReplicaConfig, step: int, replica: int) -> dict:
    """Replica ``replica``'s rows of step ``step``: its slice of the step's permutation, and its dropout seed."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    rows = torch.randperm(cfg.n_samples, generator=g)[replica * cfg.batch:(replica + 1) * cfg.batch]  # [b]
    return {"x": data[0][rows], "y": data[1][rows], "rows": rows,  # [b, d_in], [b, d_out], [b]
            "key": (cfg.seed * 1_000_003 + step) * 1_009 + replica}


def forward_loss(model: nn.Module, batch: dict, step: int) -> torch.Tensor:
    """Mean squared error of one replica's batch; the dropout mask drawn from the batch's key (``step``: the faults'
    aim). A module attribute on purpose: ``workers/resilience/faults.py`` replaces it for a run."""
    torch.manual_seed(batch["key"])  # the mask belongs to (step, replica): a replacement draws the one the dead would
    return nn.functional.mse_loss(model(batch["x"]), batch["y"])  # [b, d_out] -> []


def flat_weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).to("cpu") for p in model.parameters()])  # [P] float64


def eval_loss(model: nn.Module, data) -> float:
    """The loss on the whole dataset without dropout: a noise-free number to compare two training methods by."""
    was = model.training
    model.eval()
    with torch.no_grad():
        loss = nn.functional.mse_loss(model(data[0]), data[1]).item()  # [n, d_out] -> []
    model.train(was)
    return loss


def reference(cfg: ReplicaConfig, participation: dict[int, list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One process trains the quorum run: step ``k`` on the batches of the replicas ``participation[k]`` only.

    The gradient of a step is the mean over the replicas present, ``sum(g_r) / len(present)``: what torchft's
    ``Manager.allreduce`` computes (a SUM over the quorum, then a division by ``num_participants()``). When the quorum
    shrinks from 3 to 2, the average is over 2 batches: the step's effective batch shrinks, the gradient's scale does
    not. Returns the final weights [P] and each step's loss (the mean of the present replicas' losses) [steps]."""
    data = make_data(cfg)
    model = make_replica_model(cfg)
    optimizer = make_inner_optimizer(model, cfg)
    losses = []
    for step in sorted(participation):
        present = sorted(participation[step])
        set_lr(optimizer, cfg, step)
        total, step_losses = None, []
        for replica in present:
            model.zero_grad(set_to_none=True)
            loss = forward_loss(model, replica_batch(data, cfg, step, replica), step)
            loss.backward()
            grads = [p.grad.detach().clone() for p in model.parameters()]
            total = grads if total is None else [a + g for a, g in zip(total, grads)]
            step_losses.append(loss.item())
        for p, g in zip(model.parameters(), total):
            p.grad = g / len(present)
        optimizer.step()
        losses.append(sum(step_losses) / len(step_losses))
    return flat_weights(model), torch.tensor(losses, dtype=torch.float64)
