"""DDP's real mechanism (chapter 02): one asynchronous all-reduce per bucket, launched during backward.

``OverlappedDDP(model, bucket_cap_mb=...)`` packs the gradients into buckets with DDP's own rule
(``buckets.bucket_assignment`` over the parameters in reverse order, limits from ``buckets.ddp_bucket_limits``),
registers a post-accumulate-grad hook on every parameter, and as soon as the last gradient of a bucket lands in
``.grad`` flattens the bucket into one buffer and launches ``dist.all_reduce(buf, async_op=True)``. Backward goes
on computing the earlier layers' gradients while that bucket travels. ``finish_gradient_synchronization()``
(Megatron's name) waits for every handle and copies the averaged values back into each ``.grad``; call it after
``loss.backward()`` and before ``optimizer.step()``:

    ddp = OverlappedDDP(model, bucket_cap_mb=0.5)
    loss_fn(ddp(x), y).backward()  # buckets launched from inside this call
    ddp.finish_gradient_synchronization()  # wait, unflatten: .grad now holds the mean over ranks
    opt.step()

Averaging: each bucket is multiplied by 1/world_size *before* the all-reduce (SUM), as torch's reducer does
("divides while copying into the bucket": ``mul_out(bucket_view, grad, 1/div_factor)``). Same operations in the
same order as torch gives the same bits, and pre-scaling keeps a sum of n half-precision gradients from
overflowing where the unscaled sum would.

Buckets are launched in bucket order (0, 1, ...) even if a later one fills first, as torch's reducer does: every
rank then issues its collectives in the same order, which gloo and NCCL require.

``overlap=False`` is the same class without the point: the hooks only record, and every bucket is launched
after backward, inside ``finish_gradient_synchronization`` (what "bucket after backward" looks like).

``timeline`` records, per backward, ``(kind, t, ...)`` events with ``time.perf_counter()`` offsets in seconds from
the start of backward (the moment autograd reaches the model's output): ``backward_start``, ``grad`` (a
parameter's hook fired), ``launch`` (a bucket's all-reduce was issued), ``wait_begin``/``wait_end`` (per bucket,
with ``done`` = whether it had already completed when the wait began).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn

from workers.data_parallel.buckets import bucket_assignment, ddp_bucket_limits
from workers.runtime import comm_device


class OverlappedDDP(nn.Module):
    """A model wrapped for data parallelism with bucketed, asynchronous all-reduces overlapping backward."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float | None = None, group=None, overlap: bool = True,
                 broadcast_from_rank0: bool = True):
        super().__init__()
        self.module = module
        self.group = group
        self.overlap = overlap
        self.world_size = dist.get_world_size(group)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        if broadcast_from_rank0:  # like DDP's constructor: every rank starts from rank 0's parameters and buffers
            src = dist.get_global_rank(group, 0) if group is not None else 0
            with torch.no_grad():
                for t in list(module.parameters()) + list(module.buffers()):
                    dist.broadcast(t.data, src=src, group=group)
        ready = list(reversed(range(len(self.params))))  # a chain: the last layer's gradients are ready first
        sizes = [self.params[i].numel() * self.params[i].element_size() for i in ready]
        self.buckets: list[list[int]] = [[ready[j] for j in b]
                                         for b in bucket_assignment(sizes, ddp_bucket_limits(bucket_cap_mb))]
        self.bucket_of = {i: k for k, b in enumerate(self.buckets) for i in b}
        self.bucket_bytes = [sum(sizes[ready.index(i)] for i in b) for b in self.buckets]
        self.timeline: list[list[dict]] = []  # one list of events per backward
        self._hooks = [p.register_post_accumulate_grad_hook(lambda p, i=i: self._grad_ready(i))
                       for i, p in enumerate(self.params)]
        self._reset()

    # -- one backward ----------------------------------------------------------------------------------------

    def _reset(self):
        self._pending = [len(b) for b in self.buckets]  # gradients still to come, per bucket
        self._seen: set[int] = set()
        self._next = 0  # the next bucket to launch (buckets go out in order)
        self._work: list = [None] * len(self.buckets)
        self._buffers: list[torch.Tensor | None] = [None] * len(self.buckets)
        self._t0: float | None = None
        self._events: list[dict] | None = None

    def _event(self, kind: str, **info):
        if self._events is None:  # a hook fired without going through forward's output hook: start the clock here
            self._t0, self._events = time.perf_counter(), []
            self.timeline.append(self._events)
        self._events.append({"kind": kind, "t": time.perf_counter() - self._t0, **info})

    def forward(self, *args, **kwargs):
        out = self.module(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._backward_start)
        return out

    def _backward_start(self, grad):
        if self._events is not None and self._seen:
            raise RuntimeError("a second backward started before finish_gradient_synchronization(): call it after "
                               "every backward (accumulating over several backwards is not supported here)")
        self._t0, self._events = time.perf_counter(), []
        self.timeline.append(self._events)
        self._event("backward_start")
        return grad

    def _grad_ready(self, i: int):
        if i in self._seen:
            raise RuntimeError(f"{self.names[i]} received a second gradient before finish_gradient_synchronization(): "
                               "call it after every backward")
        self._seen.add(i)
        k = self.bucket_of[i]
        self._event("grad", param=i, bucket=k)
        self._pending[k] -= 1
        if self.overlap:
            self._launch_ready()

    def _launch_ready(self):
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _launch(self, k: int):
        params = [self.params[i] for i in self.buckets[k]]
        device = comm_device(dist.get_backend(self.group), params[0].device, "all_reduce")
        # Pre-scale while flattening, as torch's reducer does: the SUM of the scaled buckets is the mean.
        buf = torch.cat([p.grad.detach().reshape(-1) for p in params]).to(device).mul_(1.0 / self.world_size)
        self._buffers[k] = buf
        self._work[k] = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self._event("launch", bucket=k, bytes=buf.numel() * buf.element_size())

    def finish_gradient_synchronization(self):
        """Wait for every bucket's all-reduce and write the averaged gradients back into ``.grad``."""
        if self._events is None:
            raise RuntimeError("finish_gradient_synchronization() called without a backward through this model")
        if not self.overlap:
            self._launch_ready()  # the contrast: everything is launched only now, after backward
        missing = [self.names[i] for i in range(len(self.params)) if i not in self._seen]
        for k in range(len(self.buckets)):
            work = self._work[k]
            if work is None:
                continue
            self._event("wait_begin", bucket=k, done=bool(work.is_completed()))
            work.wait()
            self._event("wait_end", bucket=k)
            offset = 0
            for i in self.buckets[k]:
                p = self.params[i]
                n = p.numel()
                p.grad.copy_(self._buffers[k][offset:offset + n].view_as(p.grad))
                offset += n
        if missing:
            never = sorted({self.bucket_of[self.names.index(n)] for n in missing})
            self._reset()
            raise RuntimeError(
                f"parameter(s) {', '.join(missing)} received no gradient in this backward, so bucket(s) {never} never "
                "filled and were never all-reduced (nor any bucket after them): every parameter must take part in the "
                "loss, or leave it out of the wrapped model (torch's DDP needs find_unused_parameters=True for this)")
        self._reset()

    # -- what one backward all-reduces -----------------------------------------------------------------------

    def comm_per_step(self) -> dict:
        """The all-reduces of one backward: how many, and the bytes of each (fixed by the buckets)."""
        return {"all_reduces": len(self.buckets), "bytes": list(self.bucket_bytes), "total_bytes": sum(self.bucket_bytes)}

    def bucket_names(self) -> list[list[str]]:
        return [[self.names[i] for i in b] for b in self.buckets]


def overlap_summary(events: list[dict]) -> dict:
    """From one backward's events: how many buckets were launched before the last gradient hook fired (while
    backward still had work to do), and how many had already completed when ``finish`` began to wait."""
    last_grad = max((j for j, e in enumerate(events) if e["kind"] == "grad"), default=len(events))
    launches = [(j, e) for j, e in enumerate(events) if e["kind"] == "launch"]
    waits = [e for e in events if e["kind"] == "wait_begin"]
    return {"buckets": len(launches),
            "launched_before_last_grad": sum(j < last_grad for j, _ in launches),  # events are in time order
            "done_before_wait": sum(e["done"] for e in waits),
            "last_grad_t": events[last_grad]["t"] if last_grad < len(events) else None,
            "first_launch_t": launches[0][1]["t"] if launches else None}
