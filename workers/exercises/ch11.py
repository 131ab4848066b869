"""Rank-side check for chapter 11's sharded optimizer step (ZeRO-1), on real ranks.

The learner writes ``zero1_step(params, state, make_optimizer)``. Every rank trains the tied-embedding GPT of
``workers/zero/model.py`` on its B/n rows for a few steps, calling the learner's step, and compares with the
single-process reference (whole batch, unsharded SGD with momentum). SGD, not Adam: Adam divides each update
by the size of its own gradient, so a gradient that is n times too large (a sum instead of a mean) moves Adam's
weights by almost exactly the same amount, and a missing average would go unnoticed.

What is checked, each with the message that names the mistake: the optimizer holds state for about 1/n of the
elements on each rank (and every element is stepped by exactly one rank); every parameter is updated on every
rank after the step (the re-sync); the gradient is the mean over ranks, not the sum; the optimizer is created
once, so its momentum carries over; the weights equal the reference after every step, and equal across ranks.
Ranks agree on a verdict before anyone raises, so a wrong answer never turns into a hang.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from workers.exercises.support import Wrong, agree, run_exercise
from workers.zero.model import OPTIMIZER_CLASSES, TiedGPTConfig, flat_params, loss_fn, make_batches, make_model, shard_rows

STEPS = 3
GLOBAL_BATCH = 8
# 29403 parameters: odd, so they do not split into 2 or 4 equal shards and an answer must pad (or split unevenly).
CFG = TiedGPTConfig(vocab=61, seq=16, hidden=33, heads=3, layers=2)
# SGD with momentum is linear in the gradient: reordered fp32 sums (any correct sync) stay at ~1e-7.
TOL = {"atol": 1e-5, "rtol": 1e-4}


def _reference(batches, grad_scale: float = 1.0) -> list[torch.Tensor]:
    """Single process, whole batch, plain SGD with momentum; ``grad_scale`` = n gives the 'summed' mistake."""
    cls, hyper = OPTIMIZER_CLASSES["sgd"]
    model = make_model(CFG, seed=0)
    opt = cls(model.parameters(), **hyper)
    out = [flat_params(model)]
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        loss_fn(model, batch).backward()
        for p in model.parameters():
            p.grad.mul_(grad_scale)
        opt.step()
        out.append(flat_params(model))
    return out


def _local_steps(batch, n: int) -> list[torch.Tensor]:
    """The weights after one step from the start if the gradient were rank r's own (its rows only), r < n: what an
    element's owner produces when the gradients are never reduced over the ranks."""
    cls, hyper = OPTIMIZER_CLASSES["sgd"]
    out = []
    for r in range(n):
        model = make_model(CFG, seed=0)
        opt = cls(model.parameters(), **hyper)
        loss_fn(model, shard_rows(batch, r, n)).backward()
        opt.step()
        out.append(flat_params(model))
    return out


def _state_numel(optimizers) -> int:
    """Elements of per-element state (momentum buffers) the optimizers this rank created hold."""
    total = 0
    for opt in optimizers:
        for p, state in opt.state.items():
            total += sum(v.numel() for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return total


def check_zero1_step(ctx, answer) -> None:
    n, rank = ctx.world_size, ctx.rank
    batches = make_batches(CFG, GLOBAL_BATCH, STEPS)
    want = _reference(batches)
    summed = _reference(batches[:1], grad_scale=float(n))
    model = make_model(CFG, seed=0).to(ctx.device)
    params = list(model.parameters())  # the tied embedding/head weight appears once
    n_params = sum(p.numel() for p in params)
    largest = max(p.numel() for p in params)
    created, given = [], []
    cls, hyper = OPTIMIZER_CLASSES["sgd"]

    def make_optimizer(tensors):
        tensors = list(tensors)
        given.append(sum(t.numel() for t in tensors))
        opt = cls(tensors, **hyper)
        created.append(opt)
        return opt

    state: dict = {}
    for step, batch in enumerate(batches):
        before = flat_params(model)
        for p in params:
            p.grad = None
        loss_fn(model, shard_rows(batch, rank, n).to(ctx.device)).backward()
        try:
            answer(params, state, make_optimizer)
        except (RuntimeError, ValueError) as exc:
            if n_params % n == 0 or isinstance(exc, NotImplementedError):  # the stub: "not attempted"
                raise
            raise Wrong(f"at world size {n} your step raised {type(exc).__name__}: {(str(exc).splitlines() or [''])[0].rstrip('. ')}. "
                        f"The model has {n_params} parameters, which do not split into {n} equal shards "
                        f"(reduce_scatter_tensor and all_gather_into_tensor need n equal slices): pad the flat "
                        f"buffer with zeros to n * ceil({n_params} / n) = {n * math.ceil(n_params / n)} elements, "
                        "and drop the padding when copying back") from None
        got = flat_params(model)

        if step == 0:
            def sharded():
                if not created:
                    raise Wrong("make_optimizer was never called: build the optimizer over your shard with "
                                "make_optimizer([...]) and call its step()")
                held = _state_numel(created)
                if held >= n_params and n > 1:
                    raise Wrong(f"rank {rank}'s optimizer holds state for {held} elements, the whole model's "
                                f"{n_params}: every rank stepped every parameter, which is plain DDP, not ZeRO-1. "
                                f"Give make_optimizer only this rank's 1/{n} of the parameters")
                if held > math.ceil(n_params / n) + largest:
                    raise Wrong(f"rank {rank}'s optimizer holds state for {held} elements, more than 1/{n} of the "
                                f"{n_params} (plus one tensor of slack for uneven splits): shard more evenly")
            agree(sharded)

            counts = [None] * n
            dist.all_gather_object(counts, _state_numel(created))

            def covered():
                total = sum(counts)
                if total < n_params:
                    pad = ""
                    if n_params % n and n_params - total < n:
                        pad = (f" {n_params} is not a multiple of {n}: slices of {n_params} // {n} = {n_params // n} "
                               f"leave the last {n_params % n} behind; pad to n * ceil(total / n) = "
                               f"{n * math.ceil(n_params / n)} elements (the padding is stepped too, and dropped)")
                    raise Wrong(f"the ranks' optimizers together hold state for {total} of the {n_params} elements: "
                                "some parameters are stepped by no rank; the shards must cover every parameter." + pad)
                if total > n_params + n - 1:  # n - 1: the most padding an equal split can need
                    raise Wrong(f"the ranks' optimizers together hold state for {total} elements, more than the "
                                f"{n_params} parameters: some are stepped by several ranks; shards must not overlap")
            agree(covered)

            first = got.to(ctx.device)
            rank0_first = first.clone()
            dist.broadcast(rank0_first, src=0)
            same = [None] * n
            dist.all_gather_object(same, bool(torch.equal(first, rank0_first)))

            def reduced():
                # Every element as its owner would step it with the owner's own gradient, and not the mean: the
                # gradients were never reduced over the ranks (a zero for tokens outside the owner's rows).
                if n == 1 or torch.allclose(got, want[1], **TOL):
                    return
                local = torch.stack(local_steps)  # [n, n_params]
                if all(same) and bool((local - got).abs().le(TOL["atol"] + TOL["rtol"] * got.abs()).any(0).all()):
                    raise Wrong(f"every rank ends with the same parameters, but each element was stepped with one "
                                "rank's own gradient, not the mean over the ranks: the gradients were never reduced. "
                                "Reduce them before the step (reduce_scatter_tensor gives each rank the sum of its "
                                "slice; divide by the world size), then step and all-gather")
            local_steps = _local_steps(batch, n)
            agree(reduced)

            def resynced():
                changed = want[1] != want[0]
                stale = int(((got == before) & changed).sum())
                if not stale:
                    return
                if all(same):
                    raise Wrong(f"after the step, {stale} of the {n_params} parameters still hold their values from "
                                "before the step on every rank, although the averaged gradient moves them: the ranks "
                                "agree (the all-gather happened), so these elements were stepped with a zero "
                                "gradient, or not at all. Are the gradients reduced over the ranks before the step, "
                                "and does every element belong to some rank's slice?")
                raise Wrong(f"after the step, {stale} of the {n_params} parameters on rank {rank} still hold their "
                            "values from before the step, and the ranks' parameters differ: each rank updated only its "
                            "own shard. Re-synchronise: all_gather (or broadcast from each owner) the updated shards "
                            "so every rank has the full model")
            agree(resynced)

            def averaged():
                if n > 1 and torch.allclose(got, summed[1], **TOL):
                    raise Wrong(f"the update is {n} times too large at world size {n}: all_reduce / reduce_scatter "
                                "SUM the gradients over the ranks; divide by the world size to average them")
            agree(averaged)

        def right():
            if not torch.allclose(got, want[step + 1], **TOL):
                err = (got - want[step + 1]).abs().max().item()
                hint = ""
                if len(created) > 1:
                    hint = (f" You created {len(created)} optimizers in {step + 1} step(s): a new optimizer forgets "
                            "its momentum; create it once and keep it in `state`.")
                raise Wrong(f"weights after step {step + 1} differ from the unsharded single-process SGD by up to "
                            f"{err:.3g} (tolerance {TOL['atol']:g} + {TOL['rtol']:g}*|w|).{hint}")
        agree(right)

        mine = got.to(ctx.device)
        rank0 = mine.clone()
        dist.broadcast(rank0, src=0)

        def equal_across_ranks():
            if not torch.equal(mine, rank0):
                raise Wrong(f"after step {step + 1} rank {rank}'s parameters differ from rank 0's: every rank must "
                            "end the step with the same, full set of updated parameters")
        agree(equal_across_ranks)


CHECKS = {"zero1_step": check_zero1_step}


def main(ctx, exercise: str = "", answer=None):
    return run_exercise(ctx, CHECKS, exercise, answer)
