"""The small training run that chapter 08 checkpoints: one definition for the workers, the checkers and the tests.

Everything a real run has that a checkpoint must carry is here, in miniature:

- weights (a two-layer MLP) and **dropout**, whose masks come from torch's RNG;
- **AdamW**, whose two moments and step count live in the optimizer, not in the model;
- a **warmup + cosine** ``LambdaLR``, whose position lives in the scheduler;
- a **shuffled data order** with a position (``sampler.ShuffledSampler``);
- **augmentation** that draws from numpy (Gaussian input noise) and from python's ``random`` (one input
  feature zeroed per step), as data pipelines do: three RNG streams besides torch's, one per library;
- with ``precision="fp16"``: **fp16 autocast and a** ``torch.amp.GradScaler``, whose loss scale and count of
  good steps live in the scaler. ``growth_interval=2`` (GradScaler's default is 2000) lets the scale grow
  until the fp16 backward overflows within a 12-step run, so some steps are really skipped.

Each rank seeds its streams with ``seed + 1000 * rank``: ranks must draw *different* dropout masks and noise
(or data parallelism would repeat the same noise n times), so every rank's RNG state is its own, and a
checkpoint must hold one per rank.
"""
from __future__ import annotations

import math
import random
import warnings
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn as nn

from workers.checkpointing.sampler import ShuffledSampler


@dataclass(frozen=True)
class RunConfig:
    n_samples: int = 64  # 8 steps per epoch at global_batch 8: a 12-step run crosses an epoch boundary
    global_batch: int = 8
    d_in: int = 16
    d_hidden: int = 32
    d_out: int = 4
    dropout: float = 0.2
    input_noise: float = 0.1  # std of numpy's augmentation noise
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup_steps: int = 3
    total_steps: int = 12  # the cosine's length: part of the config a resumed run must agree on
    seed: int = 0
    precision: str = "fp32"  # or "fp16": autocast + GradScaler
    init_scale: float = 65536.0  # GradScaler's default initial loss scale, 2^16
    growth_interval: int = 2  # good steps in a row before the scale doubles (GradScaler's default: 2000)

    def as_dict(self) -> dict:
        return asdict(self)


class DropoutMLP(nn.Module):
    def __init__(self, d_in: int, d_hidden: int, d_out: int, dropout: float):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.dropout = nn.Dropout(dropout)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x):  # [b, d_in] -> [b, d_out]
        return self.fc2(self.dropout(nn.functional.gelu(self.fc1(x))))  # dropout on [b, d_hidden]


def make_model(cfg: RunConfig, seed: int | None = None) -> DropoutMLP:
    """The model on the CPU, initialised from ``seed`` (default ``cfg.seed``) without touching the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed if seed is None else seed)
        return DropoutMLP(cfg.d_in, cfg.d_hidden, cfg.d_out, cfg.dropout)


def make_dataset(cfg: RunConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed regression problem: x ~ N(0, 1) [n, d_in], y = sin(x @ teacher) [n, d_out], from its own generator."""
    g = torch.Generator().manual_seed(10_000 + cfg.seed)
    teacher = torch.randn(cfg.d_in, cfg.d_out, generator=g)
    x = torch.randn(cfg.n_samples, cfg.d_in, generator=g)
    return x, torch.sin(x @ teacher)


def make_optimizer(model: nn.Module, cfg: RunConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)


def lr_factor(step: int, warmup_steps: int, total_steps: int, floor: float = 0.1) -> float:
    """Linear warmup to 1 over ``warmup_steps``, then a cosine down to ``floor`` at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: RunConfig) -> torch.optim.lr_scheduler.LambdaLR:
    # A closure, not a callable object: LambdaLR.state_dict() then saves only its counters (last_epoch, the
    # last lr), which is all it needs; the function itself is rebuilt from the config.
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg.warmup_steps, cfg.total_steps))


def make_scaler(cfg: RunConfig, device_type: str = "cpu") -> torch.amp.GradScaler | None:
    """The loss scaler of an fp16 run (None in fp32: nothing to scale, nothing to save)."""
    if cfg.precision == "fp32":
        return None
    if cfg.precision != "fp16":
        raise ValueError(f"precision={cfg.precision!r}: choose 'fp32' or 'fp16'")
    return torch.amp.GradScaler(device_type, init_scale=cfg.init_scale, growth_interval=cfg.growth_interval)


def make_sampler(cfg: RunConfig, rank: int = 0, world_size: int = 1) -> ShuffledSampler:
    return ShuffledSampler(cfg.n_samples, cfg.global_batch, seed=cfg.seed, rank=rank, world_size=world_size)


def seed_rngs(seed: int) -> None:
    """Seed every stream the run draws from: python's, numpy's, torch's (CPU and every GPU)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rank_seed(cfg: RunConfig, rank: int) -> int:
    return cfg.seed + 1000 * rank  # each rank its own dropout masks and noise


def augment(x: torch.Tensor, cfg: RunConfig) -> tuple[torch.Tensor, int]:
    """Input noise from numpy, one feature zeroed by python's random: returns the batch and the zeroed feature."""
    noise = np.random.normal(0.0, cfg.input_noise, size=tuple(x.shape)).astype(np.float32)  # [b, d_in]
    dropped = random.randrange(x.shape[1])
    x = x + torch.from_numpy(noise)
    x[:, dropped] = 0.0
    return x, dropped


def next_batch(data, sampler: ShuffledSampler, cfg: RunConfig, device) -> dict:
    """Read this rank's rows of the next global batch and augment them; the dict keeps what was drawn."""
    idx = sampler.next_indices()  # [B/n]
    x, dropped = augment(data[0][idx], cfg)
    return {"indices": idx, "dropped": dropped, "x": x.to(device), "y": data[1][idx].to(device)}


def train_step(model: nn.Module, optimizer, scheduler, batch: dict, scaler=None) -> torch.Tensor:
    """One AdamW step on ``batch`` (model may be DDP-wrapped); the scheduler steps after the optimizer.

    With a ``scaler``: the forward under fp16 autocast, the backward of ``loss * scale``, and ``scaler.step``,
    which skips the optimizer step when a gradient is inf or NaN (on every rank: DDP all-reduced the inf). The
    scheduler steps either way, as most training loops do.
    """
    optimizer.zero_grad(set_to_none=True)
    if scaler is None:
        loss = nn.functional.mse_loss(model(batch["x"]), batch["y"])  # mean over this rank's B/n rows
        loss.backward()  # DDP averages the gradients here
        optimizer.step()
    else:
        with torch.autocast(batch["x"].device.type, dtype=torch.float16):
            loss = nn.functional.mse_loss(model(batch["x"]), batch["y"])  # matmuls in fp16, mse_loss in fp32
        scaler.scale(loss).backward()  # fp16 backward of loss * scale; DDP averages the fp32 .grad
        scaler.step(optimizer)  # unscales; skips optimizer.step() if any gradient is inf/NaN
        scaler.update()  # inf: scale * 0.5; growth_interval good steps in a row: scale * 2
    with warnings.catch_warnings():
        # a skipped *first* step makes LambdaLR warn that it stepped before the optimizer did: that is the point
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
        scheduler.step()
    return loss.detach()


def flat_params(model: nn.Module) -> torch.Tensor:
    """Every parameter as one fp32 CPU vector, in parameter order (for torch.equal across runs)."""
    return torch.cat([p.detach().reshape(-1).to("cpu", torch.float32) for p in model.parameters()])
