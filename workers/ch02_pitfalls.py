"""Three ways a correct-looking DDP script trains the wrong thing, measured on real ranks.

    torchrun --nproc-per-node 2 workers/ch02_pitfalls.py --part sampler
    torchrun --nproc-per-node 2 workers/ch02_pitfalls.py --part reduction
    torchrun --nproc-per-node 2 workers/ch02_pitfalls.py --part no_sync --accumulation 4

``sampler``: DistributedSampler shuffles with ``seed + epoch``; without ``set_epoch`` the epoch stays 0, so
    every epoch visits the same samples in the same order on every rank.
``reduction``: DDP always divides the summed gradient by the world size. With ``reduction="mean"`` that
    gives the mean over the global batch; with ``reduction="sum"`` it gives (B/n) times the mean, a
    gradient whose scale changes when the world size does.
``no_sync``: gradient accumulation over k micro-batches. Inside ``ddp.no_sync()`` backward only
    accumulates; the backward outside it all-reduces once. Without ``no_sync`` every micro-batch
    all-reduces: the same gradient, k times the communication (counted with a comm hook).
"""
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from workers.data_parallel.model import Setup, flat_grads, loss_fn, make_batches, make_model, shard
from workers.runtime import batch_over_world, entrypoint, one_of, refusal

PARTS = ("sampler", "reduction", "no_sync")


def check_params(world_size, part, dataset_size, epochs, accumulation, global_batch, **_):
    return refusal(one_of("part", part, PARTS),
                   None if 1 <= dataset_size <= 10_000 else f"dataset_size={dataset_size}: use 1 to 10000 samples",
                   None if 1 <= epochs <= 20 else f"epochs={epochs}: use 1 to 20 epochs",
                   None if 1 <= accumulation <= 64 else f"accumulation={accumulation}: use 1 to 64 micro-batches",
                   batch_over_world(global_batch, world_size))


def sampler(ctx, dataset_size: int, epochs: int, seed: int) -> dict:
    dataset = range(dataset_size)  # the sampler only needs len(); the indices are the samples
    out = {}
    for call_set_epoch in (False, True):
        s = DistributedSampler(dataset, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=seed)
        orders = []
        for epoch in range(epochs):
            if call_set_epoch:
                s.set_epoch(epoch)
            orders.append(list(iter(s)))
        out["with_set_epoch" if call_set_epoch else "without_set_epoch"] = orders
    return out


def _ddp(setup, ctx):
    model = make_model(setup).to(ctx.device)
    return model, DDP(model, device_ids=[ctx.device.index] if ctx.is_cuda else None)


def reduction(ctx, setup: Setup) -> dict:
    x, y = (t.to(ctx.device) for t in shard(make_batches(setup, steps=1)[0], ctx.rank, ctx.world_size))
    out = {}
    for how in ("mean", "sum"):
        model, ddp = _ddp(setup, ctx)
        loss_fn(ddp(x), y, reduction=how).backward()
        out[how] = flat_grads(model)
    return {"grads": out}


def no_sync(ctx, setup: Setup, accumulation: int) -> dict:
    micro = [tuple(t.to(ctx.device) for t in shard(b, ctx.rank, ctx.world_size))
             for b in make_batches(setup, steps=accumulation)]
    out = {}
    for use_no_sync in (True, False):
        model, ddp = _ddp(setup, ctx)
        calls = []
        ddp.register_comm_hook(calls, lambda calls, bucket: calls.append(bucket.buffer().numel())
                               or allreduce_hook(None, bucket))
        for j, (x, y) in enumerate(micro):
            last = j == accumulation - 1
            if use_no_sync and not last:
                with ddp.no_sync():  # backward accumulates into .grad, no all-reduce
                    (loss_fn(ddp(x), y) / accumulation).backward()
            else:
                (loss_fn(ddp(x), y) / accumulation).backward()  # / k: the mean over the k micro-batches
        out["with_no_sync" if use_no_sync else "without_no_sync"] = {"grad": flat_grads(model),
                                                                     "all_reduces": len(calls)}
    return out


def main(ctx, part: str = "sampler", dataset_size: int = 12, epochs: int = 3, accumulation: int = 4,
         global_batch: int = 16, seed: int = 0):
    """Run one pitfall: sampler, reduction or no_sync."""
    setup = Setup(global_batch=global_batch, seed=seed)
    if part == "sampler":
        return sampler(ctx, dataset_size, epochs, seed)
    if part == "reduction":
        return reduction(ctx, setup)
    return no_sync(ctx, setup, accumulation)


if __name__ == "__main__":
    entrypoint(main)
