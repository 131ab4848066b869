"""Rank-side checks for chapter 04: a column-parallel forward, a row-parallel forward with the bias once,
and the split of SwiGLU's fused [gate; up] weight. All on real ranks, against the dense layer.

Every rank builds the same dense layer from one seed, hands the learner's function its shard, runs
forward *and* backward (the backward is where a missing ``f`` shows), and compares. A check runs in
stages, each ended by ``agree``: the ranks share their verdicts before the next step that communicates
(the backward, which may run the learner's ``f``; the parallel MLP's all-reduce). So every rank runs that
step or none does, and a wrong answer on one rank only (a slice cut short on the last rank, say) is
reported as what it is on every rank, never as a hang in a collective the others never entered.
"""
from __future__ import annotations

import torch

from workers.exercises.subgroups import DEFAULT_GROUP, in_sub_group, layouts, sub_group
from workers.exercises.support import Wrong, agree, expect_close, expect_finite, run_exercise, scaled_by
from workers.model.dense import BlockConfig, build, inputs
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


CHECKS = {"column_parallel_forward": check_column_parallel_forward,
          "row_parallel_forward": check_row_parallel_forward,
          "swiglu_shard": check_swiglu_shard}


def main(ctx, exercise: str = "", answer=None):
    return run_exercise(ctx, CHECKS, exercise, answer)


if __name__ == "__main__":
    from workers.runtime import entrypoint

    entrypoint(main)
