"""Rank-side checks for chapter 03: the learner's f/g and split/gather, run on real ranks.

Every rank builds every rank's inputs and output gradients (``reference.example``: small integers in
float64, so a correct answer matches bit for bit), runs the learner's functions forward and backward on
its own, and compares with the single-process reference (``reference.reference``). Each check names the
mistake it sees: a backward that sums twice (the scaling trap), a backward that forgets to sum, the
wrong slice for the rank, a forward that overwrites its input. Then a float64 gradcheck through the
learner's collectives, and the same functions inside a sub-group, to be sure ``group=`` is honoured.
"""
from __future__ import annotations

import torch

from workers.exercises.support import Wrong, agree, expect_close, run_exercise, scaled_by
from workers.parallel.groups import TensorParallelGroups
from workers.parallel.reference import example, reference
from workers.runtime import entrypoint

F, G = "copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region"
SCATTER, GATHER = "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region"


def _pair(answer, names: tuple[str, str]):
    got = answer()
    if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(callable(f) for f in got)):
        raise Wrong(f"return a pair of functions ({names[0]}, {names[1]}), each called as fn(x, group); "
                    f"got {type(got).__name__}")
    return got


def _run(ctx, fn, what: str, x_in: torch.Tensor, grad: torch.Tensor, group=None, shape_hint: str = ""):
    """Forward and backward of the learner's ``fn`` on this rank; returns (output, gradient of x)."""
    x = x_in.clone().to(ctx.device).requires_grad_()
    y = fn(x, group)  # positional, so a bare Function.apply works as well as a wrapper with group=None
    if not isinstance(y, torch.Tensor):
        raise Wrong(f"{what} should return a tensor, not {type(y).__name__}")
    if not torch.equal(x.detach().cpu(), x_in):
        raise Wrong(f"{what}'s forward changed its input in place (a collective on x itself): communicate on a "
                    "clone; autograd may have saved x for another backward, and the caller may still need it")
    if y.shape != grad.shape:
        raise Wrong(f"{what} returned shape {tuple(y.shape)} for an input of shape {tuple(x_in.shape)}; expected "
                    f"{tuple(grad.shape)}" + (f": {shape_hint}" if shape_hint else ""))
    if not y.requires_grad:
        raise Wrong(f"{what}'s output does not require grad: autograd cannot see through dist calls, so wrap "
                    "them in a torch.autograd.Function and return FunctionName.apply(x, group)")
    y.backward(grad.to(ctx.device))
    if x.grad is None:
        raise Wrong(f"{what}'s backward gave x no gradient: return the gradient of x first (None for group)")
    return y.detach().cpu(), x.grad.detach().cpu()


def _same(t: torch.Tensor):
    return lambda got, want: got.shape == t.shape and torch.equal(got, t.double())


def _gradcheck(what: str, fn, x: torch.Tensor) -> None:
    from torch.autograd.gradcheck import GradcheckError

    try:
        torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-7, rtol=1e-5, raise_exception=True)
    except GradcheckError as exc:
        raise Wrong(f"gradcheck of {what} in float64 failed ({str(exc).strip().splitlines()[0]}): "
                    "the backward does not match the forward") from None


# -- exercise 1: f and g ---------------------------------------------------------------------------

def check_f_and_g(ctx, answer) -> None:
    copy_to, reduce_from = _pair(answer, ("copy_to", "reduce_from"))
    n, r = ctx.world_size, ctx.rank

    def f_alone():  # identity forward; the replicated input's gradient is the sum of every rank's gradient
        xs, gs = example(F, n, seed=31)
        want_y, want_dx = reference(F, xs, gs)
        y, dx = _run(ctx, copy_to, "copy_to (f)", xs[r], gs[r])
        expect_close(y, want_y[r], "copy_to (f) forward", atol=0, rtol=0,
                     hints=[(scaled_by(n), "f's forward is the identity; the all_reduce belongs in its backward")])
        expect_close(dx, want_dx[r], "copy_to (f) backward", atol=0, rtol=0, hints=[
            (_same(gs[r]), "each rank kept its own gradient. f's input is one tensor, replicated, that every "
                           "rank's part of the model used: its gradient is the sum of all ranks' gradients, so "
                           "all_reduce in backward"),
            (scaled_by(n), "the gradient was summed twice (n times too large): all_reduce it once"),
        ])

    def g_alone():  # all-reduce forward; the replicated output's gradient comes back unchanged
        xs, gs = example(G, n, seed=32)
        want_y, want_dx = reference(G, xs, gs)
        y, dx = _run(ctx, reduce_from, "reduce_from (g)", xs[r], gs[r])
        expect_close(y, want_y[r], "reduce_from (g) forward", atol=0, rtol=0, hints=[
            (_same(xs[r]), "g's forward returned this rank's partial result unchanged: all_reduce (sum) it"),
            (lambda got, want: torch.equal(got * n, want), "you averaged: g sums the partial results (ReduceOp.SUM)"),
        ])
        expect_close(dx, want_dx[r], "reduce_from (g) backward", atol=0, rtol=0, hints=[
            (scaled_by(n), f"the gradient is {n} times too large: g's backward all-reduced a gradient that is "
                           "already complete and identical on every rank (the loss after g is replicated). This "
                           "is the world-size scaling trap; g's backward is the identity"),
        ])

    def together():  # y = g(tanh(f(x) W_r)) is replicated end to end, so gradcheck applies on every rank
        w_r = torch.randn((4, 4), generator=torch.Generator().manual_seed(100 + r), dtype=torch.float64)
        x = torch.randn((2, 4), generator=torch.Generator().manual_seed(7), dtype=torch.float64)
        w_r, x = w_r.to(ctx.device), x.to(ctx.device).requires_grad_()
        _gradcheck("g(tanh(f(x) W_r))", lambda t: reduce_from(torch.tanh(copy_to(t, None) @ w_r), None), x)

    def in_a_group():  # two tensor-parallel groups side by side: f and g must stay inside their own group
        size = max(n // 2, 1)
        with TensorParallelGroups(size, fresh=True) as groups:
            mine = groups.group
            xs, gs = example(F, size, seed=33 + r // size)
            _, want_dx = reference(F, xs, gs)
            _, dx = _run(ctx, copy_to, "copy_to (f) in a group", xs[r % size], gs[r % size], group=mine)
            if not torch.equal(dx, want_dx[r % size]):
                raise Wrong(f"with group= a sub-group of {size} rank(s), copy_to's backward did not sum over "
                            "that group only: pass group=group to every dist call (None means the whole world)")
            xs, gs = example(G, size, seed=34 + r // size)
            want_y, _ = reference(G, xs, gs)
            y, _ = _run(ctx, reduce_from, "reduce_from (g) in a group", xs[r % size], gs[r % size], group=mine)
            if not torch.equal(y, want_y[r % size]):
                raise Wrong(f"with group= a sub-group of {size} rank(s), reduce_from's forward did not sum over "
                            "that group only: pass group=group to every dist call (None means the whole world)")

    for stage in (f_alone, g_alone, together, in_a_group):
        agree(stage)


# -- exercise 2: split and gather along the last dimension ----------------------------------------------

def _which_slice(got: torch.Tensor, whole: torch.Tensor, n: int) -> int | None:
    for k, block in enumerate(whole.chunk(n, dim=-1)):
        if got.shape == block.shape and torch.equal(got, block.double()):
            return k
    return None


def check_split_and_gather(ctx, answer) -> None:
    scatter_to, gather_from = _pair(answer, ("scatter_to", "gather_from"))
    n, r = ctx.world_size, ctx.rank

    def scatter_alone():  # keep slice r of the last dimension; backward all-gathers the slices' gradients
        xs, gs = example(SCATTER, n, seed=41)
        want_y, want_dx = reference(SCATTER, xs, gs)
        y, dx = _run(ctx, scatter_to, "scatter_to", xs[r], gs[r],
                     shape_hint=f"split the last dimension (dim=-1) into {n} equal slices")
        k = _which_slice(y, xs[r], n)
        if k is not None and k != r:
            raise Wrong(f"rank {r} kept slice {k}: each rank keeps the slice at its own index in the group, "
                        "dist.get_rank(group)")
        expect_close(y, want_y[r], "scatter_to forward", atol=0, rtol=0)
        own_only = torch.zeros_like(want_dx[r])
        width = own_only.shape[-1] // n
        own_only[..., r * width:(r + 1) * width] = gs[r]
        expect_close(dx, want_dx[r], "scatter_to backward", atol=0, rtol=0, hints=[
            (_same(own_only), "the input gradient holds only this rank's slice: the input is replicated and every "
                              "slice of it was used by some rank, so all_gather the slices' gradients"),
        ])

    def gather_alone():  # concatenate along the last dimension; backward keeps slice r of the gradient
        xs, gs = example(GATHER, n, seed=42)
        want_y, want_dx = reference(GATHER, xs, gs)
        y, dx = _run(ctx, gather_from, "gather_from", xs[r], gs[r],
                     shape_hint="concatenate every rank's slice along the last dimension (dim=-1), in rank order")
        expect_close(y, want_y[r], "gather_from forward", atol=0, rtol=0, hints=[
            (lambda got, want: torch.equal(got, torch.cat(xs[::-1], dim=-1).double()),
             "the slices are in reverse order: slice k comes from rank k"),
        ])
        k = _which_slice(dx, gs[r], n)
        if k is not None and k != r:
            raise Wrong(f"rank {r}'s backward kept slice {k} of the gradient: keep the slice at dist.get_rank(group)")
        expect_close(dx, want_dx[r], "gather_from backward", atol=0, rtol=0, hints=[
            (scaled_by(n), f"the gradient is {n} times too large: gather's output is replicated, so its gradient "
                           "is already complete on every rank; do not sum it, just keep this rank's slice"),
        ])

    def together():  # y = gather(tanh(scatter(x) * w_r)), replicated end to end
        w_r = torch.randn((2,), generator=torch.Generator().manual_seed(200 + r), dtype=torch.float64)
        x = torch.randn((3, 2 * n), generator=torch.Generator().manual_seed(8), dtype=torch.float64)
        w_r, x = w_r.to(ctx.device), x.to(ctx.device).requires_grad_()
        _gradcheck("gather(tanh(scatter(x) * w_r))",
                   lambda t: gather_from(torch.tanh(scatter_to(t, None) * w_r), None), x)

    def in_a_group():  # slices are taken and gathered within the group
        size = max(n // 2, 1)
        with TensorParallelGroups(size, fresh=True) as groups:
            mine = groups.group
            xs, gs = example(SCATTER, size, seed=43)
            want_y, want_dx = reference(SCATTER, xs, gs)
            y, dx = _run(ctx, scatter_to, "scatter_to in a group", xs[r % size], gs[r % size], group=mine,
                         shape_hint=f"in a group of {size}, split into {size} slices: use the group's size")
            if not (torch.equal(y, want_y[r % size]) and torch.equal(dx, want_dx[r % size])):
                raise Wrong(f"with group= a sub-group of {size} rank(s), scatter_to did not keep slice "
                            "dist.get_rank(group) or did not gather within the group: use the group's rank and "
                            "size, and pass group=group to every dist call")

    for stage in (scatter_alone, gather_alone, together, in_a_group):
        agree(stage)


CHECKS = {"f_and_g": check_f_and_g, "split_and_gather": check_split_and_gather}


def main(ctx, exercise: str = "", answer=None):
    return run_exercise(ctx, CHECKS, exercise, answer)


if __name__ == "__main__":
    entrypoint(main)
