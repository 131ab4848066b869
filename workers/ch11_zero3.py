"""ZeRO-3 on real ranks (issue 16): FSDP's algorithm by hand, against one process and the ZeRO paper's bytes.

    torchrun --nproc-per-node 4 workers/ch11_zero3.py --prefetch true --reshard-after-forward true

Every rank trains the tied-embedding GPT of ``workers/zero/model.py`` on its B/n rows of each global batch with
``Zero3Model`` (a unit per block plus the root; AdamW on the shards), and also trains, alone, the single-process
reference (whole batch, plain AdamW). Each rank reports the largest difference from the reference after every
step (its weights all-gathered for the comparison), whether they equal rank 0's bit for bit, the bytes it keeps
(parameter, gradient and AdamW shards), the bytes of whole parameters and gradients over the last step (the
timeline), the peak, and the calls and bytes it sent per collective.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from workers.runtime import entrypoint
from workers.zero.model import OPTIMIZER_CLASSES, model_config, loss_fn, make_batches, make_model, shard_rows, \
    run_problem, train_reference
from workers.zero.zero3 import Zero3Model


def check_params(world_size, global_batch: int = 8, steps: int = 3, hidden: int = 32, heads: int = 4, **_):
    return run_problem(world_size, global_batch, steps, hidden, heads)


def main(ctx, steps: int = 3, global_batch: int = 8, prefetch: bool = False, reshard_after_forward: bool = True,
         vocab: int = 64, seq: int = 16, hidden: int = 32, heads: int = 4, layers: int = 2, seed: int = 0):
    cfg = model_config(vocab, seq, hidden, heads, layers)
    base = 100 * seed
    batches = make_batches(cfg, global_batch, steps, seed=base + 1)
    model = make_model(cfg, seed=base + ctx.rank, device=ctx.device)  # own weights: the broadcast equalises them
    cls, hyper = OPTIMIZER_CLASSES["adamw"]
    fsdp = Zero3Model(model, list(model.blocks), cls, prefetch=prefetch, reshard_after_forward=reshard_after_forward,
                      **hyper)
    reference = train_reference(cfg, "adamw", batches, seed=base)
    errors = [(fsdp.full_parameters().cpu().double() - reference[0]).abs().max().item()]
    for step, batch in enumerate(batches):
        fsdp.zero_grad()
        fsdp.timeline.clear()
        loss = loss_fn(model, shard_rows(batch, ctx.rank, ctx.world_size).to(ctx.device))
        loss.backward()
        fsdp.step()
        errors.append((fsdp.full_parameters().cpu().double() - reference[step + 1]).abs().max().item())
        ctx.metric(step=step, loss=loss.item(), max_abs_error=errors[-1])
    mine = fsdp.full_parameters()
    rank0 = mine.clone()
    dist.broadcast(rank0, src=0)
    units = [{"name": u.name, "numel": u.numel, "shard_size": u.shard_size, "bytes": u.nbytes} for u in fsdp.units]
    return {"max_abs_error": errors, "equal_to_rank0": bool(torch.equal(mine, rank0)),
            "n_params": sum(u["numel"] for u in units), "units": units, "world_size": ctx.world_size,
            "shard_bytes": fsdp.shard_bytes(), "grad_shard_bytes": fsdp.grad_shard_bytes(),
            "state_bytes": fsdp.state_bytes(), "padded_bytes": fsdp.padded_bytes(),
            "params_after_step": fsdp.gathered_bytes(), "timeline": fsdp.timeline,
            "peak_params": max(e["params"] for e in fsdp.timeline),
            "peak_grads": max(e["grads"] for e in fsdp.timeline),
            "comm_bytes": fsdp.comm_bytes(), "calls": {k: len(v) for k, v in fsdp.comm.items()}, "steps": steps,
            "prefetch": prefetch, "reshard_after_forward": reshard_after_forward}


if __name__ == "__main__":
    entrypoint(main)
