"""The model a pipeline splits: a stack of ``layers`` Linear(h, h) layers, tanh between them.

Every rank builds the whole (tiny) model from one seed and keeps only its stage's layers, so the stages
are exactly the slices of the single-process reference (``reference.py``). The split is data: a partition
table of contiguous layer ranges, one row per stage (Megatron assigns layers the same way, contiguously).

Why not the course's GPT (``workers/model/gpt.py``, which chapter 15 pipelines): chapter 13 teaches schedules, and
a stack of equal layers makes every stage cost the same and every message the same size, so a timeline shows the
schedule's bubble and nothing else (no embedding on the first stage, no vocabulary-wide head on the last).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

FP32_TOL = {"atol": 1e-6, "rtol": 1e-5}  # pipeline vs one process: same math, other summation order


@dataclass(frozen=True)
class PipelineConfig:
    layers: int = 8
    hidden: int = 16
    micro_batch_size: int = 4  # rows per micro-batch
    micro_batches: int = 8  # m: micro-batches per optimizer step (the global batch is m x micro_batch_size)
    seed: int = 0

    @property
    def global_batch(self) -> int:
        return self.micro_batches * self.micro_batch_size

    def as_dict(self) -> dict:
        return asdict(self)


class Layer(nn.Module):
    """One pipeline-able layer: y = tanh(W x + b), the last one linear (a regression head)."""

    def __init__(self, hidden: int, last: bool):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        self.last = last

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [micro_batch, hidden] -> [micro_batch, hidden]
        y = self.linear(x)
        return y if self.last else torch.tanh(y)


def make_model(cfg: PipelineConfig) -> nn.Sequential:
    """The whole stack, from ``cfg.seed``: what the reference trains and every stage slices."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(cfg.seed)
    model = nn.Sequential(*[Layer(cfg.hidden, last=i == cfg.layers - 1) for i in range(cfg.layers)])
    torch.random.set_rng_state(gen_state)  # building the model must not move the caller's random stream
    return model


def partition_table(layers: int, num_stages: int) -> list[tuple[int, int]]:
    """``[(first_layer, last_layer_exclusive)]`` per stage: contiguous, equal ranges (layers / p each)."""
    if num_stages < 1 or layers % num_stages:
        raise ValueError(f"layers={layers} does not split into {num_stages} equal stages")
    per = layers // num_stages
    return [(s * per, (s + 1) * per) for s in range(num_stages)]


def stage_module(cfg: PipelineConfig, stage: int, num_stages: int) -> nn.Sequential:
    """Stage ``stage``'s layers, cut from the seeded whole model (same weights as the reference's)."""
    first, last = partition_table(cfg.layers, num_stages)[stage]
    return nn.Sequential(*list(make_model(cfg))[first:last])


def global_names(cfg: PipelineConfig, stage: int, num_stages: int, module: nn.Module) -> dict[str, torch.Tensor]:
    """This stage's parameters under the whole model's names ("5.linear.weight"), to set against the reference."""
    first, _ = partition_table(cfg.layers, num_stages)[stage]
    out = {}
    for name, p in module.named_parameters():
        index, rest = name.split(".", 1)
        out[f"{first + int(index)}.{rest}"] = p
    return out


def make_batch(cfg: PipelineConfig, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of optimizer step ``step``: inputs and targets, both [m * micro_batch_size, hidden]."""
    g = torch.Generator().manual_seed(cfg.seed * 1000 + 17 + step)
    x = torch.randn(cfg.global_batch, cfg.hidden, generator=g)  # [B, h]
    y = torch.randn(cfg.global_batch, cfg.hidden, generator=g) * 0.5  # [B, h]
    return x, y


def micro_batches(cfg: PipelineConfig, t: torch.Tensor) -> list[torch.Tensor]:
    """Split a global-batch tensor into m micro-batches of [micro_batch_size, hidden] (rows in order)."""
    return list(t.split(cfg.micro_batch_size))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.mean((output - target) ** 2)
