"""Rank-side checks for chapter 16: the Switch load-balancing loss on global statistics, and the combine that
brings the experts' rows home, both on real ranks.

``load_balancing_loss(probs, experts, n_experts, top_k, group)``: every rank draws its own router probabilities
and choices, each rank leaning towards another expert (so one rank's counts are not the group's), and also every
other member's (seeded by group and place: no collective needed to know what the right answer is). The answer's
term is compared, value then gradient with respect to ``probs``, with ``workers/moe/router.load_balancing_loss``;
the ranks' mean, weighted by their tokens, with the one-process loss over the group's whole batch. One batch is
ragged (a rank of 2 tokens among 13, 9 and 5): there the group's token count is not this rank's times the group's
size, and an all_gather of the choices would mismatch (named, not left to abort the ranks). Each known mistake is
recognised from its value (local counts, no factor E, f over tokens not choices, P summed, f built from
probabilities, P all-reduced, the world's counts instead of the group's, a NaN). At world 4 the same runs in two
groups of 2 with their own data, consecutive and non-contiguous ranks (``workers/exercises/subgroups.py``).

``combine(rows, token_index, weight, tokens)``: plugged into the chapter's expert-parallel ``MoELayer`` (8
experts, top-2, capacity factor 1.0, float64, EP over the whole world) in place of the dispatcher's last step;
one forward and backward of ``workers/moe/batch.py``'s batch (a seed where every rank drops both choices of some
token, one of another's and none of a third's, and some rank drops both choices of its last token), the gradients
averaged as the chapter's worker does, then the output, the input's gradient and every parameter's gradient against
``workers/moe/equivalence.reference`` (the token-by-token one-process layer). The answer runs with the default
device set elsewhere than its inputs (a GPU rank's situation: rows on cuda, the default device the CPU), its inputs
are compared with a copy taken before, and its rows are diagnosed from that copy: the device, dtype and length of
its output, a NaN, a token that kept only one of its two experts, weights missing or applied twice, no gradient to
the experts or the router.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from workers.exercises.subgroups import DEFAULT_GROUP, in_sub_group, layouts, sub_group
from workers.exercises.support import Wrong, agree, run_exercise
from workers.moe.config import MoEConfig

TOL = 1e-12  # float64; the learner's sums and the reference's differ in the order of a few dozen terms at most


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = TOL) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a.double(), b.double(), atol=tol, rtol=tol))


def _stage(sg, stage):
    return stage if sg is None else (lambda: in_sub_group(sg, stage))


# -- exercise 2: the load-balancing loss ------------------------------------------------------------------------------

# (experts, top_k, tokens of each place in the group, cycled): top-2 first (f over tokens * top_k differs from f over
# tokens only there), then equal tokens at top-1, then a ragged batch with a rank of 2 tokens (only there does the
# group's token count differ from this rank's times the group's size, and an all_gather of the choices mismatch)
LB_CASES = ((8, 2, (16,)), (4, 1, (12,)), (8, 2, (13, 2, 9, 5)))


def _draw(n_experts: int, top_k: int, tokens: int, seed: int, lean: int):
    """One rank's router output: probabilities ``[T, E]`` leaning towards expert ``lean``, its top-k ``[T, k]``."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, n_experts, generator=gen, dtype=torch.float64)
    logits[:, lean] += 2.0
    probs = torch.softmax(logits, dim=-1)
    return probs, probs.topk(top_k, dim=-1).indices


@contextlib.contextmanager
def _gathers_of_one_shape():
    """While the answer runs, ``dist.all_gather`` and ``all_gather_into_tensor`` first compare the shapes the ranks
    give: gathering tensors whose shapes differ aborts gloo's processes (NCCL reads past the end), which would end
    the check without a word; here it is a sentence, the same on every rank (the shapes are gathered as objects)."""
    originals = {name: getattr(dist, name) for name in ("all_gather", "all_gather_into_tensor")}

    def guarded(name):
        def call(*args, **kwargs):
            tensor = args[1] if len(args) > 1 else kwargs.get("tensor", kwargs.get("input_tensor"))
            group = args[2] if len(args) > 2 else kwargs.get("group")
            shapes = [None] * dist.get_world_size(group)
            dist.all_gather_object(shapes, tuple(tensor.shape), group=group)
            if len(set(shapes)) > 1:
                held = ", ".join(f"{list(shape)} on rank {i}" for i, shape in enumerate(shapes))
                raise Wrong(f"your {name} gathered tensors of different shapes ({held}): it needs one shape on "
                            "every rank, and the ranks hold different numbers of tokens here. Share what has one "
                            "size everywhere: the per-expert counts (bincount with minlength, [E]) and the token "
                            "count, all-reduced")
            return originals[name](*args, **kwargs)
        return call

    for name in originals:
        setattr(dist, name, guarded(name))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def check_load_balancing_loss(ctx, answer) -> None:
    for case, (n_experts, top_k, sizes) in enumerate(LB_CASES):
        _lb_case(ctx, answer, None, ctx.world_size, ctx.rank, n_groups=1, index=0, case=case,
                 shape=(n_experts, top_k, sizes))
    for dim in layouts(ctx.world_size):
        with sub_group(ctx, dim) as sg:
            _lb_case(ctx, answer, sg.group, sg.size, sg.rank, n_groups=sg.n_groups, index=sg.index, case=0,
                     shape=LB_CASES[0], sg=sg)


def _lb_case(ctx, answer, group, n, r, *, n_groups, index, case, shape, sg=None) -> None:
    """``n`` ranks in ``group`` (this one at place ``r``), group ``index`` of ``n_groups``, each with its own data."""
    from workers.moe.router import load_balancing_loss

    n_experts, top_k, sizes = shape
    tokens_at = [sizes[m % len(sizes)] for m in range(n)]  # the tokens of each place in the group
    tokens, group_tokens = tokens_at[r], sum(tokens_at)
    cfg = MoEConfig(experts=n_experts, top_k=top_k)
    # every member of every group, drawn on every rank: seed and favourite expert by (group, place)
    every = [[_draw(n_experts, top_k, tokens_at[m], seed=1000 * case + 100 * g + m, lean=(2 * g + 3 * m) % n_experts)
              for m in range(n)] for g in range(n_groups)]
    members = every[index]
    probs_in, experts_in = members[r]

    ref_probs = probs_in.clone().to(ctx.device).requires_grad_(True)
    want = load_balancing_loss(ref_probs, experts_in.to(ctx.device), cfg, group=group)  # the group's all-reduce
    want.backward()
    want_grad = ref_probs.grad.detach().cpu()
    want = want.detach().cpu()

    probs = probs_in.clone().to(ctx.device).requires_grad_(True)
    experts = experts_in.clone().to(ctx.device)
    with _gathers_of_one_shape():
        got = answer(probs, experts, n_experts, top_k, group)
    ragged = len(set(tokens_at)) > 1
    where = (f"experts={n_experts}, top_k={top_k}, "
             + (f"tokens per rank {tokens_at} (ragged)" if ragged else f"{tokens} tokens per rank")
             + ("" if sg else f", {n} ranks each with its own batch"))

    def count(ex):
        return torch.bincount(ex.reshape(-1), minlength=n_experts).double()

    P = probs_in.mean(dim=0)  # [E] this rank's mean probability
    group_counts = sum(count(ex) for _, ex in members)
    world_counts = sum(count(ex) for grp in every for _, ex in grp)
    f = group_counts / (group_tokens * top_k)
    P_group = sum(p.mean(dim=0) for p, _ in members) / n
    E = n_experts
    alternatives = [
        (E * (count(experts_in) / (tokens * top_k) * P).sum(),
         "f_i counts this rank's token choices alone: the loss is defined on the whole batch's counts (Switch "
         "Transformer eq. 4; Qiu et al. 2025). all_reduce the counts (and the token count) over group before "
         "dividing"),
        (E * (world_counts / (n_groups * group_tokens * top_k) * P).sum(),
         "f_i counts the choices of every rank in the world, not those of your group: the all_reduce " + DEFAULT_GROUP),
        (E * (group_counts / (n * tokens * top_k) * P).sum(),
         f"f_i divides the group's counts by this rank's tokens times the group's size ({n} x {tokens}), but the "
         f"ranks hold different numbers of tokens ({group_tokens} in all): all_reduce the token count with the "
         "counts"),
        ((f * P).sum(),
         f"the term is {E} times too small: the Switch loss is n_experts * sum_i f_i P_i (so that perfect balance "
         "gives 1); multiply by n_experts"),
        (E * (group_counts / group_tokens * P).sum(),
         f"f_i divides the counts by the tokens only: each token makes top_k = {top_k} choices, so the fractions "
         f"sum to {top_k}; divide by tokens * top_k"),
        (E * (f * probs_in.sum(dim=0)).sum(),
         f"P_i is summed over the tokens, not averaged ({tokens} times too large): P_i = probs.mean(0)"),
        (E * (P * P).sum(),
         "f_i was built from the probabilities (f = probs.mean(0)): that makes the loss n_experts * sum_i P_i^2, "
         "another loss. f_i is the fraction of token choices routed to expert i, counted from experts (bincount), "
         "all-reduced over group; a count carries no gradient"),
        (E * (P_group * P).sum(),
         "f_i was built from the probabilities averaged over the ranks (f = all-reduced probs.mean(0)): f_i is the "
         "fraction of token choices routed to expert i, counted from experts (bincount) and all-reduced"),
        (E * (f * P_group).sum(),
         "every rank returned the group's whole loss: P was all-reduced as well. P_i must be the mean over this "
         "rank's tokens only; the average over the ranks happens when their gradients are averaged, and with P "
         "all-reduced each rank's gradient would count the other ranks' tokens too"),
    ]

    def value():
        if not isinstance(got, torch.Tensor):
            raise Wrong(f"return a tensor (a 0-dim tensor computed from probs), got {type(got).__name__}: the loss "
                        "is backpropagated into the router, and a Python number (.item()) carries no gradient")
        if got.numel() != 1:
            raise Wrong(f"return one number, this rank's term (a 0-dim tensor), got shape {tuple(got.shape)}: sum "
                        "f_i * P_i over the experts")
        if not torch.equal(probs.detach().cpu(), probs_in):
            raise Wrong("your function changed probs in place (probs.detach() and probs.data share its memory: an "
                        "in-place op on them writes into probs): the router still needs probs after the loss; "
                        "compute on new tensors (torch.zeros_like, .clone())")
        if not torch.equal(experts.cpu(), experts_in):
            raise Wrong("your function changed experts in place: the dispatch still needs them after the loss; "
                        "compute on new tensors")
        value = got.detach().cpu().reshape(())
        if not torch.isfinite(value):
            raise Wrong(f"{where}: rank {r}'s term is {float(value)}, not finite: look for a division by a count "
                        "that is 0 here (an expert that none of this rank's tokens chose); P_i = probs.mean(0) is "
                        "the mean over all this rank's tokens, f_i divides by the group's tokens * top_k")
        if _close(value, want):
            return
        for alt, why in alternatives:
            if _close(value, alt) and not _close(alt, want):
                raise Wrong(f"{where}: rank {r}'s term is {float(value):.6f}, expected {float(want):.6f}: {why}")
        raise Wrong(f"{where}: rank {r}'s term is {float(value):.6f}, expected {float(want):.6f}: the term is "
                    "n_experts * sum_i f_i P_i, f_i = (choices for expert i over every rank of group) / (tokens over "
                    "the group * top_k), P_i = probs.mean(0) over this rank's tokens")

    agree(_stage(sg, value))

    def gradient():
        if not got.requires_grad:
            raise Wrong("the term carries no gradient to probs: P_i = probs.mean(0) must stay in the graph (no "
                        ".detach(), .item() or torch.no_grad() on it); only the counts behind f_i carry none")
        (grad,) = torch.autograd.grad(got.reshape(()), probs, allow_unused=True)
        if grad is None or not grad.any():
            raise Wrong("the term carries no gradient to probs: P_i = probs.mean(0) must stay in the graph (no "
                        ".detach(), .item() or torch.no_grad() on it); only the counts behind f_i carry none")
        if not _close(grad.cpu(), want_grad):
            raise Wrong(f"{where}: the term's value is right but its gradient with respect to probs is not (max "
                        f"|diff| {float((grad.cpu() - want_grad).abs().max()):.3g}): the gradient must flow through "
                        "P_i = probs.mean(0) only, E f_i / T for each token; f_i is a count and must carry none "
                        "(a gradient through f makes it another loss)")

    agree(_stage(sg, gradient))

    values = [None] * n
    dist.all_gather_object(values, float(got.detach().reshape(())), group=group)
    one_process = load_balancing_loss(torch.cat([p for p, _ in members]), torch.cat([ex for _, ex in members]), cfg,
                                      local_statistics=True)

    def mean_is_the_batch_loss():
        # P over the whole batch is the ranks' P weighted by their tokens, so is the loss: sum_m T_m term_m / T
        mean = sum(t * v for t, v in zip(tokens_at, values)) / group_tokens
        if not abs(mean - float(one_process)) <= TOL * max(1.0, abs(float(one_process))):
            raise Wrong(f"{where}: the ranks' terms, weighted by their tokens, average to {mean:.6f}, but one process "
                        f"over the group's whole batch gives {float(one_process):.6f}: each rank's term must be "
                        "its tokens' share of the batch's loss")

    agree(_stage(sg, mean_is_the_batch_loss))


# -- exercise 3: the combine ------------------------------------------------------------------------------------------

COMBINE_CFG = MoEConfig(hidden=16, ffn=32, experts=8, top_k=2, capacity_factor=1.0, aux_coeff=0.1, z_coeff=0.01)
# data_seed 196 with skew 1.0: at world 2 and 4 every rank has a token whose two choices were both dropped, one that
# kept one choice and one that kept both, and some rank's last token dropped both (tests/test_ch16_exercises.py)
COMBINE_RUN = {"dtype": "float64", "seed": 0, "balanced": False, "tokens": 32, "data_seed": 196, "skew": 1.0}
ELSEWHERE = torch.device("meta")  # the default device while the answer runs: not where its inputs are
MADE_WITHOUT_DEVICE = ("a tensor made without device= (torch.zeros(...), torch.arange(...)) lands on the default "
                       "device, which the check sets elsewhere than the rows, as on a GPU rank (rows on cuda, the "
                       "default device the CPU): make the output with rows.new_zeros((tokens, h)), which takes rows' "
                       "device and dtype")


def _call_combine(answer, rows, token_index, weight, tokens: int, before) -> tuple[object, str | None]:
    """(the answer's output, None), or (None, what went wrong) when it raised: with the default device elsewhere
    than its inputs, and, if it runs where the default device is theirs, that is named as the cause."""
    try:
        with ELSEWHERE:
            return answer(rows, token_index, weight, tokens), None
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - a crash becomes the rank's verdict, shared by agree()
        said = f"your function raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    try:
        answer(*(t.clone() for t in before), tokens)
    except Exception:  # noqa: BLE001 - it fails wherever it runs: the error itself is the message
        return None, said
    return None, f"{said}, and ran when the default device was the rows': {MADE_WITHOUT_DEVICE}"


def _combine_diagnosis(y, rows, token_index, weight, tokens: int) -> str | None:
    """What is wrong with the answer's ``y`` for these inputs (taken before the answer ran), or None (values and
    graph only; gradients later)."""
    hidden = rows.shape[-1]
    if not isinstance(y, torch.Tensor):
        return f"return a tensor [tokens, h] = [{tokens}, {hidden}], got {type(y).__name__}"
    if y.device != rows.device:
        return f"your output is on {y.device}, not on rows' device ({rows.device}): {MADE_WITHOUT_DEVICE}"
    if y.dtype != rows.dtype:
        return (f"your output is {y.dtype}, the rows are {rows.dtype}: the output must keep the rows' precision; make "
                "it with rows.new_zeros((tokens, h)) (rows' dtype and device), not torch.zeros (float32 by default)")
    kept_tokens = int(token_index.unique().numel())
    last_kept = int(token_index.max()) + 1 if len(token_index) else 0
    if tuple(y.shape) != (tokens, hidden):
        if y.dim() == 2 and y.shape[0] == last_kept < tokens:
            return (f"returned {last_kept} rows, one per token up to the last that kept a choice (token_index.max() "
                    f"+ 1): here the last {tokens - last_kept} token(s) dropped all their choices and still need "
                    f"their zero rows; size the output with tokens, [tokens, h] = [{tokens}, {hidden}]")
        if y.dim() == 2 and y.shape[0] in (kept_tokens, rows.shape[0]) and y.shape[0] != tokens:
            what = "kept choice (as rows)" if y.shape[0] == rows.shape[0] else "token that kept a choice"
            return (f"returned shape {tuple(y.shape)}: one row per {what}; return one row per token, "
                    f"[tokens, h] = [{tokens}, {hidden}], with zeros for the {tokens - kept_tokens} token(s) whose "
                    "choices were all dropped (they ride the residual stream)")
        return f"returned shape {tuple(y.shape)}, expected [tokens, h] = [{tokens}, {hidden}]"
    r, t, w = rows, token_index, weight
    got = y.detach()
    bad = ~torch.isfinite(got).all(dim=-1)
    if bad.any():
        return (f"the output holds NaN or inf at token(s) {bad.nonzero()[:, 0].tolist()[:4]}, not finite although "
                "every row and weight is: y[t] = sum over the rows r with token_index[r] == t of weight[r] * rows[r]")
    want = r.new_zeros((tokens, hidden)).index_add(0, t, r * w[:, None])
    if _close(got, want, 1e-10):
        if not y.requires_grad:
            return ("the output carries no gradient: no gradient reaches the experts (nor the router through the "
                    "weights); compute it from rows and weight with differentiable ops (no torch.no_grad(), no "
                    ".detach())")
        return None
    twice = (token_index.bincount(minlength=tokens) > 1)
    weighted = r * w[:, None]
    one_of_two = all(any(_close(got[tok], weighted[i], 1e-10) for i in (t == tok).nonzero()[:, 0].tolist())
                     for tok in twice.nonzero()[:, 0].tolist())
    if twice.any() and one_of_two:
        return ("a token chose two experts, but its output holds only one of their weighted rows: y[token_index] = "
                "... keeps the last write for a repeated index; add instead, out.index_add(0, token_index, "
                "rows * weight[:, None])")
    if _close(got, r.new_zeros((tokens, hidden)).index_add(0, t, r), 1e-10):
        return ("the rows were added without their routing weights: each expert's output counts as much as its "
                "weight, y[t] = sum_r weight[r] * rows[r]")
    if _close(got, r.new_zeros((tokens, hidden)).index_add(0, t, r * (w * w)[:, None]), 1e-10):
        return ("the rows were multiplied by their routing weight twice (weight squared): multiply once, "
                "rows * weight[:, None]")
    err = float((got - want).abs().max())
    return (f"the output differs by up to {err:.3g} from the weighted sum of each token's rows: y[t] = sum over the "
            "rows r with token_index[r] == t of weight[r] * rows[r] (rows come in the order of token_index)")


def check_combine(ctx, answer) -> None:
    from workers.moe.batch import DTYPES, batch
    from workers.moe.dispatch import all_to_all
    from workers.moe.equivalence import reference
    from workers.moe.layer import MoELayer, build_weights, expert_mesh, reduce_gradients

    world, rank = ctx.world_size, ctx.rank
    cfg, run = COMBINE_CFG, {**COMBINE_RUN, "world": world}
    dtype = DTYPES[run["dtype"]]
    ref = reference(cfg, run)  # one process, token by token: output, input gradient, every parameter's gradient
    weights = build_weights(cfg, run["seed"], dtype)
    x_all, g_all = batch(cfg, run["tokens"], run["data_seed"], run["skew"], dtype, weights)
    per = run["tokens"] // world
    rows_of_mine = slice(rank * per, (rank + 1) * per)
    seen: dict = {}

    with expert_mesh(world, world, rank) as mesh:
        layer = MoELayer(cfg, mesh, weights=weights, device=ctx.device, dtype=dtype)
        dispatcher = layer.dispatcher

        def combine(expert_output, state, tokens):  # the dispatcher's combine, with the learner's last step
            inverse = torch.argsort(state.local_order)
            back = all_to_all(dispatcher.group, expert_output[inverse], state.send_splits, state.recv_splits)  # [A, h]
            token_index = state.token_index.clone()
            # the inputs as they were: to tell a change in place, and to diagnose from what the answer was given
            before = (back.detach().clone(), token_index.clone(), state.weight.detach().clone())
            y, seen["problem"] = _call_combine(answer, back, token_index, state.weight, tokens, before)
            changed = [name for name, now, then in zip(("rows", "token_index", "weight"),
                                                       (back.detach(), token_index, state.weight.detach()), before)
                       if not torch.equal(now, then)]
            if changed and seen["problem"] is None:
                seen["problem"] = (f"your function changed {' and '.join(changed)} in place (rows *= ..., "
                                   "weight.mul_(...)): the caller still reads them after the combine, and autograd "
                                   "may have saved them for the backward; compute into new tensors "
                                   "(rows * weight[:, None])")
            if seen["problem"] is None:
                seen["problem"] = _combine_diagnosis(y, *before, tokens)
            if seen["problem"] is None:
                return y
            # a stand-in of the right shape, so the forward ends and every rank reports together
            rows, index, weight = before
            return rows.new_zeros((tokens, rows.shape[-1])).index_add(0, index, rows * weight[:, None])

        dispatcher.combine = combine
        x = x_all[rows_of_mine].clone().to(ctx.device).requires_grad_(True)  # [T/W, h]
        y = layer(x)

        def forward():
            if seen.get("problem"):
                raise Wrong(seen["problem"])

        agree(forward)

        loss = (y * g_all[rows_of_mine].to(ctx.device)).sum(dim=-1).mean() + layer.aux_loss
        loss.backward()
        reduce_gradients(layer.parameters(), layer.expert_parameters(), mesh, router_params=layer.router.parameters())

        def output_and_gradients():
            want_y = ref["y"][rows_of_mine]
            if not _close(y.detach().cpu(), want_y, 1e-10):
                raise Wrong(f"rank {rank}'s output differs from the one-process layer by up to "
                            f"{float((y.detach().cpu() - want_y).abs().max()):.3g}: each token's output is the "
                            "weighted sum of its kept experts' rows")
            grads = dict(layer.named_parameters())
            starved = [n for n, p in grads.items() if n.startswith("experts.") and p.grad is None
                       and ref["grads"][n].any()]
            if starved:
                raise Wrong(f"no gradient reaches the experts ({', '.join(starved[:2])}{', ...' if len(starved) > 2 else ''}"
                            " have none after backward): the rows must stay in the graph (no .detach(), no "
                            "torch.no_grad()), so the backward all-to-all carries their gradients to the experts' ranks")
            for name, p in grads.items():
                want = ref["grads"][name]
                got = torch.zeros_like(want) if p.grad is None else p.grad.detach().cpu()
                if _close(got, want, 1e-10):
                    continue
                if name == "router.weight":
                    raise Wrong("the router's gradient differs from the one-process layer's, although the output is "
                                "right: the routing weights must stay in the graph (no weight.detach()); that is how "
                                "the router learns which experts served a token well")
                raise Wrong(f"the gradient of {name} differs from the one-process layer's by up to "
                            f"{float((got - want).abs().max()):.3g}: the combine must be differentiable in rows and "
                            "weight, each row times its weight added into its token's place")
            want_dx = ref["input_grad"][rows_of_mine]
            got_dx = (x.grad / world).detach().cpu()  # this rank backpropagated its own mean; the global loss: / world
            if not _close(got_dx, want_dx, 1e-10):
                raise Wrong(f"the input's gradient differs from the one-process layer's by up to "
                            f"{float((got_dx - want_dx).abs().max()):.3g}")

        agree(output_and_gradients)


CHECKS = {"load_balancing_loss": check_load_balancing_loss, "combine": check_combine}


def main(ctx, exercise: str = "", answer=None):
    return run_exercise(ctx, CHECKS, exercise, answer)
