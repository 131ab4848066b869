"""Collective matmul: sequence parallelism's all-gather and reduce-scatter cut into ring steps that hide behind the matmul.

Wang et al. 2023 ("Overlap Communication with Dependent Computation via Decomposition in Large Deep Learning
Models", ASPLOS 2023) observe that the all-gather before a column-parallel matmul and the reduce-scatter
after a row-parallel one need not finish before the matmul starts: each is a sum (or a concatenation) over ranks'
blocks, and the matmul is independent per block of rows. So the collective becomes ``tp`` ring steps of one block
each (a CollectivePermute to the neighbour, in the paper), and each step's transfer runs while the previous block
multiplies. (The paper also sends blocks both ways round the ring at once, halving the steps; here one way.)

* ``all_gather_matmul`` replaces ``gather_from_sequence_parallel_region`` + ``ColumnParallelLinear.local``.
  The sequence shard ``[s/t, b, h]`` travels around the ring; at step k rank r holds rank (r - k)'s shard, sends
  it right, receives the next one from the left, and multiplies the one it holds meanwhile. Output ``[s, b, out/t]``.
* ``matmul_reduce_scatter`` replaces ``RowParallelLinear.local`` + ``reduce_scatter_to_sequence_parallel_region``.
  At step k rank r computes its partial product for the rows destined for rank (r - k - 1), adds the running sum
  received from the left, and sends it right; after ``tp`` steps the sum that arrives is its own rows, complete.
  Output ``[s/t, b, h]``.

They are conjugates, like the regions they replace: the backward of the all-gather ring is a reduce-scatter ring
(the input gradient ``dY_c W`` of each block is a partial sum over ranks), the backward of the reduce-scatter ring is
an all-gather ring (the output gradient's blocks travel, and each multiplies as it arrives). The weight gradient of
each block is computed in the same step, more compute to hide the transfer behind.

``Timeline`` records per rank when each chunk's matmul ran and when each wait on a transfer started and ended (and
when that transfer was posted), so a notebook can draw the overlap; ``overlapped`` lists the chunks that ran while a
transfer was outstanding. ``overlap=False`` runs the same ring but waits for each transfer at once: the
decomposition without the overlap, to tell what the ring costs from what the overlap gains.

On GPUs, PyTorch's ``torch.ops.symm_mem.fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``
(``torch/distributed/_symmetric_memory/__init__.py``; put into compiled graphs by the Inductor pass
``torch/_inductor/fx_passes/micro_pipeline_tp.py`` when ``torch._inductor.config._micro_pipeline_tp`` is set, which
is what torchtitan's async TP does) do this with symmetric memory: a workspace every rank of the group maps, so a
rank copies a peer's shard straight out of the peer's GPU memory (no send/recv pair, barriers on signal flags in the
same memory), and the copies and matmuls alternate between two CUDA streams, so that two chunks' matmuls overlap as
well as the copies. Those ops are registered for the CUDA and Meta (tracing) dispatch keys only and allocate their
workspace on ``cuda:<device>``: there is no CPU version, and nothing here runs them. Their reduce-scatter is shaped
differently from the ring below: each rank computes its partial product for every peer into a buffer that peer
reads (an all-to-all of partials, ``_pipelined_produce_and_all2all``) and sums the ``tp`` partials at the end,
instead of passing a running sum around the ring.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from workers.parallel.layers import divide, group_size_rank
from workers.runtime import comm_device

ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER = "all_gather_matmul", "matmul_reduce_scatter"


class Timeline:
    """This rank's compute chunks and transfer waits, in seconds since ``reset()`` (call it after a barrier).

    Each event: ``{"kind": "compute" | "wait", "op", "pass", "step", "start", "end"}``; a compute event also has
    ``chunk`` (the group rank whose rows it multiplied; -1: all rows, the blocking matmul); a wait event ``posted`` (when its transfer was started) and ``bytes``
    (received). On CUDA every mark waits for the compute stream (not for the communication), so a chunk's span is
    its kernels', not its launch's; that costs time: use a timeline for profiles, time steps without one.
    """

    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        self.events: list[dict] = []
        self.origin = time.perf_counter()

    def reset(self) -> None:
        self.events = []
        self.origin = time.perf_counter()

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter() - self.origin

    @contextlib.contextmanager
    def span(self, kind: str, op: str, pass_: str, **info):
        start = self.now()
        yield
        self.events.append({"kind": kind, "op": op, "pass": pass_, **info, "start": start, "end": self.now()})


class _NoTimeline(Timeline):
    """What runs when nobody asked for a timeline: no clock reads, no synchronisation."""

    def now(self) -> float:
        return 0.0

    @contextlib.contextmanager
    def span(self, kind: str, op: str, pass_: str, **info):
        yield


def overlapped(events: list[dict]) -> list[dict]:
    """The compute events that ran entirely while a transfer of the same op and pass was outstanding."""
    waits = [e for e in events if e["kind"] == "wait"]
    return [c for c in events if c["kind"] == "compute"
            and any(w["op"] == c["op"] and w["pass"] == c["pass"] and w["posted"] <= c["start"] and c["end"] <= w["end"]
                    for w in waits)]


# -- the two rings ----------------------------------------------------------------------------------------------

@dataclass
class _Transfer:
    """One ring step's send and receive, started; ``_Ring.finish`` waits for it (once)."""

    works: list
    sent: torch.Tensor | None  # held until the wait: its memory must not be reused while the send reads it
    incoming: torch.Tensor  # where the left neighbour's block lands (on the host when gloo has no CUDA send)
    posted: float
    step: int
    device: torch.device  # where the block is wanted
    arrived: torch.Tensor | None = None


class _Ring:
    """The TP group as a ring: each step sends one block to the right neighbour and receives one from the left."""

    def __init__(self, group, timeline: Timeline, op: str, pass_: str, overlap: bool):
        self.group, self.timeline, self.op, self.pass_, self.overlap = group, timeline, op, pass_, overlap
        self.size, self.rank = group_size_rank(group)

    def exchange(self, send: torch.Tensor, step: int) -> _Transfer:
        """Start sending ``send`` right and receiving a block of its shape from the left."""
        device = comm_device(dist.get_backend(self.group), send.device, "send")  # gloo sends CUDA tensors from host
        incoming, sent = torch.empty_like(send, device=device), send.to(device)
        ops = [dist.P2POp(dist.isend, sent, group=self.group, group_peer=(self.rank + 1) % self.size),
               dist.P2POp(dist.irecv, incoming, group=self.group, group_peer=(self.rank - 1) % self.size)]
        # batch_isend_irecv: NCCL pairs the send and the receive in one group call, so a ring of them cannot deadlock
        transfer = _Transfer(dist.batch_isend_irecv(ops), sent, incoming, self.timeline.now(), step, send.device)
        if not self.overlap:
            self.finish(transfer)  # the serialized ring: nothing runs while the block travels
        return transfer

    def finish(self, transfer: _Transfer) -> torch.Tensor:
        """The received block, waiting for the step's send and receive the first time (recorded as a wait)."""
        if transfer.arrived is None:
            with self.timeline.span("wait", self.op, self.pass_, step=transfer.step, posted=transfer.posted,
                                    bytes=transfer.incoming.numel() * transfer.incoming.element_size()):
                for work in transfer.works:
                    work.wait()
            transfer.arrived, transfer.sent = transfer.incoming.to(transfer.device), None
        return transfer.arrived

    def compute(self, step: int, chunk: int):
        return self.timeline.span("compute", self.op, self.pass_, step=step, chunk=chunk)


def ring_all_gather(shard: torch.Tensor, consume, ring: _Ring) -> None:
    """``consume(block, src)`` for every rank's ``shard`` (src: that rank's place in the group), each block's
    ``consume`` running while the next block is on its way: the all-gather, decomposed."""
    current, pending = shard, None
    for step in range(ring.size):
        if step < ring.size - 1:
            pending = ring.exchange(current, step)  # pass on what we hold; the left neighbour's block comes in
        src = (ring.rank - step) % ring.size
        with ring.compute(step, src):
            consume(current, src)
        if pending is not None:
            current, pending = ring.finish(pending), None


def ring_reduce_scatter(produce, ring: _Ring) -> torch.Tensor:
    """The sum over ranks of ``produce(dst)`` for this rank's ``dst``: each rank's addend for block ``dst`` is
    computed while the running sum of the previous block is on its way (the reduce-scatter, decomposed)."""
    pending, total = None, None
    for step in range(ring.size):
        dst = (ring.rank - step - 1) % ring.size  # the block this step adds to; at the last step our own
        with ring.compute(step, dst):
            total = produce(dst)
        if pending is not None:
            total = total + ring.finish(pending)  # the sum the left neighbour built for block dst
            pending = None
        if step < ring.size - 1:
            pending = ring.exchange(total.contiguous(), step)
    return total


def _rows(t: torch.Tensor, block: int, rows: int) -> torch.Tensor:
    return t[block * rows:(block + 1) * rows]


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])  # [s, b, n] -> [s*b, n]


# -- the autograd functions: each one's backward is the other's ring --------------------------------------------

class _AllGatherMatmul(torch.autograd.Function):
    """``all_gather(x) W^T + b``, the gather decomposed; backward: the input gradient by a reduce-scatter ring.

    Keeps the gathered input for the weight gradient (as ``fused_all_gather_matmul`` returns it): Megatron's
    sequence-parallel layer keeps only the shard and gathers it again in backward, trading the memory for a
    second all-gather.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, timeline, overlap):
        ring = _Ring(group, timeline, ALL_GATHER_MATMUL, "forward", overlap)
        rows = x.shape[0]
        x = x.contiguous()
        gathered = x.new_empty((ring.size * rows, *x.shape[1:]))  # [s, b, h]
        out = x.new_empty((ring.size * rows, *x.shape[1:-1], weight.shape[0]))  # [s, b, out/t]

        def consume(block, src):
            _rows(gathered, src, rows).copy_(block)
            _rows(out, src, rows).copy_(F.linear(block, weight, bias))  # [s/t, b, out/t]

        ring_all_gather(x, consume, ring)
        ctx.save_for_backward(gathered, weight)
        ctx.group, ctx.timeline, ctx.overlap, ctx.rows, ctx.has_bias = group, timeline, overlap, rows, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):  # [s, b, out/t]
        gathered, weight = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None

        def produce(dst):  # this rank's addend of block dst's input gradient, and its share of dW
            g = _rows(grad_out, dst, ctx.rows)  # [s/t, b, out/t]
            if grad_weight is not None:
                grad_weight.add_(_flat(g).t() @ _flat(_rows(gathered, dst, ctx.rows)))  # [out/t, h]
            return g @ weight  # [s/t, b, h]

        if ctx.needs_input_grad[0]:
            grad_x = ring_reduce_scatter(produce, _Ring(ctx.group, ctx.timeline, ALL_GATHER_MATMUL, "backward",
                                                        ctx.overlap))  # [s/t, b, h]
        else:
            grad_x = None
            for dst in range(group_size_rank(ctx.group)[0]):
                produce(dst)
        grad_bias = _flat(grad_out).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_weight, grad_bias, None, None, None


class _MatmulReduceScatter(torch.autograd.Function):
    """``reduce_scatter(x W^T)``, the reduce-scatter decomposed; backward: the output gradient by an all-gather ring,
    each block giving its rows of the input gradient and its share of the weight gradient as it arrives."""

    @staticmethod
    def forward(ctx, x, weight, group, timeline, overlap):
        ring = _Ring(group, timeline, MATMUL_REDUCE_SCATTER, "forward", overlap)
        rows = divide(x.shape[0], ring.size, "seq")  # equal blocks: a ring step moves one shape
        out = ring_reduce_scatter(lambda dst: F.linear(_rows(x, dst, rows), weight), ring)  # [s/t, b, out]
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.timeline, ctx.overlap, ctx.rows = group, timeline, overlap, rows
        return out

    @staticmethod
    def backward(ctx, grad_out):  # [s/t, b, out]
        x, weight = ctx.saved_tensors
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None  # [s, b, in/t]
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None  # [out, in/t]

        def consume(block, src):  # block: rank src's rows of the output gradient, [s/t, b, out]
            if grad_x is not None:
                _rows(grad_x, src, ctx.rows).copy_(block @ weight)  # [s/t, b, in/t]
            if grad_weight is not None:
                grad_weight.add_(_flat(block).t() @ _flat(_rows(x, src, ctx.rows)))

        ring_all_gather(grad_out.contiguous(), consume,
                        _Ring(ctx.group, ctx.timeline, MATMUL_REDUCE_SCATTER, "backward", ctx.overlap))
        return grad_x, grad_weight, None, None, None


def all_gather_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, group=None,
                      timeline: Timeline | None = None, overlap: bool = True) -> torch.Tensor:
    """``F.linear(all_gather(x), weight, bias)`` with the gather cut into ring steps: ``[s/t, b, h]`` -> ``[s, b, out/t]``.

    Conjugate of ``matmul_reduce_scatter`` (its backward runs that ring on the gradient).
    """
    return _AllGatherMatmul.apply(x, weight, bias, group, timeline or _NoTimeline(), overlap)


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group=None, timeline: Timeline | None = None,
                          overlap: bool = True) -> torch.Tensor:
    """``reduce_scatter(F.linear(x, weight))`` with the reduce-scatter cut into ring steps: ``[s, b, in/t]`` ->
    ``[s/t, b, out]``. No bias: the row-parallel bias goes on after the sum (``RowParallelLinear.add_bias``).

    Conjugate of ``all_gather_matmul``.
    """
    return _MatmulReduceScatter.apply(x, weight, group, timeline or _NoTimeline(), overlap)


# -- the sequence-parallel MLP, both ways ------------------------------------------------------------------------

def _require_sequence_parallel(mlp) -> None:
    if not (mlp.fc1.sequence_parallel and mlp.fc2.sequence_parallel):
        raise ValueError("collective matmul decomposes sequence parallelism's all-gather and reduce-scatter: build the "
                         "MLP with sequence_parallel=True")


def decomposed_mlp(mlp, x: torch.Tensor, timeline: Timeline | None = None, overlap: bool = True) -> torch.Tensor:
    """``ParallelMLP(sequence_parallel=True)`` with both collectives decomposed: ``[s/t, b, h]`` -> ``[s/t, b, h]``.

    The row bias still enters through ``f`` (its gradient is summed over the group by one small all-reduce).
    """
    _require_sequence_parallel(mlp)
    group = mlp.fc1.group
    hidden = all_gather_matmul(x, mlp.fc1.weight, mlp.fc1.bias, group, timeline, overlap)  # [s, b, ffn/t]
    partial = matmul_reduce_scatter(mlp.act(hidden), mlp.fc2.weight, group, timeline, overlap)  # [s/t, b, h]
    return mlp.fc2.add_bias(partial)


class _OnBackward(torch.autograd.Function):
    """Identity; calls ``note()`` when the gradient passes through in backward."""

    @staticmethod
    def forward(ctx, x, note):
        ctx.note = note
        return x

    @staticmethod
    def backward(ctx, grad):
        ctx.note()
        return grad, None


def _timed_collective(timeline: Timeline, op: str, collective, x: torch.Tensor) -> torch.Tensor:
    """``collective(x)``, its forward and its backward each recorded as one wait (a blocking collective is all wait).

    In backward the gradient reaches the output's mark, then the collective's backward runs, then the input's mark.
    """
    began: list[float] = []

    def wait(pass_: str, start: float) -> None:
        timeline.events.append({"kind": "wait", "op": op, "pass": pass_, "step": 0, "posted": start, "bytes": None,
                                "start": start, "end": timeline.now()})

    x = _OnBackward.apply(x, lambda: wait("backward", began[-1]))
    start = timeline.now()
    y = collective(x)
    wait("forward", start)
    return _OnBackward.apply(y, lambda: began.append(timeline.now()))


def blocking_mlp(mlp, x: torch.Tensor, timeline: Timeline | None = None) -> torch.Tensor:
    """``ParallelMLP(sequence_parallel=True)``'s own forward (``fc2(act(fc1(x)))``), each step on the timeline.

    Recorded: the forward matmuls as compute, each collective (forward and backward) as one wait. The backward
    matmuls run between the backward waits and are not recorded: compare the two modes' waits, not their compute.
    """
    _require_sequence_parallel(mlp)
    if timeline is None or isinstance(timeline, _NoTimeline):
        return mlp(x)
    full = _timed_collective(timeline, ALL_GATHER_MATMUL, mlp.fc1.input_region, x)  # [s, b, h]
    with timeline.span("compute", ALL_GATHER_MATMUL, "forward", step=0, chunk=-1):
        hidden = mlp.fc1.local(full)  # [s, b, ffn/t]
    activated = mlp.act(hidden)
    with timeline.span("compute", MATMUL_REDUCE_SCATTER, "forward", step=0, chunk=-1):
        partial = mlp.fc2.local(activated)  # [s, b, h], a partial sum
    return mlp.fc2.add_bias(_timed_collective(timeline, MATMUL_REDUCE_SCATTER, mlp.fc2.output_region, partial))
