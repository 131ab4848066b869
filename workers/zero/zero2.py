"""ZeRO stage 2 by hand: gradients reduce-scattered from inside backward, and no rank keeps a whole gradient.

Rajbhandari et al. 2020, "ZeRO", section 5.2 (P_os+g, gradient partitioning). ZeRO-1 (``zero1.py``) shards the
optimizer state but keeps a full gradient on every rank until the step. ZeRO-2 also shards the gradient, with the
machinery of chapter 02's overlapped DDP (``workers/data_parallel/overlap.py``):

1. the parameters are packed into buckets with DDP's rule, in the order backward produces their gradients (the
   last layer first); every bucket is laid out flat and cut into N equal shards (padded), rank r owning shard r
   of every bucket (Megatron's distributed optimizer cuts its buckets the same way);
2. a post-accumulate-grad hook on every parameter counts the bucket's gradients in; when the last one lands, the
   bucket is flattened (pre-scaled by 1/N, so the SUM is the mean) and an asynchronous **reduce-scatter** is
   launched, and the parameters' ``.grad`` are dropped at once: from then on this rank holds only its shard of
   that bucket's gradient (what is left in flight is the flattened copy, until the collective completes);
3. ``step()`` waits for every bucket, hands the wrapped optimizer this rank's shards (the parameters' shard, a
   view of the bucket's flat buffer that the model's parameters are views of too, as in ZeRO-1, and the
   gradient's), steps them in place, and **all-gathers** every bucket's updated shards into the flat buffers.

Communication: a reduce-scatter and an all-gather of the model per step, (N-1)/N of it each, 2 Psi (N-1)/N in
all: the bytes of one all-reduce, as for DDP and ZeRO-1 (section 7.2.1). Memory: parameters whole (K = 2 of the
paper's 2 + 2 + K at fp16, here the model's dtype), gradients 1/N after their bucket is reduced, optimizer
state 1/N. The peak of whole gradients alive during backward is measured (``peak_grad_bytes``): with several
buckets the gradients held in ``.grad`` never add up to one whole gradient, which is the point of the stage;
``peak_total_bytes`` adds the buckets still in flight, freed as their reduce-scatters complete (timing-dependent).

One backward per step: with gradient accumulation ZeRO-2 reduce-scatters after every micro-batch (its shard is
all it keeps), which this class refuses rather than get wrong (``zero_collectives_per_step`` in the ledger
prices that case). Elementwise optimizers only (SGD, Adam, AdamW): the shards cut tensors in pieces.
"""
from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from workers.data_parallel.buckets import bucket_assignment, ddp_bucket_limits
from workers.runtime import all_gather_single, comm_device, host_staged, reduce_scatter_single


class Zero2Optimizer:
    """``Zero2Optimizer(model.parameters(), torch.optim.AdamW, bucket_cap_mb=0.01, lr=1e-3)``.

    Call ``zero_grad()``, then ``loss.backward()`` (the buckets' reduce-scatters launch from inside it), then
    ``step()``. ``overlap=False`` launches every bucket after backward, inside ``step()`` (the contrast).
    """

    def __init__(self, params, optimizer_class: type, *, bucket_cap_mb: float | None = None, group=None,
                 overlap: bool = True, **defaults):
        self.group, self.overlap = group, overlap
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        unique, seen = [], set()
        for p in params:
            if p.requires_grad and id(p) not in seen:  # a tied weight is one tensor: reduced and stepped once
                seen.add(id(p))
                unique.append(p)
        if not unique:
            raise ValueError("Zero2Optimizer got no parameter that requires a gradient; pass model.parameters().")
        if len({(p.dtype, p.device) for p in unique}) > 1:
            raise ValueError("Zero2Optimizer needs every parameter in one dtype on one device; cast the model first.")
        optimizer_class([torch.nn.Parameter(torch.zeros(1))], **defaults)  # refuse bad options before any collective
        self.params = unique
        src = dist.get_global_rank(group, 0) if group is not None else 0
        with torch.no_grad():
            for p in unique:  # replicas start equal, as DDP's constructor makes them
                dist.broadcast(p.data, src=src, group=group)
        ready = list(reversed(range(len(unique))))  # the last layer's gradients are ready first
        sizes = [unique[i].numel() * unique[i].element_size() for i in ready]
        self.buckets = [[ready[j] for j in b] for b in bucket_assignment(sizes, ddp_bucket_limits(bucket_cap_mb))]
        self.bucket_of = {i: k for k, b in enumerate(self.buckets) for i in b}
        n, r = self.world_size, self.rank
        self.numel = [sum(unique[i].numel() for i in b) for b in self.buckets]
        self.shard_size = [math.ceil(m / n) for m in self.numel]
        self.flat_params, self.masters, self.shard_grads = [], [], []
        with torch.no_grad():
            for b, S in zip(self.buckets, self.shard_size):
                flat = self._flat([unique[i].detach() for i in b], S * n)  # [S n]
                offset = 0
                for i in b:  # the model's parameters become views of the bucket's flat buffer, as in ZeRO-1
                    p = unique[i]
                    p.data = flat[offset:offset + p.numel()].view_as(p)
                    offset += p.numel()
                self.flat_params.append(flat)
                # my shard, stepped in place: a view of the flat buffer, so no second copy of the weights
                self.masters.append(torch.nn.Parameter(flat[r * S:(r + 1) * S]))
                self.shard_grads.append(torch.zeros(S, dtype=flat.dtype, device=flat.device))
        self.optimizer = optimizer_class(self.masters, **defaults)
        self.events: list[dict] = []
        self.comm = {"reduce_scatter": [], "all_gather": []}  # (bytes handed in, group size) per call, per step
        self._hooks = [p.register_post_accumulate_grad_hook(lambda p, i=i: self._grad_ready(i))
                       for i, p in enumerate(unique)]
        self._reset()

    @staticmethod
    def _flat(tensors, size: int) -> torch.Tensor:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        return torch.cat([flat, flat.new_zeros(size - flat.numel())])  # padded to N equal shards

    def _reset(self) -> None:
        self._pending = [len(b) for b in self.buckets]
        self._seen: set[int] = set()
        self._next = 0
        self._work: list = [None] * len(self.buckets)
        self._inflight: list = [None] * len(self.buckets)  # (flattened gradient, output) until the collective ends
        self._in_grad = 0  # bytes of whole gradients in .grad now
        self._in_flight = 0  # bytes of flattened bucket gradients whose reduce-scatter has not been harvested
        self.peak_grad_bytes = 0  # the most bytes ever in .grad at once during backward
        self.peak_total_bytes = 0  # the same, plus the buckets in flight
        self._t0 = None

    def _event(self, kind: str, **info) -> None:
        if self._t0 is None:
            self._t0 = time.perf_counter()
        self.events.append({"kind": kind, "t": time.perf_counter() - self._t0, **info})

    def _grad_ready(self, i: int) -> None:
        if i in self._seen:
            raise RuntimeError(f"parameter {i} received a second gradient before step(): ZeRO-2 keeps only its shard "
                               "of a reduced gradient, so accumulate by calling step() after every backward")
        self._seen.add(i)
        self._harvest()
        self._in_grad += self.params[i].grad.nbytes
        self._peaks()
        k = self.bucket_of[i]
        self._event("grad", param=i, bucket=k)
        self._pending[k] -= 1
        if self.overlap:
            self._launch_ready()

    def _peaks(self) -> None:
        self.peak_grad_bytes = max(self.peak_grad_bytes, self._in_grad)
        self.peak_total_bytes = max(self.peak_total_bytes, self._in_grad + self._in_flight)

    def _harvest(self, wait: bool = False) -> None:
        """Keep the shard of every launched bucket whose reduce-scatter has completed (all of them when ``wait``) and
        free its flattened copy: what bounds the memory in flight, as DeepSpeed's and Megatron's bucket reuse do."""
        for k in range(self._next):
            if self._inflight[k] is None:
                continue
            work = self._work[k]
            if not wait and not work.is_completed():
                continue
            self._event("wait_begin", bucket=k, done=bool(work.is_completed()))
            work.wait()
            buf, out = self._inflight[k]
            self.shard_grads[k].copy_(out)
            self._in_flight -= buf.nbytes
            self._inflight[k] = None
            self._event("wait_end", bucket=k)

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _launch(self, k: int) -> None:
        params = [self.params[i] for i in self.buckets[k]]
        S, n = self.shard_size[k], self.world_size
        device = comm_device(dist.get_backend(self.group), params[0].device, "reduce_scatter")
        buf = self._flat([p.grad.detach() for p in params], S * n).to(device).mul_(1.0 / n)  # [S n], the SUM is the mean
        out = torch.empty(S, dtype=buf.dtype, device=device)
        self._work[k] = reduce_scatter_single(out, buf, group=self.group, async_op=True)
        self._inflight[k] = (buf, out)
        self.comm["reduce_scatter"].append((buf.nbytes, n))
        for p in params:  # the whole gradient is not kept: only the flattened copy, until the collective completes
            self._in_grad -= p.grad.nbytes
            p.grad = None
        self._in_flight += buf.nbytes
        self._peaks()
        self._event("launch", bucket=k, bytes=buf.nbytes)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        for g in self.shard_grads:
            g.zero_()
        self._reset()

    @torch.no_grad()
    def step(self) -> None:
        missing = [i for i in range(len(self.params)) if i not in self._seen]
        if missing:
            raise RuntimeError(f"{len(missing)} parameter(s) received no gradient in this backward, so their buckets "
                               "never filled: every parameter must take part in the loss")
        if not self.overlap:
            self._launch_ready()  # the contrast: every bucket only now, after backward
        self._harvest(wait=True)
        for master, grad in zip(self.masters, self.shard_grads):
            master.grad = grad
        self.optimizer.step()
        n = self.world_size
        for k, flat in enumerate(self.flat_params):  # every rank gets every updated shard back, in place
            host_staged("all_gather", all_gather_single, flat, self.masters[k].detach(), self.group)
            self.comm["all_gather"].append((self.masters[k].nbytes, n))
        for master in self.masters:
            master.grad = None
        self._reset()

    # -- what this rank holds --------------------------------------------------------------------------------

    def state_bytes(self) -> int:
        """Bytes of optimizer state with one entry per shard element (AdamW's two moments): K Psi / N, padded."""
        return sum(v.nbytes for st in self.optimizer.state.values() for v in st.values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0)

    def in_flight_bytes(self) -> int:
        """Bytes of flattened bucket gradients whose reduce-scatter has been launched and not yet waited for."""
        return sum(entry[0].nbytes for entry in self._inflight if entry is not None)

    def grad_shard_bytes(self) -> int:
        return sum(g.nbytes for g in self.shard_grads)

    def comm_bytes(self) -> dict:
        """Ring wire bytes this rank sent in the calls recorded so far: (N-1)/N of each collective's whole tensor."""
        return {kind: sum((n - 1) / n * (nbytes if kind == "reduce_scatter" else nbytes * n) for nbytes, n in calls)
                for kind, calls in self.comm.items()}
