"""Rank-side checks for chapter 04: a column-parallel forward, a row-parallel forward with the bias once,
the split of SwiGLU's fused [gate; up] weight, and the cross-entropy from logits split by vocabulary. All on real
ranks, against the dense layer (or the dense loss).

Every rank builds the same dense layer from one seed, hands the learner's function its shard, runs
forward *and* backward (the backward is where a missing ``f`` shows), and compares. A check runs in
stages, each ended by ``agree``: the ranks share their verdicts before the next step that communicates
(the backward, which may run the learner's ``f``; the parallel MLP's all-reduce). So every rank runs that
step or none does, and a wrong answer on one rank only (a slice cut short on the last rank, say) is
reported as what it is on every rank, never as a hang in a collective the others never entered.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from workers.exercises.subgroups import DEFAULT_GROUP, in_sub_group, layouts, sub_group
from workers.exercises.support import Wrong, agree, expect_close, expect_finite, run_exercise, scaled_by
from workers.model.dense import BlockConfig, build, inputs
from workers.parallel import mappings
from workers.parallel.layers import contiguous_index
from workers.parallel.mlp import ParallelMLP, naive_rows, swiglu_rows

TOL = dict(atol=1e-5, rtol=1e-5)  # float32 against float64, sums of a few dozen terms
SEQ, BATCH = 4, 2


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a.double(), b.double(), **TOL)


def _grad(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """``tensor.grad`` on the CPU, or Wrong when the backward never reached it (not a crash on ``None``)."""
    if tensor.grad is None:
        raise Wrong(f"{what} got no gradient in the backward: use it in the output with differentiable ops "
                    "(no .detach(), no torch.no_grad())")
    return tensor.grad.cpu()


def _dense_grads(linear, x, grad_output):
    """Output and every gradient of the dense layer, float64, in this process."""
    lin = torch.nn.Linear(linear.in_features, linear.out_features).double()
    lin.load_state_dict(linear.state_dict())
    x = x.double().requires_grad_()
    y = lin(x)
    y.backward(grad_output.double())
    return y.detach(), x.grad, lin.weight.grad, lin.bias.grad


# -- exercise 1: column-parallel forward ----------------------------------------------------------------

def _stage(sg, stage):
    """``stage`` as run in ``agree``: in a sub-group, its message says which group it was seen in."""
    return stage if sg is None else (lambda: in_sub_group(sg, stage))


def check_column_parallel_forward(ctx, answer) -> None:
    # The whole world as the group first (the chapter's picture), then, at world 4, two groups of 2 side by side
    # with different layers and data: consecutive ranks, then non-contiguous ones.
    _column_case(ctx, answer, None, ctx.world_size, ctx.rank, seeds=[4], index=0)
    for dim in layouts(ctx.world_size):
        with sub_group(ctx, dim) as sg:
            _column_case(ctx, answer, sg.group, sg.size, sg.rank, seeds=[40 + i for i in range(sg.n_groups)],
                         index=sg.index, sg=sg)


def _column_case(ctx, answer, group, t, r, *, seeds, index, sg=None) -> None:
    """One forward and backward of the learner's column layer, ``t`` ranks in ``group``, this one at place ``r``;
    the layer and data of group ``index`` come from ``seeds[index]`` (one seed per group)."""
    cfg = BlockConfig(hidden=8, ffn=16)
    dense = build("column", cfg, seed=seeds[index])  # Linear(8, 16), the same on every rank of the group
    x_full, g_full = inputs("column", cfg, SEQ, BATCH, seed=seeds[index])
    cols = contiguous_index(cfg.ffn, t, r, "ffn")
    weight = dense.weight.detach()[cols].clone().to(ctx.device).requires_grad_()  # [16/t, 8]
    bias = dense.bias.detach()[cols].clone().to(ctx.device).requires_grad_()
    x = x_full.clone().to(ctx.device).requires_grad_()
    y = answer(x, weight, bias, group)
    want_y, want_dx, want_dw, want_db = _dense_grads(dense, x_full, g_full)

    def forward_verdict():
        if not isinstance(y, torch.Tensor):
            raise Wrong(f"column_parallel_forward should return a tensor, not {type(y).__name__}")
        expect_finite(y, f"rank {r}'s output columns")
        if y.shape == want_y.shape and t > 1:
            raise Wrong(f"you returned the whole output {tuple(y.shape)}: a column-parallel layer returns only this "
                        f"rank's {len(cols)} output columns, [s, b, out/t] (gather_output=False)")
        expect_close(y.detach().cpu(), want_y[..., cols], f"rank {r}'s output columns", **TOL)
        if not y.requires_grad:
            raise Wrong("the output does not require grad: compute it from x, weight and bias with differentiable ops")

    # The backward may run the learner's collectives (f's all-reduce): every rank runs it, or none does.
    agree(_stage(sg, forward_verdict))
    y.backward(g_full[..., cols].to(ctx.device))

    def backward_verdict():
        for tensor, what in ((weight, "this rank's weight shard"), (bias, "this rank's bias shard"), (x, "the input x")):
            expect_finite(_grad(tensor, what), f"the gradient of {what}")
        expect_close(_grad(weight, "this rank's weight shard"), want_dw[cols],
                     "the gradient of this rank's weight shard", **TOL)
        expect_close(_grad(bias, "this rank's bias shard"), want_db[cols], "the gradient of this rank's bias shard",
                     **TOL)
        dx = _grad(x, "the input x")
        partial = (g_full[..., cols].double() @ dense.weight.detach()[cols].double())  # this rank's part of dX
        if t > 1 and _same(dx, partial):
            raise Wrong("the output is right, but the input gradient is only this rank's contribution "
                        "(g_r W_r): every rank's columns read all of x, so dL/dx is the sum over ranks. Pass x "
                        "through copy_to_tensor_model_parallel_region (f): identity forward, all-reduce backward")
        if sg is not None:  # every group's dense gradient, summed: what an all-reduce over the world gives
            world = sum(_dense_grads(build("column", cfg, seed=s), *inputs("column", cfg, SEQ, BATCH, seed=s))[1]
                        for s in seeds)
            if _same(dx, world):
                raise Wrong(f"the input gradient is the sum over all {ctx.world_size} ranks of the world, not over "
                            f"the {t} ranks of your group: the all-reduce in f's backward " + DEFAULT_GROUP)
        expect_close(dx, want_dx, "the input gradient (after backward)", **TOL,
                     hints=[(scaled_by(t), f"it is {t} times too large: the gradient is all-reduced twice")])

    agree(_stage(sg, backward_verdict))


# -- exercise 2: row-parallel forward, bias once -------------------------------------------------------------

def check_row_parallel_forward(ctx, answer) -> None:
    _row_case(ctx, answer, None, ctx.world_size, ctx.rank, seeds=[5], index=0)
    for dim in layouts(ctx.world_size):
        with sub_group(ctx, dim) as sg:
            _row_case(ctx, answer, sg.group, sg.size, sg.rank, seeds=[50 + i for i in range(sg.n_groups)],
                      index=sg.index, sg=sg)


def _row_dense(cfg, seed):
    dense = build("row", cfg, seed=seed)  # Linear(16, 8)
    with torch.no_grad():
        dense.bias.add_(1.0)  # a bias far from zero, so adding it t times cannot hide in the tolerance
    return dense


def _row_case(ctx, answer, group, t, r, *, seeds, index, sg=None) -> None:
    cfg = BlockConfig(hidden=8, ffn=16)
    dense = _row_dense(cfg, seeds[index])
    x_full, g_full = inputs("row", cfg, SEQ, BATCH, seed=seeds[index])
    rows = contiguous_index(cfg.ffn, t, r, "ffn")
    x = x_full[..., rows].clone().to(ctx.device).requires_grad_()  # [s, b, 16/t]
    weight = dense.weight.detach()[:, rows].clone().to(ctx.device).requires_grad_()  # [8, 16/t]
    bias = dense.bias.detach().clone().to(ctx.device).requires_grad_()  # [8], whole on every rank
    y = answer(x, weight, bias, group)
    want_y, want_dx, want_dw, want_db = _dense_grads(dense, x_full, g_full)
    b = dense.bias.detach().double()

    def forward_verdict():
        if not isinstance(y, torch.Tensor):
            raise Wrong(f"row_parallel_forward should return a tensor, not {type(y).__name__}")
        expect_finite(y, f"rank {r}'s output")
        got = y.detach().cpu().double()
        partial = x_full[..., rows].double() @ dense.weight.detach()[:, rows].double().T
        if sg is not None and got.shape == want_y.shape:
            # every group's sum of partial products, summed again: what an all-reduce over the world gives
            sums = []
            for s in seeds:
                other = _row_dense(cfg, s)
                sums.append(_dense_grads(other, *inputs("row", cfg, SEQ, BATCH, seed=s))[0] - other.bias.double())
            world = sum(sums)
            if _same(got, world + b):
                raise Wrong(f"the output sums the partial products of all {ctx.world_size} ranks of the world, not "
                            f"of the {t} ranks of your group: the all-reduce in g " + DEFAULT_GROUP)
        if t > 1 and got.shape == want_y.shape:
            if _same(got, want_y + (t - 1) * b):
                raise Wrong(f"the output holds the bias {t} times: you added it on every rank before the all-reduce, "
                            "which sums it too. Add it once, to the reduced output")
            if _same(got, partial + b) or _same(got, partial):
                raise Wrong("the output is only this rank's partial product X_r A_r: the ranks' partial sums must "
                            "be added up, with reduce_from_tensor_model_parallel_region (g)")
        expect_close(got, want_y, f"rank {r}'s output", **TOL, hints=[
            (lambda g, w: torch.allclose(g - b, t * (w - b), atol=1e-4), f"the sum is {t} times too large: "
             "the partial products were all-reduced twice")])
        if not y.requires_grad:
            raise Wrong("the output does not require grad: compute it from x, weight and bias with differentiable ops")

    # The backward may run the learner's collectives: every rank runs it, or none does.
    agree(_stage(sg, forward_verdict))
    y.backward(g_full.to(ctx.device))

    def backward_verdict():
        if bias.grad is None or (t > 1 and not bias.grad.any()):
            raise Wrong(f"the output is right, but rank {r}'s copy of the bias gets no gradient: it never entered "
                        "this rank's computation (added inside g on some ranks only?). The bias is replicated: add "
                        "the whole bias on every rank, once, after the all-reduce, so every copy gets the same "
                        "gradient and the copies stay identical after the optimizer step")
        for tensor, what in ((bias, "the bias"), (weight, "this rank's weight shard"), (x, "this rank's input shard")):
            expect_finite(_grad(tensor, what), f"the gradient of {what}")
        expect_close(bias.grad.cpu(), want_db, "the bias gradient", **TOL, hints=[
            (scaled_by(1 / t), f"it is 1/{t} of the right one: you added bias/{t} on every rank before the sum; "
             "the forward is right, the gradient is not. Add the whole bias once, after the all-reduce")])
        expect_close(_grad(weight, "this rank's weight shard"), want_dw[:, rows],
                     "the gradient of this rank's weight shard", **TOL,
                     hints=[(scaled_by(t), f"it is {t} times too large: the backward all-reduces the gradient, "
                             "but g's backward is the identity")])
        expect_close(_grad(x, "this rank's input shard"), want_dx[..., rows], "the gradient of this rank's input shard",
                     **TOL)

    agree(_stage(sg, backward_verdict))


# -- exercise 3: SwiGLU split -----------------------------------------------------------------------------

def check_swiglu_shard(ctx, answer) -> None:
    t, r = ctx.world_size, ctx.rank
    cfg = BlockConfig(hidden=8, ffn=16, activation="swiglu")
    dense = build("mlp", cfg, seed=6)  # fc1: [2*16, 8] laid out [gate; up]
    w, b = dense.fc1.weight.detach(), dense.fc1.bias.detach()
    got_w, got_b = answer(w.clone(), r, t), answer(b.clone(), r, t)
    want_rows = swiglu_rows(cfg.ffn, r, t)

    def shape_verdict():
        for got, want, what in ((got_w, w[want_rows], "weight"), (got_b, b[want_rows], "bias")):
            if not isinstance(got, torch.Tensor):
                raise Wrong(f"swiglu_shard should return a tensor (the {what}'s rows for this rank), "
                            f"not {type(got).__name__}")
            if got.shape != want.shape:
                short = (f" A slice that runs past the end of the fused {what} is silently cut short, so only the "
                         "last rank's shard comes out smaller: check where up's rows start (row ffn) and end"
                         if r == t - 1 and got.dim() == want.dim() and got.shape[0] < want.shape[0] else "")
                raise Wrong(f"rank {r}'s shard of the {what} has shape {tuple(got.shape)}; it should be "
                            f"{tuple(want.shape)}: 2*ffn/t rows ({cfg.ffn // t} of gate, then {cfg.ffn // t} of up)."
                            + short)
            expect_finite(got, f"rank {r}'s shard of the {what}")

    # The parallel MLP below all-reduces: the ranks agree on the shapes first, so all of them run it or none does.
    agree(shape_verdict)
    mlp = ParallelMLP.from_dense(dense).to(ctx.device)
    with torch.no_grad():
        mlp.fc1.weight.copy_(got_w)
        mlp.fc1.bias.copy_(got_b)
    x, _ = inputs("mlp", cfg, SEQ, BATCH, seed=6)
    with torch.no_grad():
        error = (mlp(x.to(ctx.device)).cpu() - dense(x)).abs().max().item()

    def verdict():
        if t > 1 and torch.equal(got_w.cpu(), w[naive_rows(cfg.ffn, r, t)]):
            kind = "gate rows only" if r < t // 2 else "up rows only"
            raise Wrong(f"that is the contiguous chunk w.chunk({t})[{r}]: rank {r} gets {kind}, so silu(gate) * up "
                        f"multiplies the wrong columns (MLP output off by {error:.3g}). Take rows "
                        f"[r*f/t, (r+1)*f/t) of gate AND the same rows of up (which start at row f)")
        if not error <= 1e-5:
            raise Wrong(f"with your shard the MLP output is off by {error:.3g}: rank {r} should hold gate rows "
                        f"{want_rows[0].item()}..{want_rows[len(want_rows) // 2 - 1].item()} and up rows "
                        f"{want_rows[len(want_rows) // 2].item()}..{want_rows[-1].item()}, in that order")
        expect_close(got_w.cpu(), w[want_rows], f"rank {r}'s fc1 weight rows", atol=0, rtol=0)
        expect_close(got_b.cpu(), b[want_rows], f"rank {r}'s fc1 bias rows", atol=0, rtol=0)

    agree(verdict)


# -- exercise 4: the cross-entropy from logits split by vocabulary ----------------------------------------------

LOSS_SEQ, LOSS_BATCH, LOSS_VOCAB = 8, 4, 24  # 32 tokens: every word is a target once (24) and 8 more at random
# Logits of order 1, then of order 1e3: exp() of an unshifted logit overflows float32 above 88.7, so the second case
# shows what the max is for; a max taken over the wrong ranks, or summed, leaves every exponential 0 or infinite there.
LOSS_SCALES = (("logits of order 1", 1.0), ("logits of order 1e3", 1e3))
# the tensor a collective is handed, by argument position (and keyword) in torch.distributed's signatures
_COLLECTIVE_INPUT = {"all_reduce": (0, "tensor"), "broadcast": (0, "tensor"), "reduce": (0, "tensor"),
                     "send": (0, "tensor"), "isend": (0, "tensor"), "gather": (0, "tensor"),
                     "all_gather": (1, "tensor"), "all_gather_into_tensor": (1, "input_tensor"),
                     "all_gather_object": (1, "obj"), "reduce_scatter": (1, "input_list"),
                     "reduce_scatter_tensor": (1, "input"), "all_to_all": (1, "input_tensor_list"),
                     "all_to_all_single": (1, "input")}


def _elements(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, (list, tuple)):
        return sum(_elements(v) for v in value)
    return 0


@contextlib.contextmanager
def _counted_collectives():
    """Every collective the answer calls, as ``(name, elements it handed in)``: torch.distributed's, and the
    mappings' all-gather and reduce-scatter (bound at import time, so patched where the mappings look them up)."""
    calls: list[tuple[str, int]] = []
    saved = []

    def counted(name, fn, position, keyword):
        def call(*args, **kwargs):
            handed = args[position] if len(args) > position else kwargs.get(keyword)
            calls.append((name, _elements(handed)))
            return fn(*args, **kwargs)
        return call

    targets = [(dist, name, *where) for name, where in _COLLECTIVE_INPUT.items() if hasattr(dist, name)]
    targets += [(mappings, "all_gather_single", 1, "input_tensor"), (mappings, "reduce_scatter_single", 1, "input")]
    for module, name, position, keyword in targets:
        original = getattr(module, name)
        saved.append((module, name, original))
        setattr(module, name, counted(name.replace("_single", "_into_tensor"), original, position, keyword))
    try:
        yield calls
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)


def _loss_inputs(seed: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits [s, b, V] float32, target [s, b])`` of one group: every word is a target, so every rank of any
    group holds targets of its own and targets of other ranks."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(LOSS_SEQ, LOSS_BATCH, LOSS_VOCAB, generator=g) * scale
    n = LOSS_SEQ * LOSS_BATCH
    words = torch.cat([torch.randperm(LOSS_VOCAB, generator=g), torch.randint(LOSS_VOCAB, (n - LOSS_VOCAB,), generator=g)])
    return logits, words[torch.randperm(n, generator=g)].view(LOSS_SEQ, LOSS_BATCH)


def _picked(z: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return z.gather(-1, index.unsqueeze(-1)).squeeze(-1)  # [s, b]


def _loss_reference(z: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The dense per-token loss ``log sum_j exp z_j - z_target``, float64, ``[s, b]``."""
    return torch.logsumexp(z, -1) - _picked(z, target)


def _loss_mistakes(z: torch.Tensor, target: torch.Tensor, t: int, r: int) -> list[tuple[torch.Tensor, str]]:
    """What rank ``r`` of ``t`` returns with each single mistake, in float64, and the message that names it."""
    part = z.shape[-1] // t
    shards = z.split(part, dim=-1)  # [s, b, V/t] each
    holder, zt, lse, m = target // part, _picked(z, target), torch.logsumexp(z, -1), z.amax(-1)
    own_max = torch.stack([s.amax(-1) for s in shards])  # [t, s, b]
    own_sums = torch.stack([(s - own_max[i].unsqueeze(-1)).exp().sum(-1) for i, s in enumerate(shards)])
    out = [(own_sums.sum(0).log() - (zt - own_max.gather(0, holder.unsqueeze(0)).squeeze(0)),
            "the loss is finite and the same on every rank, but wrong: each rank subtracted its own largest logit, so "
            "the ranks' sums of exponentials are in different units. All-reduce the max over the group with "
            "op=dist.ReduceOp.MAX before subtracting it"),
           (torch.logsumexp(shards[r], -1) - zt,
            f"rank {r}'s loss is the log of the sum of exponentials over its own {part} words only (each rank's "
            "softmax sums to 1 on its own): the softmax's denominator runs over the whole vocabulary, so all-reduce "
            "(SUM) the sum of exponentials over the group before the log")]
    not_mine = "every rank added a logit to the target's: "
    for stand_in in (lambda i: torch.zeros_like(target), lambda i: (target - i * part).clamp(0, part - 1)):
        extra = sum(torch.where(holder == i, 0.0, _picked(shards[i], stand_in(i))) for i in range(t))
        for shift in ((t - 1) * m, 0.0):  # the target's logit taken after subtracting the max, or before
            out.append((lse - zt - (extra - shift), not_mine + (
                "where another rank holds the target, this rank's index (clamped, or set to 0, to stay inside its "
                "shard) picks a stand-in logit, and it was kept. Set the picked logit to 0 on the ranks whose block "
                "[start, end) does not contain the target, so that the SUM all-reduce adds exactly one logit")))
    return out


def _world_loss(groups: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """What the three all-reduces give over the whole world when it holds several groups, each with its own logits
    and targets: every group's shards and targets summed in, the max over all of them (float64, ``[s, b]``)."""
    groups = [(z.double(), target) for z, target in groups]
    m = torch.stack([z.amax(-1) for z, _ in groups]).amax(0)
    sums = sum((z - m.unsqueeze(-1)).exp().sum(-1) for z, _ in groups)
    return sums.log() - sum(_picked(z, target) - m for z, target in groups)


def check_vocab_parallel_loss(ctx, answer) -> None:
    # The whole world as the group first, then, at world 4, two groups of 2 side by side with their own logits and
    # targets: non-contiguous ranks (a rank's place in its group is not its rank), then consecutive ones.
    for what, scale in LOSS_SCALES:
        _loss_case(ctx, answer, None, ctx.world_size, ctx.rank, seeds=[7], index=0, scale=scale, what=what)
    for dim in layouts(ctx.world_size):
        with sub_group(ctx, dim) as sg:
            for what, scale in LOSS_SCALES:
                _loss_case(ctx, answer, sg.group, sg.size, sg.rank, seeds=[70 + i for i in range(sg.n_groups)],
                           index=sg.index, scale=scale, what=what, sg=sg)


def _loss_case(ctx, answer, group, t, r, *, seeds, index, scale, what, sg=None) -> None:
    """The learner's loss on this rank's block of group ``index``'s logits (seed ``seeds[index]``), ``t`` ranks in
    ``group``, this one at place ``r``; judged against the dense loss in float64 from the same float32 logits."""
    data = [_loss_inputs(s, scale) for s in seeds]
    logits_full, target = data[index]
    part = LOSS_VOCAB // t
    logits = logits_full[..., r * part:(r + 1) * part].clone().to(ctx.device)  # [s, b, V/t]
    target_in = target.clone().to(ctx.device)
    crashed = None
    with _counted_collectives() as calls:
        try:
            got = answer(logits, target_in, group)
        except (IndexError, RuntimeError) as exc:  # a target outside this rank's block, used as an index
            if "out of bounds" not in str(exc) and "out of range" not in str(exc):
                raise
            crashed = exc
    z = logits_full.double()
    want = _loss_reference(z, target)
    # float32 arithmetic against float64: the reference answer is off by at most 1e-7 of the largest loss (5.5e-7 on
    # losses up to 5.9 at logits ~1, 2.4e-4 on losses up to 4100 at ~1e3, t = 2 and 4): a margin of 100
    tol = 1e-5 * max(1.0, want.abs().max().item())
    s, b = LOSS_SEQ, LOSS_BATCH

    def verdict():
        if crashed is not None:
            raise Wrong(f"indexing this rank's logits with the target failed ({str(crashed).splitlines()[0]}): the "
                        f"targets are words of the whole vocabulary, and rank {r} holds only words [{r * part}, "
                        f"{(r + 1) * part}). Subtract start, and where the target lies outside [start, end) use any "
                        "index inside the shard (0) and set the logit it picks to 0")
        if not isinstance(got, torch.Tensor):
            raise Wrong(f"vocab_parallel_loss should return a tensor, the loss of every token [s, b], not "
                        f"{type(got).__name__}")
        if got.dim() == 0:
            raise Wrong("you returned one number: return the loss of every token, [s, b] (as F.cross_entropy(..., "
                        "reduction='none')); the caller averages it")
        if tuple(got.shape) != (s, b):
            raise Wrong(f"the loss has shape {tuple(got.shape)}; it should be the target's, [s, b] = {(s, b)}: one "
                        "loss per token (reduce over the vocabulary, the last dimension of the logits, only)")
        if not torch.equal(logits.cpu(), logits_full[..., r * part:(r + 1) * part]) or not torch.equal(
                target_in.cpu(), target):
            raise Wrong("the loss is computed, but the caller's logits (or target) changed: subtracting the max in "
                        "place (logits -= max, logits.sub_(...)) writes into the caller's tensor, which the backward "
                        "and the rest of the step still read. Subtract out of place: z = logits - max")
        big = [(name, n) for name, n in calls if n > 3 * s * b]
        if big:
            name, n = big[0]
            raise Wrong(f"{name} was handed {n} elements, more than the three [s, b] tensors ({3 * s * b} elements) "
                        "the loss needs: the logits (or their exponentials) were gathered. The point of the split is "
                        "that the [s, b, V] logits never exist whole on one rank: all-reduce three [s, b] tensors "
                        "instead, the max (MAX), the target's logit (SUM) and the sum of exponentials (SUM)")
        if not torch.isfinite(got.detach()).all():
            raise Wrong(f"with {what} the loss holds inf or NaN: exp() overflowed (float32 overflows above 88.7) or "
                        "every exponential underflowed to 0. Subtract each token's largest logit, all-reduced over "
                        "the group with op=dist.ReduceOp.MAX (not SUM: a sum of the ranks' maxima shifts every logit "
                        "far below 0), before exp")
        loss = got.detach().cpu().double()

        def close(candidate) -> bool:
            return bool(torch.allclose(loss, candidate, atol=tol, rtol=0))
        if close(want):
            return
        if sg is not None and close(_world_loss(data)):
            raise Wrong("the loss sums the logits and exponentials of every rank of the world, not of the ranks "
                        "of your group: the all-reduces " + DEFAULT_GROUP)
        for candidate, message in _loss_mistakes(z, target, t, r):
            if close(candidate):
                raise Wrong(f"with {what}: {message}")
        err = (loss - want).abs().max().item()
        raise Wrong(f"with {what} rank {r}'s loss is off by up to {err:.3g} (tolerance {tol:.2g}): the loss is "
                    "log(sum of exp(z - max)) - (z_target - max), with the max all-reduced (MAX), the target's logit "
                    "taken on the rank that holds it and 0 elsewhere (SUM), and the sum of exponentials (SUM), all "
                    "over the group")

    agree(_stage(sg, verdict))


CHECKS = {"column_parallel_forward": check_column_parallel_forward,
          "row_parallel_forward": check_row_parallel_forward,
          "swiglu_shard": check_swiglu_shard,
          "vocab_parallel_loss": check_vocab_parallel_loss}


def main(ctx, exercise: str = "", answer=None):
    return run_exercise(ctx, CHECKS, exercise, answer)


if __name__ == "__main__":
    from workers.runtime import entrypoint

    entrypoint(main)
