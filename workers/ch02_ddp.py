"""DDP in one line: the same training loop as one process, with the model wrapped and the batch split.

    torchrun --nproc-per-node 4 workers/ch02_ddp.py --steps 5 --global-batch 16

Every rank builds the same model from the same seed, reads its B/n rows of every global batch, and runs
plain SGD. The only distributed line is ``DistributedDataParallel(model)``. Each rank sends back, for every
step, the gradient DDP left in ``.grad``, its own loss and the weights after the step, so the notebook can
check all three against the single-process baseline (``workers/data_parallel/model.py: train_single``) and the
ranks against each other.
"""
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from workers.data_parallel.model import (Setup, flat, flat_grads, loss_fn, make_batches, make_model, rows_of, shard,
                                         training_problem)
from workers.runtime import entrypoint


def check_params(world_size, global_batch, steps, lr, **_):
    return training_problem(world_size, global_batch, steps, lr)


def main(ctx, steps: int = 5, global_batch: int = 16, lr: float = 0.1, d_in: int = 8, d_hidden: int = 16,
         d_out: int = 4, seed: int = 0):
    """Train ``steps`` SGD steps with DDP; return the gradients, losses and weights of every step."""
    setup = Setup(d_in=d_in, d_hidden=d_hidden, d_out=d_out, global_batch=global_batch, steps=steps, lr=lr, seed=seed)
    model = make_model(setup).to(ctx.device)
    ddp = DDP(model, device_ids=[ctx.device.index] if ctx.is_cuda else None)  # <- the one line
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)  # the optimizer does not know about DDP

    weights, grads, losses = [flat(model.parameters())], [], []
    for step, batch in enumerate(make_batches(setup)):
        x, y = (t.to(ctx.device) for t in shard(batch, ctx.rank, ctx.world_size))  # [B/n, d_in], [B/n, d_out]
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(x), y)  # mean over this rank's B/n rows
        loss.backward()  # DDP's hooks all-reduce and average the gradients during this call
        grads.append(flat_grads(model))  # what the optimizer is about to use: the averaged gradient
        opt.step()
        weights.append(flat(model.parameters()))
        losses.append(loss.item())
        ctx.metric(step=step, loss=loss.item())
    return {"weights": torch.stack(weights),  # [steps + 1, P]
            "grads": torch.stack(grads),  # [steps, P], after DDP's all-reduce, before the step
            "local_losses": torch.tensor(losses),  # [steps], this rank's rows only
            "rows": list(rows_of(ctx.rank, ctx.world_size, global_batch))}


if __name__ == "__main__":
    entrypoint(main)
