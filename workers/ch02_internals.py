"""What the one line does, part by part, measured on real ranks.

    torchrun --nproc-per-node 2 workers/ch02_internals.py --part broadcast
    torchrun --nproc-per-node 2 workers/ch02_internals.py --part average
    torchrun --nproc-per-node 2 workers/ch02_internals.py --part buckets --bucket-cap-mb 0.5

``broadcast``: every rank starts from *different* weights and buffers (seed + rank); wrapping the model
    in DDP copies rank 0's parameters and buffers to all ranks (one broadcast, at construction).
``average``: the gradient DDP leaves in ``.grad`` is the mean over ranks of the gradients each rank would
    have computed alone; the optimizer step afterwards is plain SGD, unchanged.
``buckets``: a comm hook (``DistributedDataParallel.register_comm_hook``) sees every all-reduce DDP
    launches: how many per backward, how big, which parameters, and when (interleaved with the moments
    each gradient is ready), for a given ``bucket_cap_mb``.
"""
import copy

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from workers.data_parallel.buckets import predict_ddp_buckets
from workers.data_parallel.model import (Setup, flat, flat_grads, grads_on, loss_fn, make_batches, make_model,
                                         make_stack, shard)
from workers.runtime import at_least, batch_over_world, entrypoint, one_of, refusal

PARTS = ("broadcast", "average", "buckets")


def check_params(world_size, part, bucket_cap_mb, layers, width, steps, global_batch, **_):
    return refusal(one_of("part", part, PARTS),
                   None if bucket_cap_mb > 0 else
                   f"bucket_cap_mb={bucket_cap_mb} must be positive (use default_cap=True for DDP's default)",
                   None if 1 <= layers <= 64 else f"layers={layers}: keep 1 <= layers <= 64 on a CPU",
                   None if 1 <= width <= 2048 else f"width={width}: keep 1 <= width <= 2048 on a CPU",
                   at_least("steps", steps), batch_over_world(global_batch, world_size))


def _wrap(model, ctx, **kw):
    return DDP(model, device_ids=[ctx.device.index] if ctx.is_cuda else None, **kw)


def broadcast(ctx, setup: Setup) -> dict:
    model = make_model(setup, seed=setup.seed + 1000 * ctx.rank).to(ctx.device)  # different on every rank
    before = {"params": flat(model.parameters()), "in_scale": model.in_scale.detach().cpu().clone()}
    _wrap(model, ctx)  # construction broadcasts rank 0's parameters and buffers
    after = {"params": flat(model.parameters()), "in_scale": model.in_scale.detach().cpu().clone()}
    return {"before": before, "after": after}


def average(ctx, setup: Setup) -> dict:
    model = make_model(setup).to(ctx.device)
    alone = copy.deepcopy(model)  # the same weights, never wrapped: what this rank computes by itself
    ddp = _wrap(model, ctx)
    x, y = (t.to(ctx.device) for t in shard(make_batches(setup, steps=1)[0], ctx.rank, ctx.world_size))
    local_grad = grads_on(alone, x, y)  # this rank's rows only, no communication
    loss_fn(ddp(x), y).backward()  # the same computation through DDP
    ddp_grad = flat_grads(model)
    weights_before = flat(model.parameters())
    torch.optim.SGD(model.parameters(), lr=setup.lr).step()  # plain SGD on the synchronised .grad
    return {"local_grad": local_grad, "ddp_grad": ddp_grad, "weights_before": weights_before,
            "weights_after": flat(model.parameters()), "lr": setup.lr}


def buckets(ctx, bucket_cap_mb: float | None, layers: int, width: int, steps: int, batch_per_rank: int,
            seed: int) -> dict:
    model = make_stack(layers, width, seed).to(ctx.device)
    ddp = _wrap(model, ctx, bucket_cap_mb=bucket_cap_mb)
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    names = [f"layer{k}.{n}" for k, m in enumerate(linears) for n, _ in m.named_parameters()]  # model order
    index_of = {id(p): i for i, p in enumerate(model.parameters())}
    state = {"step": 0, "events": []}

    def counting_allreduce(state, bucket):
        # Called by DDP's reducer once per bucket, as soon as every gradient in it is ready.
        state["events"].append({"step": state["step"], "kind": "all_reduce", "bucket": bucket.index(),
                                "bytes": bucket.buffer().numel() * bucket.buffer().element_size(),
                                "params": [index_of[id(p)] for p in bucket.parameters()]})
        return allreduce_hook(None, bucket)  # DDP's default: all-reduce SUM, divide by world size

    ddp.register_comm_hook(state, counting_allreduce)
    for i, p in enumerate(model.parameters()):  # a marker as each gradient lands in .grad
        p.register_post_accumulate_grad_hook(
            lambda _p, i=i: state["events"].append({"step": state["step"], "kind": "grad", "param": i}))

    g = torch.Generator().manual_seed(seed + 1 + ctx.rank)
    for step in range(steps):
        state["step"] = step
        x = torch.randn(batch_per_rank, width, generator=g).to(ctx.device).requires_grad_()
        ddp(x).square().mean().backward()
        ddp.zero_grad(set_to_none=True)
        ctx.metric(step=step)
    events = state["events"]
    per_step = [[e["bytes"] for e in events if e["step"] == s and e["kind"] == "all_reduce"] for s in range(steps)]
    logging = ddp._get_ddp_logging_data()  # DDP's own record (a private API: read, never relied on alone)
    return {"events": events, "all_reduce_bytes": per_step, "param_names": names,
            "predicted": predict_ddp_buckets(model, bucket_cap_mb),
            "ddp_logging": {k: logging.get(k) for k in ("bucket_cap_bytes", "bucket_sizes", "rebuilt_bucket_sizes",
                                                          "num_buckets_reduced", "has_rebuilt_buckets")}}


def main(ctx, part: str = "broadcast", bucket_cap_mb: float = 0.5, default_cap: bool = False, layers: int = 6,
         width: int = 256, steps: int = 3, global_batch: int = 16, seed: int = 0):
    """Run one part: broadcast, average or buckets."""
    setup = Setup(global_batch=global_batch, seed=seed)
    if part == "broadcast":
        return broadcast(ctx, setup)
    if part == "average":
        return average(ctx, setup)
    return buckets(ctx, None if default_cap else bucket_cap_mb, layers, width, steps,
                   batch_per_rank=max(global_batch // ctx.world_size, 1), seed=seed)


if __name__ == "__main__":
    entrypoint(main)
