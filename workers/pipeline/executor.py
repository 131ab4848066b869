"""Run one rank's schedule for real: its stage's (or chunks') forwards and backwards, the messages, a timeline.

Per micro-batch (and chunk) the rank keeps (input, output) from F until B: that is the activation stash,
whose peak size is the memory a schedule costs. What autograd saved for backward in each forward is also
measured, in bytes (``saved_tensors_hooks``; parameters excluded): the memory itself, not a count. Gradients
accumulate in ``.grad`` over the m micro-batches, each loss scaled by 1/m, so one optimizer step afterwards
is the step on the whole global batch.

``run_split_schedule`` runs the zero-bubble tables (``zero_bubble.py``): B and W as separate actions, computed by
hand (``split_backward.py``) instead of by autograd, and the V placement, where a neighbouring virtual stage on the
same rank is handed its input (or its gradient) in memory, without a message. It checks the whole table first
(``validity.check_schedule``): a table that would deadlock or break a dependency is refused before any message.

Timing. Every rank times against ``t0``, taken right after a barrier (so the clocks are aligned to the
barrier's exit, within its skew). Only compute is inside an action's box: time spent blocked in a receive
is idle, which is what the bubble is. ``forward_s`` / ``backward_s`` > 0 pad each action to that wall
time with ``time.sleep`` after its real math: a *calibrated wait* standing in for a stage big enough to
be worth pipelining, so the measured bubble is the schedule's, not the noise of a shared CPU. With v
chunks per rank an action is one chunk, 1/v of the rank's layers, and is padded to 1/v of those times.
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from workers.pipeline import split_backward
from workers.pipeline.model import loss_fn
from workers.pipeline.p2p import DIRECTIONS, GROUPS, P2P
from workers.pipeline.schedules import split_action, virtual_stage, with_p2p
from workers.pipeline.validity import check_schedule, with_messages
from workers.pipeline.zero_bubble import placed_stage, rank_of


def pad_to(start: float, seconds: float) -> None:
    """Sleep until ``seconds`` have passed since ``start`` (the calibrated wait; no-op when 0)."""
    left = start + seconds - time.perf_counter()
    if left > 0:
        time.sleep(left)


def message_key(kind: str, vs: int, micro: int, m: int) -> int:
    """The message's name on its link: the boundary it crosses (the lower virtual stage of the two) and the
    micro-batch, the same on both sides (rank p-1's chunk 0 talks to rank 0's chunk 1)."""
    return (vs - 1 if kind in ("recv_forward", "send_backward") else vs) * m + micro


def receives(steps, where, m: int) -> list[tuple[int, str, int]]:
    """``[(chunk, kind, key)]``: every receive among ``steps`` (actions with their messages, m micro-batches),
    ``where(chunk)`` the chunk's virtual stage. They are posted before the step (``P2P.post_receives``: a message
    that arrives before its receive costs gloo a polling thread)."""
    return [(c, kind, message_key(kind, where(c), i, m))
            for kind, i, c in map(split_action, steps) if kind in ("recv_forward", "recv_backward")]


@contextlib.contextmanager
def saved_bytes(params, counter: list):
    """Add to ``counter[0]`` the bytes of every distinct tensor autograd saves for backward inside the
    block, parameters excluded (they are there anyway): the activation memory of that forward. (Tensor
    bytes, not storage bytes: the first stage's micro-batch is a view of the whole batch, held anyway.)"""
    skip = {p.data_ptr() for p in params}
    seen = set()

    def pack(t: torch.Tensor):
        if t.data_ptr() not in skip and (t.data_ptr(), t.shape) not in seen:
            seen.add((t.data_ptr(), t.shape))
            counter[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def run_schedule(actions, modules, p2p: P2P, *, stage: int, num_stages: int, inputs, targets,
                 forward_s: float = 0.0, backward_s: float = 0.0, forward=None, loss=None) -> dict:
    """Run ``actions`` (``("F", i)`` / ``("B", i)``, or ``("F", i, c)`` with chunks) on this rank.
    ``modules`` is the stage's module, or one per chunk. ``inputs`` are the micro-batches (read by virtual
    stage 0), ``targets`` too (read by the last). Returns the timeline, the micro-batch losses (last stage),
    the peak number of stashed micro-batch-chunks, the peak bytes saved for backward and the p2p counts.

    A model whose stages need more than a tensor (chapter 15: token positions, dropout keys) passes
    ``forward(chunk, micro, x) -> y`` instead of calling ``modules[chunk](x)``, and ``loss(y, micro)``, the
    micro-batch's share of the step's loss, already normalised (it is recorded as it is, not times m)."""
    modules = list(modules) if isinstance(modules, (list, tuple)) else [modules]
    run = forward or (lambda c, i, x: modules[c](x))
    v = len(modules)
    last_virtual = num_stages * v - 1
    m = len({split_action(a)[1] for a in actions})
    params = [q for mod in modules for q in mod.parameters()]
    stash: dict[tuple, tuple] = {}  # (chunk, micro) -> (input, output or loss): kept alive for its backward
    saved: dict[tuple, int] = {}  # (chunk, micro) -> bytes autograd saved in its forward
    received: dict[tuple, torch.Tensor] = {}
    losses, timeline, peak, live_bytes, peak_bytes = {}, [], 0, 0, 0
    steps = list(with_p2p(actions, num_stages, stage, v))
    p2p.post_receives([(kind, key) for _, kind, key in receives(steps, lambda c: virtual_stage(stage, c, num_stages), m)])
    dist.barrier()  # every rank has posted its receives: no message of this step arrives before its receive
    t0 = time.perf_counter()
    for action in steps:
        kind, i, c = split_action(action)
        vs = virtual_stage(stage, c, num_stages)
        first, last = vs == 0, vs == last_virtual
        key = message_key(kind, vs, i, m)
        if kind == "recv_forward":
            received[("x", c, i)] = p2p.recv_forward(key)  # [micro_batch, hidden], requires grad
        elif kind == "recv_backward":
            received[("g", c, i)] = p2p.recv_backward(key)  # [micro_batch, hidden]
        elif kind == "send_forward":
            p2p.send_forward(stash[(c, i)][1], key)
        elif kind == "send_backward":
            p2p.send_backward(stash.pop((c, i))[0].grad, key)
        elif kind == "F":
            start = time.perf_counter()
            x = inputs[i] if first else received.pop(("x", c, i))
            counter = [0]
            with saved_bytes(params, counter):
                y = run(c, i, x)  # [micro_batch, hidden]
                if last:  # Megatron divides each micro-batch's loss by m
                    y = loss(y, i) if loss is not None else loss_fn(y, targets[i]) / m
            if last:
                losses[i] = y.item() * (1 if loss is not None else m)
            stash[(c, i)], saved[(c, i)] = (x, y), counter[0]
            live_bytes += counter[0]
            peak, peak_bytes = max(peak, len(stash)), max(peak_bytes, live_bytes)
            pad_to(start, forward_s / v)
            timeline.append({"kind": "F", "micro": i, "chunk": c, "start": start - t0, "end": time.perf_counter() - t0})
        elif kind == "B":
            start = time.perf_counter()
            x, y = stash[(c, i)]
            if last:
                y.backward()
            else:
                torch.autograd.backward(y, grad_tensors=received.pop(("g", c, i)))
            live_bytes -= saved.pop((c, i))  # backward has consumed (and freed) what this forward saved
            if first:
                stash.pop((c, i))  # nothing to send back: free the stash here
            pad_to(start, backward_s / v)
            timeline.append({"kind": "B", "micro": i, "chunk": c, "start": start - t0, "end": time.perf_counter() - t0})
    p2p.finish()
    if stash:  # every micro-batch's backward must have freed its activations
        raise RuntimeError(f"stage {stage} still holds micro-batches {sorted(stash)} after its schedule")
    return {"timeline": timeline, "losses": [losses[i] for i in sorted(losses)], "peak_stash": peak,
            "peak_saved_bytes": peak_bytes, **p2p.stats()}


def run_split_schedule(table, modules, links, *, stage: int, num_stages: int, placement: str, inputs, targets,
                       forward_s: float = 0.0, backward_s: float = 0.0, weight_s: float = 0.0) -> dict:
    """Run row ``stage`` of ``table`` (every rank's actions, F / B / W) after checking the whole table.

    ``modules``: this rank's chunks (``model.py`` Layer stacks), chunk c holding virtual stage
    ``placed_stage(stage, c, num_stages, placement)``; ``links[c]`` the ``P2P`` of chunk c (its previous and next
    virtual stage's ranks, None where that stage is on this rank or does not exist). B is the input gradient and W
    the weight gradient when the table has W actions; without them B does both. ``forward_s`` / ``backward_s`` /
    ``weight_s`` pad an F / B / W of the whole rank's share (a chunk's action: 1/v of it).

    Returns the timeline (kinds F, B and W), the micro-batch losses (on the rank with the last virtual stage), the
    peak number of micro-batch-chunks between F and B (``peak_stash``) and between B and W (``peak_weight_stash``),
    the peak bytes both stashes hold together (``peak_saved_bytes``) and the messages of all links."""
    m = len(inputs)
    check_schedule(table, m, placement)  # raises ValueError, on every rank alike, before any message is posted
    modules = list(modules) if isinstance(modules, (list, tuple)) else [modules]
    layers = [split_backward.stage_layers(mod) for mod in modules]
    v, actions = len(modules), table[stage]
    split = any(a[0] == "W" for row in table for a in row)
    last_virtual = (2 * num_stages if placement == "v" else num_stages * v) - 1

    def here(virtual: int) -> bool:  # a neighbouring virtual stage on this rank: hand over in memory
        return 0 <= virtual <= last_virtual and rank_of(virtual, num_stages, placement)[0] == stage

    stash: dict[tuple, tuple] = {}  # (chunk, micro) -> (forward's stash, output): F -> B
    for_w: dict[tuple, list] = {}  # (chunk, micro) -> [(x, dz)] per layer: B -> W
    held_bytes: dict[tuple, int] = {}  # (kind of stash, chunk, micro) -> bytes
    received: dict[tuple, torch.Tensor] = {}
    handed: dict[tuple, torch.Tensor] = {}  # ("x" | "g", virtual stage, micro): from this rank's other chunk
    to_send: dict[tuple, torch.Tensor] = {}  # (chunk, micro) -> input gradient, until its send_backward
    losses, timeline = {}, []
    peak = {"stash": 0, "weight": 0, "bytes": 0}
    steps = list(with_messages(actions, num_stages, stage, v, placement))
    posted = receives(steps, lambda c: placed_stage(stage, c, num_stages, placement), m)
    for c, link in enumerate(links):
        link.post_receives([(kind, key) for chunk, kind, key in posted if chunk == c])
    dist.barrier()  # every rank has posted its receives: no message of this step arrives before its receive
    t0 = time.perf_counter()
    for action in steps:
        kind, i, c = split_action(action)
        vs = placed_stage(stage, c, num_stages, placement)
        key = message_key(kind, vs, i, m)
        if kind == "recv_forward":
            received[("x", c, i)] = links[c].recv_forward(key)  # [micro_batch, hidden]
        elif kind == "recv_backward":
            received[("g", c, i)] = links[c].recv_backward(key)  # [micro_batch, hidden]
        elif kind == "send_forward":
            links[c].send_forward(stash[(c, i)][1], key)
        elif kind == "send_backward":
            links[c].send_backward(to_send.pop((c, i)), key)
        elif kind == "F":
            start = time.perf_counter()
            x = inputs[i] if vs == 0 else received.pop(("x", c, i)) if ("x", c, i) in received else handed.pop(("x", vs, i))
            y, saved = split_backward.forward(layers[c], x)  # [micro_batch, hidden]
            if vs == last_virtual:
                losses[i] = loss_fn(y, targets[i]).item()
            elif here(vs + 1):  # the V's turn: chunk 0's output is chunk 1's input, on this rank
                handed[("x", vs + 1, i)] = y
            stash[(c, i)] = (saved, y)
            held_bytes[("F", c, i)] = split_backward.stash_bytes(saved, [(y,)])
            pad_to(start, forward_s / v)
            timeline.append({"kind": "F", "micro": i, "chunk": c, "start": start - t0, "end": time.perf_counter() - t0})
        elif kind == "B":
            start = time.perf_counter()
            saved, y = stash.pop((c, i))
            if vs == last_virtual:  # the loss's own gradient, by autograd: each micro-batch's loss scaled by 1/m
                with torch.enable_grad():
                    out = y.detach().requires_grad_()
                    dy, = torch.autograd.grad(loss_fn(out, targets[i]) / m, out)
            else:
                dy = received.pop(("g", c, i)) if ("g", c, i) in received else handed.pop(("g", vs, i))
            dx, w_stash = split_backward.backward_input(layers[c], saved, dy, need_input_grad=vs > 0)
            if vs > 0:
                if here(vs - 1):
                    handed[("g", vs - 1, i)] = dx
                else:
                    to_send[(c, i)] = dx
            del held_bytes[("F", c, i)]
            if split:
                for_w[(c, i)] = w_stash
                held_bytes[("W", c, i)] = split_backward.stash_bytes(w_stash)
            else:
                split_backward.backward_weight(layers[c], w_stash)
            pad_to(start, (backward_s if split else backward_s + weight_s) / v)
            timeline.append({"kind": "B", "micro": i, "chunk": c, "start": start - t0, "end": time.perf_counter() - t0})
        elif kind == "W":
            start = time.perf_counter()
            split_backward.backward_weight(layers[c], for_w.pop((c, i)))
            del held_bytes[("W", c, i)]
            pad_to(start, weight_s / v)
            timeline.append({"kind": "W", "micro": i, "chunk": c, "start": start - t0, "end": time.perf_counter() - t0})
        peak = {"stash": max(peak["stash"], len(stash)), "weight": max(peak["weight"], len(for_w)),
                "bytes": max(peak["bytes"], sum(held_bytes.values()))}
    for link in links:
        link.finish()
    left = [name for name, d in (("activations", stash), ("weight stashes", for_w), ("received tensors", received),
                                 ("hand-offs", handed), ("unsent gradients", to_send)) if d]
    if left:  # a checked table frees everything: anything left means the executor and the checker disagree
        raise RuntimeError(f"stage {stage} still holds {', '.join(left)} after its schedule")
    stats = [link.stats() for link in links]
    return {"timeline": timeline, "losses": [losses[i] for i in sorted(losses)], "peak_stash": peak["stash"],
            "peak_weight_stash": peak["weight"], "peak_saved_bytes": peak["bytes"],
            **{key: {d: sum(s[key][d] for s in stats) for d in parts}
               for key, parts in (("sent_bytes", DIRECTIONS), ("messages", DIRECTIONS), ("received", DIRECTIONS),
                                  ("posted_ahead", DIRECTIONS), ("sent_on", GROUPS))}}
