"""Rank-side checks for chapter 11: the sharded optimizer step (ZeRO-1), ZeRO-2's gradient hook and ZeRO-3's
gather-then-free around a unit, on real ranks.

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

ZeRO-2 and ZeRO-3 run with every torch.distributed collective logged (``CollectiveLog``): ZeRO-2's backward must
run one reduce-scatter of the padded gradient and nothing else, at a parameter count that needs padding and at one
that needs none (its parameters handed over in reverse, so the last gradient to land is not the last listed);
ZeRO-3's gathers must be waited on before the unit reads flat, which the check says in a sentence instead of
letting the rank crash. ZeRO-3 runs a pre-norm and a post-norm block, and judges "freed" by the parameters' own
storage as well as flat's.
"""
from __future__ import annotations

import math
import re

import torch
import torch.distributed as dist

from workers.exercises.support import Wrong, agree, run_exercise
from workers.model import DenseBlock
from workers.zero.model import OPTIMIZER_CLASSES, model_config, flat_params, loss_fn, make_batches, make_model, shard_rows

STEPS = 3
GLOBAL_BATCH = 8
# 29403 parameters: odd, so they do not split into 2 or 4 equal shards and an answer must pad (or split unevenly).
CFG = model_config(61, 16, 33, 3, 2)
# SGD with momentum is linear in the gradient: reordered fp32 sums (any correct sync) stay at ~1e-7.
TOL = {"atol": 1e-5, "rtol": 1e-4}
# A model whose 15168 parameters split into 2 and 4 equal shards: the padding is then zero elements, and an answer that
# pads by a size of its own (one element more per shard) is caught; its parameters are handed over in reverse order.
CFG_EVEN = model_config(62, 16, 32, 4, 1)
COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter", "all_gather_into_tensor", "all_gather",
               "broadcast", "reduce", "all_to_all_single", "all_to_all", "scatter", "gather", "all_gather_object")


class _Handle:
    """An async collective's handle as the answer sees it: forwards everything, and notes whether it was waited on."""

    def __init__(self, work, entry: dict):
        self._work, self._entry = work, entry

    def wait(self, *args, **kwargs):
        self._entry["waited"] = True
        return self._work.wait(*args, **kwargs)

    def get_future(self):
        self._entry["waited"] = True  # the answer waits on the future instead
        return self._work.get_future()

    def __getattr__(self, name):
        return getattr(self._work, name)


def _bytes_touched(args, kwargs) -> int:
    """The larger side of a collective: its biggest tensor argument, or the sum of a list of tensors."""
    sizes = [0]
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            sizes.append(a.numel() * a.element_size())
        elif isinstance(a, (list, tuple)) and a and all(isinstance(t, torch.Tensor) for t in a):
            sizes.append(sum(t.numel() * t.element_size() for t in a))
    return max(sizes)


class CollectiveLog:
    """Every torch.distributed collective the answer calls while open: its name, the bytes it touched, whether it
    ran asynchronously and whether the answer waited for it; ``phase`` says which part of the check was running."""

    def __init__(self):
        self.calls: list[dict] = []
        self.phase = "setup"
        self._saved = {}

    def __enter__(self):
        for name in COLLECTIVES:
            self._saved[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(name, self._saved[name]))
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self.settle()

    def _wrap(self, name, fn):
        def collective(*args, **kwargs):
            entry = {"name": name, "bytes": _bytes_touched(args, kwargs), "phase": self.phase,
                     "async": bool(kwargs.get("async_op")), "waited": False}
            self.calls.append(entry)
            work = fn(*args, **kwargs)
            if entry["async"] and work is not None:
                entry["work"] = work
                return _Handle(work, entry)
            return work
        return collective

    def unwaited(self, phase: str | None = None) -> list[dict]:
        return [c for c in self.calls if c["async"] and not c["waited"] and phase in (None, c["phase"])]

    def settle(self) -> None:
        """Wait for every collective the answer left running, so the check never frees or reads a tensor that an
        asynchronous collective still writes into (that would crash the rank, without a Python error)."""
        for c in self.unwaited():
            if "work" in c:
                c.pop("work").wait()


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

        def finite():
            bad = int((~torch.isfinite(got)).sum())
            if bad:
                raise Wrong(f"after step {step + 1}, {bad} of rank {rank}'s {n_params} parameters are NaN or infinite: "
                            "look for a division by zero, or a slice of the padded buffer read before it was filled")
        agree(finite)

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
                if halved is not None and torch.allclose(got, halved[1], **TOL):
                    raise Wrong(f"the update is {n // 2} times too large at world size {n}: the summed gradient was "
                                f"divided by 2, which is the mean only at world size 2; divide by the world size")
            halved = _reference(batches[:1], grad_scale=n / 2) if n > 2 else None
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
    """ZeRO-2's gradient hook: the shard filled, averaged, from inside backward, by one reduce-scatter; no whole
    gradient kept. Twice: an odd parameter count (padding) in the listed order, then a count that splits evenly
    with the parameters handed over in reverse, so that the last gradient to land is not the last listed."""
    _zero2_case(ctx, answer, CFG, reverse=False)
    _zero2_case(ctx, answer, CFG_EVEN, reverse=True)


def _zero2_case(ctx, answer, cfg, *, reverse: bool) -> None:
    n, rank = ctx.world_size, ctx.rank
    batch = make_batches(cfg, GLOBAL_BATCH, 1)[0]
    reference = make_model(cfg, seed=0)  # one process, the whole batch: the mean gradient
    loss_fn(reference, batch).backward()
    order = list(reversed(list(reference.parameters()))) if reverse else list(reference.parameters())
    want_flat = _padded_flat([p.grad for p in order], n)  # [n S]
    S = want_flat.numel() // n
    want = want_flat[rank * S:(rank + 1) * S]
    local = make_model(cfg, seed=0)  # this rank's rows alone: what a gradient never reduced looks like
    loss_fn(local, shard_rows(batch, rank, n)).backward()
    local_order = list(reversed(list(local.parameters()))) if reverse else list(local.parameters())
    local_flat = _padded_flat([p.grad for p in local_order], n)

    model = make_model(cfg, seed=0).to(ctx.device)
    params = list(model.parameters())  # the tied embedding/head weight once
    if reverse:
        params.reverse()
    n_params = sum(p.numel() for p in params)
    case = (f"the model of {n_params} parameters ({'a multiple of' if n_params % n == 0 else 'not a multiple of'} "
            f"{n}{', handed over in reverse order' if reverse else ''})")
    grad_shard = torch.zeros(S, device=ctx.device)
    raised = None
    with CollectiveLog() as log:
        answer(params, grad_shard)
        log.phase = "backward"
        try:
            loss_fn(model, shard_rows(batch, rank, n).to(ctx.device)).backward()
        except Exception as exc:  # noqa: BLE001 - the answer's hook raised inside backward: said in a sentence
            raised = exc
    got = grad_shard.detach().cpu()
    kept = [p for p in params if p.grad is not None]
    during = [c for c in log.calls if c["phase"] == "backward"]
    scattered = [c for c in during if c["name"] in ("reduce_scatter_tensor", "reduce_scatter")]
    padded_bytes = n * S * grad_shard.element_size()

    def ran():
        if raised is None:
            return
        # gloo prefixes its own failures with "[rank0]:[F... ProcessGroupGloo.cpp:...] Check failed: ": keep the check
        said = re.sub(r"^(\[[^\]]*\]:?)+\s*", "", (str(raised).splitlines() or [""])[0]).rstrip(". ")
        if isinstance(raised, AttributeError) and "NoneType" in said:
            raise Wrong(f"for {case}, your hook read a .grad that was still None ({said}): it ran before every "
                        "gradient had landed. Gradients land in the order backward computes them, not in the order "
                        f"of params: count the {len(params)} gradients and launch when the count reaches zero")
        raise Wrong(f"for {case}, your hook raised {type(raised).__name__} during backward: {said}. The flat gradient "
                    f"must be padded to exactly n x S = {n} x {S} elements (S = grad_shard.numel()), zero padding "
                    "when the parameters already split evenly")
    agree(ran)

    def traffic():
        others = sorted({c["name"] for c in during} - {"reduce_scatter_tensor", "reduce_scatter"})
        if others:
            moved = sum(c["bytes"] for c in during if c["name"] in others)
            raise Wrong(f"during backward your hook ran {', '.join(others)} ({moved:,} bytes on rank {rank}), where "
                        f"ZeRO-2 runs one reduce-scatter of the {padded_bytes:,}-byte padded gradient: an all-reduce "
                        "moves twice the bytes and leaves every rank holding the whole reduced gradient, of which it "
                        "keeps 1/n. Reduce-scatter straight into grad_shard")
        if not scattered and not got.any() and want.any():
            raise Wrong(f"grad_shard is still all zeros when backward returns: the reduce-scatter never ran during "
                        f"backward. Does your hook count {len(params)} gradients (the tied embedding and LM head are "
                        "one Parameter, so one gradient), and launch when the last one lands?")
        if log.unwaited("backward"):
            raise Wrong("the reduce-scatter ran during backward with async_op=True, but nothing waited for its handle "
                        "before backward returned: grad_shard may be read before the result lands. Call .wait() on "
                        "the handle in the hook (or run it synchronously)")
        moved = sum(c["bytes"] for c in scattered)
        if moved > padded_bytes:
            raise Wrong(f"during backward your hook reduce-scattered {moved:,} bytes on rank {rank} in "
                        f"{len(scattered)} call(s), where the padded gradient is {padded_bytes:,} bytes: each gradient "
                        "must go over the wire once; launch when the last gradient lands, not at every one")
        if not got.any() and want.any():
            raise Wrong("a reduce-scatter ran during backward, but grad_shard is still all zeros: its result went to "
                        "another tensor. Pass grad_shard itself as the output (reduce_scatter_tensor(grad_shard, "
                        "flat)); rebinding the name grad_shard inside the hook does not fill the caller's tensor")
    agree(traffic)

    def nothing_whole():
        if kept:
            held = sum(p.grad.nbytes for p in kept)
            raise Wrong(f"after backward {len(kept)} of the {len(params)} parameters still hold a whole .grad "
                        f"({held:,} bytes on rank {rank}): ZeRO-2 keeps only this rank's shard of the reduced "
                        "gradient. Set each p.grad = None once its bucket has been reduce-scattered")
    agree(nothing_whole)

    def averaged():
        bad = int((~torch.isfinite(got)).sum())
        if bad:
            raise Wrong(f"grad_shard holds {bad} NaN or infinite value(s) on rank {rank} after backward: the mean of "
                        "finite gradients is finite; look for a division by zero or padding taken from uninitialised "
                        "memory (torch.empty) instead of zeros")
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
        raise Wrong(f"for {case}, grad_shard differs from the mean gradient's slice {rank} by up to {err:.3g}: "
                    f"flatten the gradients in the order of params, pad with zeros to {n} x {S} elements, "
                    "reduce-scatter")
    agree(averaged)


class _Freed(RuntimeError):
    """Raised by the checker's guard instead of letting torch read a freed buffer (which would crash the rank)."""


class PostNormBlock(DenseBlock):
    """The original Transformer's post-LN order, ``h = ln1(x + attn(x))``, ``y = ln2(h + mlp(h))``, with the
    parameters listed as in the pre-LN block: ln1 comes first, but its gradient lands in the middle of backward,
    before the attention's, where in the pre-LN block it is the last."""

    def forward(self, x: torch.Tensor, drop=None) -> torch.Tensor:  # [s, b, h]
        h = self.ln1(x + self.attention(x))
        return self.ln2(h + self.mlp(h))


def check_zero3_unit_hooks(ctx, answer) -> None:
    """ZeRO-3's gather-then-free around one unit: whole only during its forward and its backward; a pre-LN block,
    then a post-LN one, whose gradients land in another order."""
    _zero3_case(ctx, answer, DenseBlock, "")
    _zero3_case(ctx, answer, PostNormBlock, "in the post-norm block (ln1(x + attention(x)), ln1's gradient lands "
                                            "before the attention's): ")


def _zero3_case(ctx, answer, block_cls, where: str) -> None:
    n, rank = ctx.world_size, ctx.rank
    hidden = CFG.hidden
    torch.manual_seed(0)
    reference = block_cls(CFG.block())
    x0 = torch.randn(8, 2, hidden, generator=torch.Generator().manual_seed(1))  # [s, b, h], the same on every rank
    out_ref = reference(x0)
    out_ref.square().mean().backward()

    torch.manual_seed(0)
    unit = block_cls(CFG.block())
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

    def held() -> int:
        """Bytes the parameters' own storage holds: 0 while they are views of the freed flat buffer."""
        return sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in params}.values())

    seen = {}

    def before_forward(_module, _args):
        if log.unwaited():  # filled by a collective still in flight: reading it now would race (and may crash)
            log.settle()
            raise _Freed("course guard: unwaited-forward")
        seen["before_forward"] = whole()
        if not whole():  # the learner's forward-pre hook ran before this one
            raise _Freed("course guard: forward")

    def after_forward(_module, _args, _out):
        seen["after_forward"] = whole()
        seen["held_after_forward"] = held()

    def at_backward(_grad):  # registered after the learner's hook on the output: runs just after it
        seen["backward_start"] = whole()
        if log.unwaited():
            log.settle()
            raise _Freed("course guard: unwaited-backward")

    def unpack(t):
        if t.untyped_storage().nbytes() == 0 and t.numel():  # a freed buffer: reading it would crash the rank
            raise _Freed("course guard: backward")
        return t

    failure = None
    with CollectiveLog() as log:
        answer(unit, flat, shard)
        guards = [unit.register_forward_pre_hook(before_forward), unit.register_forward_hook(after_forward)]
        try:
            log.phase = "forward"
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
                out = unit(x0.clone())
            if isinstance(out, torch.Tensor):
                out.register_hook(at_backward)
                log.phase = "backward"
                out.square().mean().backward()
            else:
                failure = f"replaced by a {type(out).__name__}"
        except RuntimeError as exc:  # _Freed itself, or autograd's wrapping of it
            if "course guard" not in str(exc):
                raise
            failure = str(exc).split("course guard: ", 1)[1].split()[0]
        finally:
            for g in guards:
                g.remove()

    def output_kept():
        if failure and failure.startswith("replaced"):
            raise Wrong(f"{where}the unit's output was {failure}: a forward hook's return value replaces the module's "
                        "output (a lambda returns whatever its expression gives, such as resize_'s storage); let "
                        "your forward hook return None")
    agree(output_kept)

    def waited():
        if failure and failure.startswith("unwaited"):
            when = "forward" if failure == "unwaited-forward" else "backward"
            raise Wrong(f"{where}the all-gather for the unit's {when} was launched with async_op=True, but nothing "
                        f"waited for its handle before the {when} read flat: the parameters would be read while the "
                        "collective still writes them (a race that can crash the rank). Call .wait() on the handle "
                        "inside the hook, before it returns")
    agree(waited)

    def gathered_for_forward():
        if failure == "forward":
            raise Wrong(f"{where}the unit's parameters were not gathered when its forward began: all-gather the "
                        "shards into flat in a forward-pre hook (resize its storage back to flat.numel() * "
                        "flat.element_size() bytes first)")
    agree(gathered_for_forward)

    def freed_after_forward():
        if seen.get("after_forward"):
            raise Wrong(f"{where}the unit's parameters are still whole after its forward: free them in a forward hook "
                        "(flat.untyped_storage().resize_(0)), and gather them again before its backward; that is "
                        "what keeps one unit whole at a time")
        if seen.get("held_after_forward"):
            raise Wrong(f"{where}flat was freed after the forward, but the unit's parameters still hold "
                        f"{seen['held_after_forward']:,} bytes of storage of their own: they are no longer views of "
                        "flat (p.data was rebound to a copy), so freeing flat freed nothing they use. Leave them views "
                        "of flat and all-gather into flat in place")
    agree(freed_after_forward)

    def gathered_for_backward():
        if failure == "backward" and seen.get("backward_start"):
            raise Wrong(f"{where}the unit's parameters were gathered for backward but freed again before backward "
                        "had finished with them: the gradient that lands first, or the first in the list, is not the "
                        "last one backward computes. Free once every parameter has its gradient (count them in a "
                        "post-accumulate-grad hook)")
        if failure == "backward":
            raise Wrong(f"{where}backward needed the unit's parameters, but they had been freed after forward: gather "
                        "them again before the unit's backward (in the forward hook, register a hook on the output "
                        "tensor: it runs when the output's gradient arrives, before the unit's backward)")
    agree(gathered_for_backward)

    def freed_after_backward():
        if whole():
            raise Wrong(f"{where}the unit's parameters are still whole after backward: free them once every parameter "
                        "has its gradient (a post-accumulate-grad hook that counts them), as ZeRO-3 does before "
                        "reduce-scattering the gradients")
        if held():
            raise Wrong(f"{where}flat was freed after backward, but the unit's parameters still hold {held():,} bytes "
                        "of storage of their own (p.data rebound to a copy): leave them views of flat")
    agree(freed_after_backward)

    def right():
        expect_out = out.detach()
        if not torch.allclose(expect_out, out_ref.detach(), **TOL):
            raise Wrong(f"{where}the unit's output differs from the same block computed whole: the gathered buffer "
                        "does not hold the parameters (all-gather every rank's shard into flat, in rank order)")
        for (name, p), q in zip(unit.named_parameters(), reference.parameters()):
            if p.grad is None or not torch.allclose(p.grad, q.grad, **TOL):
                raise Wrong(f"{where}the gradient of {name} differs from the whole block's: backward ran on "
                            "parameters that were not (all) gathered")
    agree(right)


# The whole gradient the clipping check shards: parameters of uneven sizes, so that a rank's shard holds some whole,
# some in part and some not at all (empty views), as ZeRO-3's sharded .grad do.
CLIP_SIZES = (37, 64, 5, 128, 3, 90)
CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s: coef = max_norm / (total + 1e-6), at most 1


def _clip_case(n: int, rank: int, seed: int):
    """The whole gradient (the same on every rank, from ``seed``) and this rank's sharded views of it: ZeRO-3's
    layout, one flat buffer padded to n equal shards, each parameter's elements in this rank's shard."""
    g = torch.Generator().manual_seed(seed)
    whole = [torch.randn(k, generator=g) * (0.1 + torch.rand((), generator=g)) for k in CLIP_SIZES]
    flat = _padded_flat(whole, n)  # [n S]
    S = flat.numel() // n
    shard = flat[rank * S:(rank + 1) * S].clone()  # [S]
    views, offset = [], 0
    for t in whole:
        a, b = (min(max(offset + d - rank * S, 0), S) for d in (0, t.numel()))
        views.append(shard[a:b])
        offset += t.numel()
    return whole, shard, views


def check_clip_grad_norm_sharded(ctx, answer) -> None:
    """Gradient-norm clipping over ZeRO-3's shards: the norm of the whole gradient (the squares summed over every
    rank's elements, one all-reduce, then the square root), the same on every rank; the shards scaled in place by
    min(1, max_norm / (norm + 1e-6)); clipped when the norm is above max_norm, untouched below; a NaN reported."""
    for seed, factor in ((11, 0.5), (12, 2.0)):
        _clip_one(ctx, answer, seed, factor)
    _clip_nan(ctx, answer)


def _clip_one(ctx, answer, seed: int, factor: float) -> None:
    n, rank = ctx.world_size, ctx.rank
    whole, shard, views = _clip_case(n, rank, seed)
    total = torch.cat(whole).double().norm().item()
    max_norm = factor * total
    coef = min(1.0, max_norm / (total + CLIP_EPS))
    want = shard * coef
    before = shard.clone()
    local = before.double().norm().item()
    norms = [None] * n
    dist.all_gather_object(norms, local)
    clipping = coef < 1.0
    case = (f"max_norm = {max_norm:.4g} {'below' if clipping else 'above'} the whole gradient's norm {total:.4g} "
            f"(seed {seed}, {len(CLIP_SIZES)} parameters sharded over {n} ranks)")
    got, raised = None, None
    with CollectiveLog() as log:
        try:
            got = answer(views, max_norm)
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001 - the answer raised: said in a sentence
            raised = exc

    def ran():
        if raised is not None:
            raise Wrong(f"with {case}, your function raised {type(raised).__name__}: {raised}")
        try:
            float(torch.as_tensor(got))
        except (TypeError, ValueError, RuntimeError):
            raise Wrong(f"return the total norm (a number or a 0-d tensor), as torch.nn.utils.clip_grad_norm_ does; "
                        f"got {type(got).__name__}") from None
    agree(ran)
    value = float(torch.as_tensor(got).double())

    def traffic():
        gathered = sorted({c["name"] for c in log.calls if "gather" in c["name"]})
        if gathered:
            moved = sum(c["bytes"] for c in log.calls if c["name"] in gathered)
            raise Wrong(f"your function gathered the gradients ({', '.join(gathered)}, {moved:,} bytes on rank "
                        f"{rank}) to compute the norm on every rank: the norm needs one number per rank, the sum of "
                        "its squares; all-reduce that (a few bytes), not the shards")
        if not log.calls and n > 1:
            raise Wrong(f"your function ran no collective, so the norm it used is the norm of only this rank's shard "
                        f"({local:.4g} on rank {rank}; the whole gradient's is {total:.4g}): each rank holds a part of "
                        "the gradient. Sum the squares of your elements, all-reduce the sum over the ranks, then take "
                        "the square root")
    agree(traffic)

    def norm_returned():
        if abs(value - total) <= 1e-5 * total:
            return
        if not math.isfinite(value):
            raise Wrong(f"with {case}, the norm you returned is {value} from finite gradients")
        if n > 1 and abs(value - local) <= 1e-5 * total:
            raise Wrong(f"the norm you returned is only this rank's shard's ({local:.4g} on rank {rank}; the whole "
                        f"gradient's is {total:.4g}): all-reduce the sum of squares over the ranks")
        if abs(value - sum(norms)) <= 1e-5 * total:
            raise Wrong(f"the norm you returned, {value:.4g}, is the sum of the ranks' norms: norms do not add "
                        f"(the whole gradient's is {total:.4g}). All-reduce the sum of squares, then take the square "
                        "root")
        if abs(value - total ** 2) <= 1e-5 * total ** 2:
            raise Wrong(f"the norm you returned, {value:.4g}, is the sum of squares ({total:.4g} squared): take the "
                        "square root after the all-reduce")
        if abs(value - total / math.sqrt(n)) <= 1e-5 * total:
            raise Wrong(f"the norm you returned is the whole gradient's divided by sqrt({n}): the squares were "
                        "averaged over the ranks; all-reduce their SUM")
        if clipping and abs(value - max_norm) <= 1e-4 * max_norm:
            raise Wrong(f"you returned the norm after clipping ({value:.4g} = max_norm): return the norm before "
                        "clipping, as torch.nn.utils.clip_grad_norm_ does (it is what a training log records)")
        raise Wrong(f"with {case}, the norm you returned is {value:.6g} on rank {rank}; the whole gradient's is "
                    f"{total:.6g}")
    agree(norm_returned)

    def scaled():
        if torch.allclose(shard, want, rtol=1e-5, atol=1e-7):
            return
        if clipping and torch.equal(shard, before):
            raise Wrong(f"with {case}, the gradients are unchanged: scale them in place (g.mul_(coef)); a new list "
                        "or a rebound name does not change the tensors the optimizer reads")
        if not clipping and torch.allclose(shard, before * (max_norm / total), rtol=1e-5, atol=1e-7):
            raise Wrong(f"with {case}, your function scaled the gradients up to max_norm: clipping only scales down, "
                        "coef = min(1, max_norm / (norm + 1e-6))")
        err = (shard - want).abs().max().item()
        raise Wrong(f"with {case}, the clipped gradient differs from the expected by up to {err:.3g} on rank {rank}: "
                    "every rank must scale its shard by the same coef = min(1, max_norm / (norm + 1e-6)), the norm "
                    "that of the whole gradient")
    agree(scaled)


def _clip_nan(ctx, answer) -> None:
    """A NaN in one rank's shard: the whole gradient's norm is NaN, and every rank must say so (a diverged step is
    skipped or stopped by the caller that sees it); a norm that hides it lets the NaN reach the weights."""
    n, rank = ctx.world_size, ctx.rank
    _, shard, views = _clip_case(n, rank, 13)
    if rank == 0:
        shard[0] = float("nan")
    try:
        value = float(torch.as_tensor(answer(views, 1.0)).double())
    except NotImplementedError:
        raise
    except Exception:  # noqa: BLE001 - raising on a non-finite norm (error_if_nonfinite=True) reports it too
        value = math.nan

    def reported():
        if math.isfinite(value):
            raise Wrong(f"rank 0's shard holds a NaN, yet the norm you returned on rank {rank} is {value:.4g}: a NaN "
                        "or infinite gradient must make the norm NaN (or infinite) on every rank, as "
                        "torch.nn.utils.clip_grad_norm_ does, so that the caller sees the step went wrong; do not "
                        "filter or replace non-finite values")
    agree(reported)


CHECKS = {"zero1_step": check_zero1_step, "zero2_grad_hooks": check_zero2_grad_hooks,
          "zero3_unit_hooks": check_zero3_unit_hooks, "clip_grad_norm_sharded": check_clip_grad_norm_sharded}


def main(ctx, exercise: str = "", answer=None):
    return run_exercise(ctx, CHECKS, exercise, answer)
