"""ZeRO-2 on real ranks (issue 16): gradients reduce-scattered from inside backward, against one process.

    torchrun --nproc-per-node 4 workers/ch11_zero2.py --bucket-cap-mb 0.01

Every rank trains the tied-embedding GPT of ``workers/zero/model.py`` on its B/n rows of each global batch with
``Zero2Optimizer`` (AdamW), and also trains, alone, the single-process reference (whole batch, plain AdamW).
Each rank reports the largest difference from the reference after every step, whether its weights equal rank 0's
bit for bit, the bytes it holds (optimizer state, gradient shards, the peak of whole gradients during backward,
against one whole gradient), the bytes it sent per collective, and when each bucket was launched during backward.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from workers.runtime import at_least, batch_over_world, entrypoint, refusal
from workers.zero.model import OPTIMIZER_CLASSES, model_config, flat_params, loss_fn, make_batches, make_model, \
    shard_rows, train_reference
from workers.zero.zero2 import Zero2Optimizer


def check_params(world_size, global_batch: int = 8, steps: int = 3, bucket_cap_mb: float = 0.01, **_):
    return refusal(batch_over_world(global_batch, world_size), at_least("steps", steps),
                   None if bucket_cap_mb > 0 else
                   f"bucket_cap_mb={bucket_cap_mb} must be positive (DDP's default is 25)")


def main(ctx, steps: int = 3, global_batch: int = 8, bucket_cap_mb: float = 0.01, overlap: bool = True,
         vocab: int = 64, seq: int = 16, hidden: int = 32, heads: int = 4, layers: int = 2, seed: int = 0):
    cfg = model_config(vocab, seq, hidden, heads, layers)
    base = 100 * seed
    batches = make_batches(cfg, global_batch, steps, seed=base + 1)
    model = make_model(cfg, seed=base + ctx.rank, device=ctx.device)  # own weights: the broadcast equalises them
    cls, hyper = OPTIMIZER_CLASSES["adamw"]
    opt = Zero2Optimizer(model.parameters(), cls, bucket_cap_mb=bucket_cap_mb, overlap=overlap, **hyper)
    reference = train_reference(cfg, "adamw", batches, seed=base)
    errors = [(flat_params(model) - reference[0]).abs().max().item()]
    peaks, totals, launches_in_backward = [], [], []
    for step, batch in enumerate(batches):
        opt.zero_grad()
        opt.events.clear()
        loss = loss_fn(model, shard_rows(batch, ctx.rank, ctx.world_size).to(ctx.device))
        loss.backward()
        peaks.append(opt.peak_grad_bytes)
        totals.append(opt.peak_total_bytes)
        last_grad = max(e["t"] for e in opt.events if e["kind"] == "grad")
        launches_in_backward.append(sum(e["kind"] == "launch" and e["t"] <= last_grad for e in opt.events))
        opt.step()
        errors.append((flat_params(model) - reference[step + 1]).abs().max().item())
        ctx.metric(step=step, loss=loss.item(), max_abs_error=errors[-1])
    mine = flat_params(model).to(ctx.device)
    rank0 = mine.clone()
    dist.broadcast(rank0, src=0)
    n_params = sum(p.numel() for p in model.parameters())
    return {"max_abs_error": errors, "equal_to_rank0": bool(torch.equal(mine, rank0)), "n_params": n_params,
            "param_bytes": sum(p.nbytes for p in model.parameters()), "state_bytes": opt.state_bytes(),
            "grad_shard_bytes": opt.grad_shard_bytes(), "peak_grad_bytes": peaks, "peak_total_bytes": totals,
            "buckets": len(opt.buckets), "bucket_numel": opt.numel, "shard_size": opt.shard_size,
            "launches_in_backward": launches_in_backward, "comm_bytes": opt.comm_bytes(),
            "calls": {k: len(v) for k, v in opt.comm.items()}, "steps": steps}


if __name__ == "__main__":
    entrypoint(main)
