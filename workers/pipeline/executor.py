"""Run one rank's schedule for real: its stage's forwards and backwards, the messages, a timeline.

Per micro-batch the stage keeps (input, output) from F until B: that is the activation stash, whose peak
size is the memory a schedule costs. Gradients accumulate in ``.grad`` over the m micro-batches, each loss
scaled by 1/m, so one optimizer step afterwards is the step on the whole global batch.

Timing. Every rank times against ``t0``, taken right after a barrier (so the clocks are aligned to the
barrier's exit, within its skew). Only compute is inside an action's box: time spent blocked in a receive
is idle, which is what the bubble is. ``forward_s`` / ``backward_s`` > 0 pad each action to that wall
time with ``time.sleep`` after its real math: a *calibrated wait* standing in for a stage big enough to
be worth pipelining, so the measured bubble is the schedule's, not the noise of a shared CPU.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from workers.pipeline.model import loss_fn
from workers.pipeline.p2p import P2P
from workers.pipeline.schedules import with_p2p


def pad_to(start: float, seconds: float) -> None:
    """Sleep until ``seconds`` have passed since ``start`` (the calibrated wait; no-op when 0)."""
    left = start + seconds - time.perf_counter()
    if left > 0:
        time.sleep(left)


def run_schedule(actions, module: torch.nn.Module, p2p: P2P, *, stage: int, num_stages: int, inputs, targets,
                 forward_s: float = 0.0, backward_s: float = 0.0) -> dict:
    """Run ``actions`` (``("F", i)`` / ``("B", i)``) on this stage. ``inputs`` are the micro-batches on the
    first stage, ``targets`` on the last. Returns the timeline, the micro-batch losses (last stage), the
    peak number of stashed micro-batches and the p2p counts."""
    first, last = stage == 0, stage == num_stages - 1
    m = len(inputs) if first else len(targets) if last else len({i for _, i in actions})
    stash: dict[int, tuple] = {}  # micro-batch -> (input, output or loss): kept alive for its backward
    received: dict[tuple, torch.Tensor] = {}
    losses, timeline, peak = {}, [], 0
    dist.barrier()
    t0 = time.perf_counter()
    for kind, i in with_p2p(actions, num_stages, stage):
        if kind == "recv_forward":
            received[("x", i)] = p2p.recv_forward()  # [micro_batch, hidden], requires grad
        elif kind == "recv_backward":
            received[("g", i)] = p2p.recv_backward()  # [micro_batch, hidden]
        elif kind == "send_forward":
            p2p.send_forward(stash[i][1])
        elif kind == "send_backward":
            p2p.send_backward(stash.pop(i)[0].grad)
        elif kind == "F":
            start = time.perf_counter()
            x = inputs[i] if first else received.pop(("x", i))
            y = module(x)  # [micro_batch, hidden]
            if last:
                y = loss_fn(y, targets[i]) / m  # Megatron divides each micro-batch's loss by m
                losses[i] = y.item() * m
            stash[i] = (x, y)
            peak = max(peak, len(stash))
            pad_to(start, forward_s)
            timeline.append({"kind": "F", "micro": i, "start": start - t0, "end": time.perf_counter() - t0})
        elif kind == "B":
            start = time.perf_counter()
            x, y = stash[i]
            if last:
                y.backward()
            else:
                torch.autograd.backward(y, grad_tensors=received.pop(("g", i)))
            if first:
                stash.pop(i)  # nothing to send back: free the stash here
            pad_to(start, backward_s)
            timeline.append({"kind": "B", "micro": i, "start": start - t0, "end": time.perf_counter() - t0})
    p2p.finish()
    if stash:  # every micro-batch's backward must have freed its activations
        raise RuntimeError(f"stage {stage} still holds micro-batches {sorted(stash)} after its schedule")
    return {"timeline": timeline, "losses": [losses[i] for i in sorted(losses)], "peak_stash": peak, **p2p.stats()}
