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
from workers.zero.model import OPTIMIZER_CLASSES, model_config, flat_params, loss_fn, make_batches, make_model, shard_rows

STEPS = 3
GLOBAL_BATCH = 8
# 29403 parameters: odd, so they do not split into 2 or 4 equal shards and an answer must pad (or split unevenly).
CFG = model_config(61, 16, 33, 3, 2)
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
                    raise Wrong("every rank ends with the same parameters, but each element was stepped with one "
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


def _padded_flat(tensors, n: int) -> torch.Tensor:
    """``tensors`` end to end, padded with zeros to n equal shards: [n * ceil(total / n)]."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    return torch.cat([flat, flat.new_zeros(n * math.ceil(flat.numel() / n) - flat.numel())])


def check_zero2_grad_hooks(ctx, answer) -> None:
    """ZeRO-2's gradient hook: the shard filled, averaged, from inside backward; no whole gradient kept."""
    n, rank = ctx.world_size, ctx.rank
    batch = make_batches(CFG, GLOBAL_BATCH, 1)[0]
    reference = make_model(CFG, seed=0)  # one process, the whole batch: the mean gradient
    loss_fn(reference, batch).backward()
    want_flat = _padded_flat([p.grad for p in reference.parameters()], n)  # [n S]
    S = want_flat.numel() // n
    want = want_flat[rank * S:(rank + 1) * S]
    local = make_model(CFG, seed=0)  # this rank's rows alone: what a gradient never reduced looks like
    loss_fn(local, shard_rows(batch, rank, n)).backward()
    local_flat = _padded_flat([p.grad for p in local.parameters()], n)

    model = make_model(CFG, seed=0).to(ctx.device)
    params = list(model.parameters())  # the tied embedding/head weight once
    grad_shard = torch.zeros(S, device=ctx.device)
    answer(params, grad_shard)
    loss_fn(model, shard_rows(batch, rank, n).to(ctx.device)).backward()
    got = grad_shard.detach().cpu()
    kept = [p for p in params if p.grad is not None]

    def fired():
        if not got.any() and want.any():
            raise Wrong(f"grad_shard is still all zeros when backward returns: the reduce-scatter never ran during "
                        f"backward. Does your hook count {len(params)} gradients (the tied embedding and LM head are "
                        "one Parameter, so one gradient), and launch when the last one lands?")
    agree(fired)

    def nothing_whole():
        if kept:
            held = sum(p.grad.nbytes for p in kept)
            raise Wrong(f"after backward {len(kept)} of the {len(params)} parameters still hold a whole .grad "
                        f"({held:,} bytes on rank {rank}): ZeRO-2 keeps only this rank's shard of the reduced "
                        "gradient. Set each p.grad = None once its bucket has been reduce-scattered")
    agree(nothing_whole)

    def averaged():
        if torch.allclose(got, want, **TOL):
            return
        if n > 1 and torch.allclose(got * n, want, **TOL):
            raise Wrong(f"grad_shard is 1/{n} of the mean gradient's slice: the average was taken twice (pre-scaling "
                        f"by 1/{n} before a SUM already gives the mean; divide once)")
        if n > 1 and torch.allclose(got, want * n, **TOL):
            raise Wrong(f"grad_shard is {n} times the mean gradient's slice: reduce-scatter SUMs over the ranks; "
                        f"divide by the world size ({n}), before or after")
        mine = local_flat[rank * S:(rank + 1) * S]
        if n > 1 and torch.allclose(got, mine, **TOL):
            raise Wrong("grad_shard holds this rank's own gradient slice, not the mean over the ranks: it was never "
                        "reduced. Reduce-scatter the flattened gradient")
        for k in range(n):
            if k != rank and torch.allclose(got, want_flat[k * S:(k + 1) * S], **TOL):
                raise Wrong(f"rank {rank} holds slice {k} of the gradient: rank r's shard is elements "
                            f"[r*S, (r+1)*S) of the flattened gradient (S = {S})")
        err = (got - want).abs().max().item()
        raise Wrong(f"grad_shard differs from the mean gradient's slice {rank} by up to {err:.3g}: flatten the "
                    f"gradients in the order of params, pad with zeros to {n} x {S} elements, reduce-scatter")
    agree(averaged)


class _Freed(RuntimeError):
    """Raised by the checker's guard instead of letting torch read a freed buffer (which would crash the rank)."""


def check_zero3_unit_hooks(ctx, answer) -> None:
    """ZeRO-3's gather-then-free around one unit: whole only during its forward and its backward."""
    from workers.model import DenseBlock

    n, rank = ctx.world_size, ctx.rank
    hidden = CFG.hidden
    torch.manual_seed(0)
    reference = DenseBlock(CFG.block())
    x0 = torch.randn(8, 2, hidden, generator=torch.Generator().manual_seed(1))  # [s, b, h], the same on every rank
    out_ref = reference(x0)
    out_ref.square().mean().backward()

    torch.manual_seed(0)
    unit = DenseBlock(CFG.block())
    params = list(unit.parameters())
    flat = _padded_flat(params, n)  # [n S]
    S = flat.numel() // n
    with torch.no_grad():
        offset = 0
        for p in params:
            p.data = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
    shard = flat[rank * S:(rank + 1) * S].clone()
    flat.untyped_storage().resize_(0)
    nbytes = flat.numel() * flat.element_size()

    def whole() -> bool:
        return flat.untyped_storage().nbytes() == nbytes

    answer(unit, flat, shard)
    seen = {}

    def before_forward(_module, _args):
        seen["before_forward"] = whole()
        if not whole():  # the learner's forward-pre hook ran before this one
            raise _Freed("course guard: forward")

    def after_forward(_module, _args, _out):
        seen["after_forward"] = whole()

    guards = [unit.register_forward_pre_hook(before_forward), unit.register_forward_hook(after_forward)]

    def unpack(t):
        if t.untyped_storage().nbytes() == 0 and t.numel():  # a freed buffer: reading it would crash the rank
            raise _Freed("course guard: backward")
        return t

    failure = None
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
            out = unit(x0.clone())
        if isinstance(out, torch.Tensor):
            out.square().mean().backward()
        else:
            failure = f"replaced by a {type(out).__name__}"
    except RuntimeError as exc:  # _Freed itself, or autograd's wrapping of it
        if "course guard" not in str(exc):
            raise
        failure = "forward" if "forward" in str(exc) else "backward"
    finally:
        for g in guards:
            g.remove()

    def output_kept():
        if failure and failure.startswith("replaced"):
            raise Wrong(f"the unit's output was {failure}: a forward hook's return value replaces the module's "
                        "output (a lambda returns whatever its expression gives, such as resize_'s storage); let "
                        "your forward hook return None")
    agree(output_kept)

    def gathered_for_forward():
        if failure == "forward":
            raise Wrong("the unit's parameters were not gathered when its forward began: all-gather the shards into "
                        "flat in a forward-pre hook (resize its storage back to flat.numel() * flat.element_size() "
                        "bytes first)")
    agree(gathered_for_forward)

    def freed_after_forward():
        if seen.get("after_forward"):
            raise Wrong("the unit's parameters are still whole after its forward: free them in a forward hook "
                        "(flat.untyped_storage().resize_(0)), and gather them again before its backward; that is "
                        "what keeps one unit whole at a time")
    agree(freed_after_forward)

    def gathered_for_backward():
        if failure == "backward":
            raise Wrong("backward needed the unit's parameters, but they had been freed after forward: gather them "
                        "again before the unit's backward (in the forward hook, register a hook on the output "
                        "tensor: it runs when the output's gradient arrives, before the unit's backward)")
    agree(gathered_for_backward)

    def freed_after_backward():
        if whole():
            raise Wrong("the unit's parameters are still whole after backward: free them once every parameter has "
                        "its gradient (a post-accumulate-grad hook that counts them), as ZeRO-3 does before "
                        "reduce-scattering the gradients")
    agree(freed_after_backward)

    def right():
        expect_out = out.detach()
        if not torch.allclose(expect_out, out_ref.detach(), **TOL):
            raise Wrong("the unit's output differs from the same block computed whole: the gathered buffer does not "
                        "hold the parameters (all-gather every rank's shard into flat, in rank order)")
        for (name, p), q in zip(unit.named_parameters(), reference.parameters()):
            if p.grad is None or not torch.allclose(p.grad, q.grad, **TOL):
                raise Wrong(f"the gradient of {name} differs from the whole block's: backward ran on parameters "
                            "that were not (all) gathered")
    agree(right)


CHECKS = {"zero1_step": check_zero1_step, "zero2_grad_hooks": check_zero2_grad_hooks,
          "zero3_unit_hooks": check_zero3_unit_hooks}


def main(ctx, exercise: str = "", answer=None):
    return run_exercise(ctx, CHECKS, exercise, answer)
