"""Chapter 02's model, data and single-process baseline: one definition for the ranks and the notebook.

The ranks (``workers/ch02_*.py``, ``workers/exercises/ch02.py``) build their model and read their rows from
here; the notebook trains the single-process baseline with the same functions. Nothing is copied between the two sides except the
seed, so "DDP equals the baseline" compares two independent computations of the same mathematics:

    single process:  g = (1/B) sum_{i<B} grad l_i                       (mean loss over the global batch)
    DDP, n ranks:    g = (1/n) sum_r (1/(B/n)) sum_{i in rows(r)} grad l_i   (all-reduce SUM, then / n)

which are the same number when every rank holds B/n rows. Only the order of the additions differs, so
fp32 results agree to rounding (``FP32_TOL``), not bit for bit.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
from workers.runtime import at_least, batch_over_world, refusal

# Weights of O(0.1-1) after a few SGD steps; reordered fp32 sums differ by a few ulp (~1e-7).
FP32_TOL = {"atol": 1e-6, "rtol": 1e-5}


@dataclass(frozen=True)
class Setup:
    """Everything that defines one training run; the same object on every rank and in the notebook."""

    d_in: int = 8
    d_hidden: int = 16
    d_out: int = 4
    global_batch: int = 16  # rows per optimizer step, over all ranks together
    steps: int = 5
    lr: float = 0.1
    seed: int = 0

    def as_params(self) -> dict:
        return asdict(self)


class TinyMLP(nn.Module):
    """x -> (x * in_scale) -> Linear -> tanh -> Linear. ``in_scale`` is a buffer (like BatchNorm's statistics):
    state that is not trained but must be the same on every rank, so DDP broadcasts it too."""

    def __init__(self, d_in: int, d_hidden: int, d_out: int):
        super().__init__()
        self.register_buffer("in_scale", torch.ones(d_in))
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x):  # [b, d_in] -> [b, d_out]
        return self.fc2(torch.tanh(self.fc1(x * self.in_scale)))


def make_model(setup: Setup = Setup(), seed: int | None = None) -> TinyMLP:
    """The model, on the CPU, initialised from ``seed`` (default ``setup.seed``) without touching the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(setup.seed if seed is None else seed)
        model = TinyMLP(setup.d_in, setup.d_hidden, setup.d_out)
        model.in_scale.copy_(1 + 0.1 * torch.randn(setup.d_in))
    return model


def make_stack(layers: int, width: int, seed: int = 0) -> nn.Sequential:
    """``layers`` square Linear layers with ReLU between them: a model whose gradient bytes are easy to count
    (each layer holds width*width + width fp32 numbers)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        mods: list[nn.Module] = []
        for i in range(layers):
            mods.append(nn.Linear(width, width))
            if i < layers - 1:
                mods.append(nn.ReLU())
        return nn.Sequential(*mods)


def make_batches(setup: Setup = Setup(), steps: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches of ``setup.global_batch`` rows: x ~ N(0, 1), y = a fixed smooth function of x."""
    g = torch.Generator().manual_seed(10_000 + setup.seed)  # data seed independent of the model seed
    teacher = torch.randn(setup.d_in, setup.d_out, generator=g)
    out = []
    for _ in range(setup.steps if steps is None else steps):
        x = torch.randn(setup.global_batch, setup.d_in, generator=g)  # [B, d_in]
        out.append((x, torch.sin(x @ teacher)))  # [B, d_out]
    return out


def rows_of(rank: int, world_size: int, global_batch: int) -> tuple[int, int]:
    """Rank ``rank`` reads rows [start, stop) of every global batch: B/n contiguous rows each."""
    if why := batch_over_world(global_batch, world_size):
        raise ValueError(why)
    per_rank = global_batch // world_size
    return rank * per_rank, (rank + 1) * per_rank


def shard(batch: tuple[torch.Tensor, torch.Tensor], rank: int, world_size: int):
    x, y = batch
    start, stop = rows_of(rank, world_size, x.shape[0])
    return x[start:stop], y[start:stop]  # [B/n, d_in], [B/n, d_out]


def loss_fn(output: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    return nn.functional.mse_loss(output, target, reduction=reduction)


def flat(tensors) -> torch.Tensor:
    """All of a model's parameters (or gradients) as one 1-D fp32 tensor on the CPU, in parameter order."""
    return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])


def flat_grads(model: nn.Module) -> torch.Tensor:
    return flat(p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters())


def grads_on(model: nn.Module, x: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """The flat gradient of the loss on (x, y) for a copy-free model (its .grad is reset first)."""
    model.zero_grad(set_to_none=True)
    loss_fn(model(x), y, reduction).backward()
    return flat_grads(model)


def train_single(setup: Setup = Setup()) -> dict:
    """The single-process baseline: one model, the whole global batch, plain SGD.

    Returns ``weights`` [steps + 1, P] (the initial weights, then after every step), ``grads`` [steps, P]
    and ``losses`` [steps] (mean loss over the global batch).
    """
    model = make_model(setup)
    opt = torch.optim.SGD(model.parameters(), lr=setup.lr)
    weights, grads, losses = [flat(model.parameters())], [], []
    for x, y in make_batches(setup):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        grads.append(flat_grads(model))
        opt.step()
        weights.append(flat(model.parameters()))
        losses.append(loss.item())
    return {"weights": torch.stack(weights), "grads": torch.stack(grads), "losses": torch.tensor(losses)}


def accumulated_reference(setup: Setup, accumulation: int) -> torch.Tensor:
    """The gradient of one big batch made of the first ``accumulation`` global batches (mean over all rows)."""
    model = make_model(setup)
    batches = make_batches(setup, steps=accumulation)
    x = torch.cat([b[0] for b in batches])  # [k*B, d_in]
    y = torch.cat([b[1] for b in batches])
    return grads_on(model, x, y)


def training_problem(world_size: int, global_batch: int, steps: int, lr: float) -> str | None:
    """One sentence if a data-parallel training run of chapter 02 cannot be laid out, else None (its workers'
    ``check_params`` start here)."""
    return refusal(batch_over_world(global_batch, world_size), at_least("steps", steps),
                   None if lr > 0 else f"lr={lr} must be positive")
