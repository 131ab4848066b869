"""Mixed precision on real ranks: loss scaling under DDP, gradient underflow, fp32 master weights.

    torchrun --nproc-per-node 2 workers/ch08_precision.py --part loss_scaling --inf-steps 10 --inf-rank 1
    torchrun --nproc-per-node 1 workers/ch08_precision.py --part underflow
    torchrun --nproc-per-node 1 workers/ch08_precision.py --part master_weights

``loss_scaling``: a small MLP trained with fp16 autocast and a real ``torch.amp.GradScaler`` under
    DistributedDataParallel. At the steps in ``inf_steps`` one gradient element of ``inf_rank`` (-1: every
    rank) is set to inf (or NaN) before DDP all-reduces it. The all-reduce spreads it, so every rank's
    ``scaler.step`` finds it and every rank skips the same step; ``scaler.update`` halves the scale. A small
    ``growth_interval`` lets the scale double until the fp16 backward overflows on its own, then back off:
    the sawtooth of Micikevicius et al. 2018 ("Mixed Precision Training", ICLR, sec 3.2), in ~50 steps.
``underflow`` and ``master_weights`` need no communication: ``workers/precision/numerics.py``.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from workers.precision.numerics import master_weights, underflow
from workers.runtime import at_least, entrypoint, one_of, refusal

PARTS = ("loss_scaling", "underflow", "master_weights")
INJECT = {"inf": float("inf"), "nan": float("nan")}
# steps=0 / lr=0 pick these: the scale's sawtooth shows in ~50 steps; bf16 stagnation needs a slower descent.
PART_DEFAULTS = {"loss_scaling": {"steps": 48, "lr": 0.1}, "master_weights": {"steps": 150, "lr": 0.1},
                 "underflow": {"steps": 1, "lr": 0.0}}  # underflow: one backward, no optimizer step


def _steps_lr(part: str, steps: int, lr: float) -> tuple[int, float]:
    return steps or PART_DEFAULTS[part]["steps"], lr or PART_DEFAULTS[part]["lr"]


def check_params(world_size, part, steps, lr, init_scale, growth_factor, backoff_factor, growth_interval,
                 inf_steps, inf_rank, inject, batch_per_rank, loss_scale, tokens_per_rank, tokens_per_step, **_):
    steps_ok = 0 <= steps <= 2000
    run_steps = _steps_lr(part, steps, lr)[0] if part in PARTS else steps  # 0: the part's default
    bad_inf_steps = part == "loss_scaling" and steps_ok and \
        any(not isinstance(s, int) or not 0 <= s < run_steps for s in inf_steps)
    return refusal(
        one_of("part", part, PARTS),
        None if steps_ok else f"steps={steps}: use 1 to 2000 steps (or 0 for the part's default)",
        (why := at_least("lr", lr, 0)) and f"{why} (0 takes the part's default)",
        None if init_scale > 0 else f"init_scale={init_scale} must be positive (GradScaler's first scale)",
        None if growth_factor > 1 else
        f"growth_factor={growth_factor} must be above 1 (GradScaler grows the scale by it)",
        None if 0 < backoff_factor < 1 else
        f"backoff_factor={backoff_factor} must be between 0 and 1 (GradScaler shrinks the scale by it on an overflow)",
        (why := at_least("growth_interval", growth_interval)) and
        f"{why} (GradScaler's good steps in a row before the scale grows)",
        f"inf_steps={list(inf_steps)} must be step numbers from 0 to steps - 1 = {run_steps - 1}"
        if bad_inf_steps else None,
        None if -1 <= inf_rank < world_size else
        (f"inf_rank={inf_rank} is not a rank of a world of {world_size}: use 0 to {world_size - 1}, "
         "or -1 for every rank"),
        one_of("inject", inject, INJECT), at_least("batch_per_rank", batch_per_rank),
        at_least("tokens_per_rank", tokens_per_rank),
        None if tokens_per_step >= tokens_per_rank else
        (f"tokens_per_step={tokens_per_step} counts every token of the step, so it cannot be smaller than "
         f"this rank's tokens_per_rank={tokens_per_rank}"),
        None if loss_scale > 0 else f"loss_scale={loss_scale} must be positive")


# -- loss scaling under DDP ------------------------------------------------------------------------------

class MLP(nn.Module):
    def __init__(self, d_in: int = 16, d_hidden: int = 32, d_out: int = 4):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x):  # [b, d_in] -> [b, d_out]
        return self.fc2(torch.tanh(self.fc1(x)))


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])


def loss_scaling(ctx, steps: int, lr: float, scaler_args: dict, inf_steps: list, inf_rank: int, inject: str,
                 batch_per_rank: int, seed: int) -> dict:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MLP().to(ctx.device)  # the same initial weights on every rank (DDP broadcasts them anyway)
    ddp = DDP(model, device_ids=[ctx.device.index] if ctx.is_cuda else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    scaler = torch.amp.GradScaler(ctx.device.type, **scaler_args)

    # This rank's own gradient, as DDP hands it to the all-reduce: was it finite before the ranks mixed?
    local_finite: list[bool] = []

    def record_then_all_reduce(_, bucket):
        local_finite.append(bool(torch.isfinite(bucket.buffer()).all()))
        return allreduce_hook(None, bucket)  # DDP's own: divide by world size, all-reduce SUM

    ddp.register_comm_hook(None, record_then_all_reduce)

    step_now = {"step": -1}
    corrupt_here = inf_rank in (-1, ctx.rank)

    def inject_bad_gradient(grad):  # a tensor hook: runs before the gradient reaches DDP's reducer
        if corrupt_here and step_now["step"] in inf_steps:
            grad = grad.clone()
            grad.view(-1)[0] = INJECT[inject]
        return grad

    model.fc1.weight.register_hook(inject_bad_gradient)

    g = torch.Generator().manual_seed(1000 * seed + ctx.rank)  # each rank reads its own rows
    d_in, d_out = model.fc1.in_features, model.fc2.out_features
    teacher = torch.randn(d_in, d_out, generator=torch.Generator().manual_seed(seed + 1))  # one target everywhere
    out = {k: [] for k in ("loss", "scale", "skipped", "local_finite", "scale_after", "growth_tracker")}
    weights = [_flat(model.parameters())]
    for step in range(steps):
        step_now["step"] = step
        x = torch.randn(batch_per_rank, d_in, generator=g)  # [b, d_in]
        x, y = x.to(ctx.device), torch.sin(x @ teacher).to(ctx.device)  # [b, d_out]
        opt.zero_grad(set_to_none=True)
        with torch.autocast(ctx.device.type, dtype=torch.float16):
            loss = nn.functional.mse_loss(ddp(x), y)  # matmuls in fp16; autocast runs mse_loss in fp32
        scale = scaler.get_scale()
        local_finite.clear()
        scaler.scale(loss).backward()  # fp16 backward of (loss * scale); DDP all-reduces fp32 .grad
        scaler.unscale_(opt)  # .grad /= scale, and records whether any element is inf or NaN
        finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())  # measured, not asked of the scaler
        scaler.step(opt)  # skips opt.step() when unscale_ found inf/NaN
        scaler.update()  # backoff on inf; growth after growth_interval good steps in a row
        weights.append(_flat(model.parameters()))
        out["loss"].append(loss.item())
        out["scale"].append(scale)
        out["skipped"].append(not finite)
        out["local_finite"].append(all(local_finite))
        out["scale_after"].append(scaler.get_scale())
        out["growth_tracker"].append(int(scaler.state_dict()["_growth_tracker"]))
        ctx.metric(step=step, loss=loss.item(), scale=scale, skipped=not finite)
    out["weights"] = torch.stack(weights)  # [steps + 1, P]
    out.update(scaler_args=dict(scaler_args), inf_steps=list(inf_steps), inf_rank=inf_rank, inject=inject,
               steps=steps, lr=lr)
    return out


def main(ctx, part: str = "loss_scaling", steps: int = 0, lr: float = 0.0, init_scale: float = 65536.0,
         growth_factor: float = 2.0, backoff_factor: float = 0.5, growth_interval: int = 4, inf_steps: list = [10],
         inf_rank: int = -1, inject: str = "inf", batch_per_rank: int = 16, loss_scale: float = 65536.0,
         tokens_per_rank: int = 512, tokens_per_step: int = 2**20, seed: int = 0):
    """Run one part: loss_scaling (DDP), underflow or master_weights (one process per rank, no communication).

    ``steps=0`` and ``lr=0`` take the part's defaults (PART_DEFAULTS)."""
    steps, lr = _steps_lr(part, steps, lr)
    if part == "loss_scaling":
        scaler_args = dict(init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                           growth_interval=growth_interval)
        return loss_scaling(ctx, steps, lr, scaler_args, list(inf_steps), inf_rank, inject, batch_per_rank, seed)
    if part == "underflow":
        return underflow(ctx, loss_scale, tokens_per_rank, tokens_per_step, seed)
    return master_weights(ctx, steps, lr, seed)


if __name__ == "__main__":
    entrypoint(main)
