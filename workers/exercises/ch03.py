"""Rank-side checks for chapter 03: the learner's f/g and split/gather, run on real ranks.

Every rank builds every rank's inputs and output gradients (``reference.example``: small integers in
float64, so a correct answer matches bit for bit), runs the learner's functions forward and backward on
its own, and compares with the single-process reference (``reference.reference``). Each check names the
mistake it sees: a backward that sums twice (the scaling trap), a backward that forgets to sum, the
wrong slice for the rank, a forward that overwrites its input. Then a float64 gradcheck through the
learner's collectives, and at world 4 the same functions, forward and backward, inside two groups of 2
(non-contiguous [0, 2] [1, 3], then consecutive [0, 1] [2, 3]; ``workers/exercises/subgroups.py``) with
different data per group, to be sure ``group=`` is honoured: a collective, a size or a rank taken from the
world instead of the group is named as such.
"""
from __future__ import annotations

import torch

from workers.exercises.subgroups import DEFAULT_GROUP, in_sub_group, layouts, sub_group
from workers.exercises.support import Wrong, agree, expect_close, expect_finite, run_exercise, scaled_by
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
    expect_finite(y, f"{what}'s forward output")
    if y.shape != grad.shape:
        raise Wrong(f"{what} returned shape {tuple(y.shape)} for an input of shape {tuple(x_in.shape)}; expected "
                    f"{tuple(grad.shape)}" + (f": {shape_hint}" if shape_hint else ""))
    if not y.requires_grad:
        raise Wrong(f"{what}'s output does not require grad: autograd cannot see through dist calls, so wrap "
                    "them in a torch.autograd.Function and return FunctionName.apply(x, group)")
    y.backward(grad.to(ctx.device))
    if x.grad is None:
        raise Wrong(f"{what}'s backward gave x no gradient: return the gradient of x first (None for group)")
    expect_finite(x.grad, f"{what}'s backward: the gradient of x")
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

    for stage in (f_alone, g_alone, together):
        agree(stage)
    # then inside sub-groups: f and g must stay inside the group they are given
    _in_sub_groups(ctx, [(copy_to, "copy_to (f)", F, 33), (reduce_from, "reduce_from (g)", G, 35)])


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

    for stage in (scatter_alone, gather_alone, together):
        agree(stage)
    # then inside sub-groups: slices are taken, and gathered, within the group, at the rank's place in it
    _in_sub_groups(ctx, [(scatter_to, "scatter_to", SCATTER, 43), (gather_from, "gather_from", GATHER, 45)])


# -- both exercises: the same functions inside sub-groups ---------------------------------------------

def _in_sub_groups(ctx, cases) -> None:
    """At world 4, each ``(fn, what, mapping, seed)`` forward and backward inside two groups of 2, consecutive
    ([0, 1] [2, 3]) then non-contiguous ([0, 2] [1, 3]), each group with its own data (seed + group index)."""
    for dim in layouts(ctx.world_size):
        with sub_group(ctx, dim) as sg:
            for fn, what, mapping, seed in cases:
                _group_case(ctx, sg, fn, what, mapping, seed)


def _world_symptom(ctx, sg, mapping: str, pass_: str, got: torch.Tensor, mine: torch.Tensor, every) -> str | None:
    """What the learner's result looks like if a collective, a size or a rank was the world's, not the group's.

    ``mine`` is this rank's input (forward) or output gradient (backward); ``every`` the reference
    ``(outputs, input gradients)`` of every group, from which a sum over the whole world is predicted.
    """
    n, world = sg.size, ctx.world_size
    summed = {(F, "backward"): 1, (G, "forward"): 0}.get((mapping, pass_))
    if summed is not None:  # a sum over the group; over the world it also adds the other group's terms
        if torch.equal(got, sum(ref[summed][0] for ref in every)):
            return f"it is the sum over all {world} ranks of the world, not over the {n} ranks of the group: the all_reduce"
        return None
    splits = (mapping, pass_) in ((SCATTER, "forward"), (GATHER, "backward"))
    if splits:
        width = mine.shape[-1]
        if got.shape[-1] == width // world:
            return f"it is 1/{world} of the last dimension: the split used the world's size, not the group's {n}; it"
        k = _which_slice(got, mine, n)
        if k is not None and k == ctx.rank != sg.rank:
            return (f"rank {ctx.rank} kept slice {k}, its rank in the world, where its place in the group is "
                    f"{sg.rank} (dist.get_rank() without group=): the split")
        return None
    if got.shape[-1] == world * mine.shape[-1]:  # a gather
        return f"it concatenates the slices of all {world} ranks of the world, not the group's {n}: the all_gather"
    return None


def _error(exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__} ({text[:160]})" if text else type(exc).__name__


def _group_case(ctx, sg, fn, what: str, mapping: str, seed: int) -> None:
    every_input = [example(mapping, sg.size, seed=seed + i) for i in range(sg.n_groups)]
    every = [reference(mapping, xs, gs) for xs, gs in every_input]
    xs, gs = every_input[sg.index]
    want_y, want_dx = every[sg.index]
    i, box = sg.rank, {}
    where = f"{what} in a group"

    def forward():
        x = xs[i].clone().to(ctx.device).requires_grad_()
        try:
            y = fn(x, sg.group)
        except Exception as exc:  # noqa: BLE001 - right with the world as its group, so it is the group
            raise Wrong(f"{what} raised {_error(exc)} although it ran with the whole world as its group: it "
                        "probably " + DEFAULT_GROUP) from None
        if not isinstance(y, torch.Tensor):
            raise Wrong(f"{what} should return a tensor, not {type(y).__name__}")
        got = y.detach().cpu()
        symptom = _world_symptom(ctx, sg, mapping, "forward", got, xs[i], every)
        if symptom:
            raise Wrong(f"{what}'s forward is wrong: {symptom} " + DEFAULT_GROUP)
        expect_close(got, want_y[i], f"{where}: the forward", atol=0, rtol=0)
        if not y.requires_grad:
            raise Wrong(f"{what}'s output does not require grad")
        box["x"], box["y"] = x, y

    agree(lambda: in_sub_group(sg, forward))
    try:
        box["y"].backward(gs[i].to(ctx.device))
    except Exception as exc:  # noqa: BLE001
        raise Wrong(f"{sg.describe()}: {what}'s backward raised {_error(exc)} although it ran with the whole world "
                    "as its group: it probably " + DEFAULT_GROUP) from None

    def backward():
        dx = box["x"].grad
        if dx is None:
            raise Wrong(f"{what}'s backward gave x no gradient")
        dx = dx.detach().cpu()
        symptom = _world_symptom(ctx, sg, mapping, "backward", dx, gs[i], every)
        if symptom:
            raise Wrong(f"{what}'s backward is wrong: {symptom} " + DEFAULT_GROUP)
        expect_close(dx, want_dx[i], f"{where}: the backward (the input gradient)", atol=0, rtol=0)

    agree(lambda: in_sub_group(sg, backward))


CHECKS = {"f_and_g": check_f_and_g, "split_and_gather": check_split_and_gather}


def main(ctx, exercise: str = "", answer=None):
    return run_exercise(ctx, CHECKS, exercise, answer)


if __name__ == "__main__":
    entrypoint(main)
