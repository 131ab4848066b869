"""ZeRO-1 on real ranks, against the unsharded optimizer in one process.

    torchrun --nproc-per-node 4 workers/ch11_zero1.py --optimizer adamw --partition flat

Every rank trains the tied-embedding GPT of ``workers/zero/model.py`` on its B/n rows of each global batch
with ``Zero1Optimizer``, and also trains, alone and without any collective, the single-process reference
(whole batch, plain unsharded optimizer). Both compute the same mathematics (the mean loss over the global
batch, then an elementwise update), so the weights agree to fp32 rounding after every step. Each rank also
reports the optimizer-state bytes it actually holds (``nbytes`` of its state tensors), for the ledger.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from workers.runtime import at_least, batch_over_world, divides, entrypoint, one_of, refusal
from workers.zero.model import (OPTIMIZER_CLASSES, STATE_BYTES_PER_PARAM, model_config, flat_params, loss_fn,
                                make_batches, make_model, shard_rows, train_reference)
from workers.zero.zero1 import GRAD_SYNCS, PARTITIONS, Zero1Optimizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def check_params(world_size, global_batch: int = 8, optimizer: str = "adamw", partition: str = "flat",
                 grad_sync: str = "reduce_scatter", dtype: str = "float32", master_weights: bool = False,
                 steps: int = 3, vocab: int = 64, seq: int = 16, hidden: int = 32, heads: int = 4, layers: int = 2,
                 **_):
    batch = batch_over_world(global_batch, world_size)
    if global_batch < 1:  # the chapter's why: the loss would be a mean over nothing
        batch += ": it gives the ranks no rows, so the loss is a mean over nothing (NaN)"
    return refusal(
        batch, *(at_least(name, value) for name, value in (("steps", steps), ("vocab", vocab), ("seq", seq),
                                                            ("hidden", hidden), ("layers", layers))),
        divides("heads", heads, "hidden", hidden) if hidden >= 1 else None,
        one_of("optimizer", optimizer, OPTIMIZER_CLASSES), one_of("partition", partition, PARTITIONS),
        one_of("grad_sync", grad_sync, GRAD_SYNCS), one_of("dtype", dtype, DTYPES),
        f"dtype={dtype} needs master_weights=True (an fp32 copy for the optimizer), as mixed precision does"
        if dtype in DTYPES and dtype != "float32" and not master_weights else None)


def main(ctx, optimizer: str = "adamw", partition: str = "flat", grad_sync: str = "reduce_scatter",
         steps: int = 3, global_batch: int = 8, dtype: str = "float32", master_weights: bool = False,
         shard: bool = True, vocab: int = 64, seq: int = 16, hidden: int = 32, heads: int = 4, layers: int = 2,
         seed: int = 0):
    cfg = model_config(vocab, seq, hidden, heads, layers)
    torch_dtype = DTYPES[dtype]
    base = 100 * seed  # seed 0: models 0, 1, ... per rank, data 1
    batches = make_batches(cfg, global_batch, steps, seed=base + 1)
    # Rank r starts from its own random weights: the optimizer's broadcast must make the replicas equal.
    model = make_model(cfg, seed=base + ctx.rank, dtype=torch_dtype, device=ctx.device)
    cls, hyper = OPTIMIZER_CLASSES[optimizer]
    opt = Zero1Optimizer(model.parameters(), cls, partition=partition, grad_sync=grad_sync,
                         master_weights=master_weights, shard=shard, **hyper)
    reference = train_reference(cfg, optimizer, batches, seed=base, dtype=torch_dtype, master_weights=master_weights)
    # With grad_sync="all_reduce" the averaged gradient is left in every .grad after the step: feed exactly
    # those numbers to a plain, unsharded torch optimizer on a replica, which isolates the sharded step.
    twin = twin_opt = None
    if grad_sync == "all_reduce" and not master_weights:
        twin = make_model(cfg, seed=base, dtype=torch_dtype, device=ctx.device)
        twin_opt = cls(twin.parameters(), **hyper)

    errors = [(flat_params(model) - reference[0]).abs().max().item()]
    same_grad_errors = []
    for step, batch in enumerate(batches):
        opt.zero_grad()
        loss = loss_fn(model, shard_rows(batch, ctx.rank, ctx.world_size).to(ctx.device))
        loss.backward()
        opt.step()
        errors.append((flat_params(model) - reference[step + 1]).abs().max().item())
        if twin is not None:
            for t, p in zip(twin.parameters(), model.parameters()):
                t.grad = p.grad.detach().clone()  # the averaged gradient, bit for bit
            twin_opt.step()
            same_grad_errors.append((flat_params(model) - flat_params(twin)).abs().max().item())
        ctx.metric(step=step, loss=loss.item(), max_abs_error=errors[-1])

    mine = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    rank0 = mine.clone()
    dist.broadcast(rank0, src=0)
    return {
        "max_abs_error": errors,  # vs the single-process reference, index 0 = after construction
        "same_grad_max_abs_error": same_grad_errors or None,  # vs the unsharded optimizer, same gradients
        "equal_to_rank0": bool(torch.equal(mine, rank0)),  # bitwise: the all-gather gives everyone the same bytes
        "tied": model.head.weight is model.embed.weight,
        "n_params": sum(p.numel() for p in model.parameters()),
        "owned_numel": opt.owned_numel(),
        "state_bytes": opt.state_bytes(),
        "buffer_bytes": opt.buffer_bytes(),
        "partition_table": opt.partition_table(),
        "state_bytes_per_param": STATE_BYTES_PER_PARAM[optimizer] + (4 if master_weights else 0),
        "param_bytes": torch.finfo(torch_dtype).bits // 8,
    }


if __name__ == "__main__":
    entrypoint(main)
