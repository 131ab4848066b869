"""Overlap: each bucket's all-reduce launched asynchronously from inside backward, against torch's DDP.

    torchrun --nproc-per-node 2 workers/ch02_overlap.py --bucket-cap-bytes 256

Every rank trains chapter 02's TinyMLP twice from the same seed on the same B/n rows: once wrapped in
``OverlappedDDP`` (``workers/data_parallel/overlap.py``: one async all-reduce per bucket, launched by the
post-accumulate-grad hooks as each bucket fills, waited in ``finish_gradient_synchronization()`` before the step),
once in torch's ``DistributedDataParallel`` with the same bucket cap. It returns, for both, the gradient in ``.grad``
before each step, the local losses and the weights after every step; for the overlapped one, the timeline of every
backward (hooks, launches, waits) and the all-reduces per step.

``overlap=False`` launches the same buckets only after backward (the contrast); ``unused_param=True`` adds a layer
the forward never uses, whose missing gradient the overlapped wrapper reports by name.
"""
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from workers.data_parallel.buckets import MIB, predict_ddp_buckets
from workers.data_parallel.model import (Setup, flat, flat_grads, loss_fn, make_batches, make_model, shard,
                                         training_problem)
from workers.data_parallel.overlap import OverlappedDDP, overlap_summary
from workers.runtime import at_least, entrypoint, refusal


def check_params(world_size, global_batch, steps, lr, bucket_cap_bytes, **_):
    return refusal(training_problem(world_size, global_batch, steps, lr),
                   (why := at_least("bucket_cap_bytes", bucket_cap_bytes)) and f"{why} byte")


def _train(ctx, setup: Setup, wrap, finish=None) -> dict:
    model = make_model(setup).to(ctx.device)
    wrapped = wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=setup.lr)
    weights, grads, losses = [flat(model.parameters())], [], []
    for batch in make_batches(setup):
        x, y = (t.to(ctx.device) for t in shard(batch, ctx.rank, ctx.world_size))  # [B/n, d_in], [B/n, d_out]
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(wrapped(x), y)
        loss.backward()
        if finish is not None:
            finish(wrapped)
        grads.append(flat_grads(model))
        opt.step()
        weights.append(flat(model.parameters()))
        losses.append(loss.item())
    return {"model": model, "wrapped": wrapped, "weights": torch.stack(weights), "grads": torch.stack(grads),
            "local_losses": torch.tensor(losses)}


def main(ctx, steps: int = 5, global_batch: int = 16, lr: float = 0.1, d_in: int = 8, d_hidden: int = 16,
         d_out: int = 4, seed: int = 0, bucket_cap_bytes: int = 256, overlap: bool = True,
         unused_param: bool = False, with_torch: bool = True):
    """Train with OverlappedDDP (and torch's DDP, same cap); return both runs and the overlapped timeline."""
    setup = Setup(d_in=d_in, d_hidden=d_hidden, d_out=d_out, global_batch=global_batch, steps=steps, lr=lr, seed=seed)
    cap_mb = bucket_cap_bytes / MIB  # exact: a power-of-two division, so int(cap_mb * MIB) == bucket_cap_bytes

    def wrap_overlapped(model):
        if unused_param:  # a layer the forward never calls: its parameters never receive a gradient
            model.spare = torch.nn.Linear(d_out, d_out).to(ctx.device)
        return OverlappedDDP(model, bucket_cap_mb=cap_mb, overlap=overlap)

    ours = _train(ctx, setup, wrap_overlapped, finish=lambda w: w.finish_gradient_synchronization())
    ddp = ours["wrapped"]
    out = {"weights": ours["weights"], "grads": ours["grads"], "local_losses": ours["local_losses"],
           "timeline": ddp.timeline,  # [steps] lists of events, t in seconds from the start of that backward
           "overlap": [overlap_summary(events) for events in ddp.timeline],
           "comm_per_step": ddp.comm_per_step(), "bucket_names": ddp.bucket_names(), "buckets": ddp.buckets,
           "predicted": predict_ddp_buckets(ours["model"], cap_mb)}
    if with_torch:
        theirs = _train(ctx, setup, lambda m: DDP(m, device_ids=[ctx.device.index] if ctx.is_cuda else None,
                                                    bucket_cap_mb=cap_mb))
        logging = theirs["wrapped"]._get_ddp_logging_data()  # private, read only to cross-check the bucket sizes
        out["torch"] = {"weights": theirs["weights"], "grads": theirs["grads"], "local_losses": theirs["local_losses"],
                        "ddp_logging": {k: logging.get(k) for k in ("bucket_cap_bytes", "rebuilt_bucket_sizes",
                                                                      "num_buckets_reduced")}}
    return out


if __name__ == "__main__":
    entrypoint(main)
