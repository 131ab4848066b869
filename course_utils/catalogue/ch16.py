"""Chapter 16's graded exercises: the dispatch's permutation and split sizes (checked here, a pure function), the
Switch load-balancing loss on global statistics and the combine inside a real expert-parallel layer (on ranks,
``workers/exercises/ch16.py``)."""
from course_utils.exercises import FAIL, NOT_APPLICABLE, PASS, Exercise, register

CHECKER = "workers.exercises.ch16"

# (tokens, n_experts, top_k, ep, capacity_factor, seed, empty): ``empty`` an expert no token chooses (or None).
# Capacity factor 1.0 drops choices; 0 is dropless. Every split between experts and EP ranks the chapter uses.
DISPATCH_CASES = (
    (12, 8, 2, 2, 1.0, 0, 5),  # top-2, drops, expert 5 gets no token
    (10, 4, 1, 2, 1.0, 1, None),  # top-1, drops
    (16, 8, 2, 4, 0.0, 2, None),  # top-2, dropless, 2 experts per rank
    (9, 4, 2, 1, 1.0, 3, None),  # one EP rank holds every expert
    (8, 8, 1, 4, 0.0, 4, 0),  # top-1, dropless, expert 0 gets no token
    (12, 4, 2, 4, 1.0, 5, None),  # one expert per rank: per expert is per rank
)


def dispatch_case(tokens, n_experts, top_k, ep, capacity_factor, seed, empty):
    """(experts [T, k] int64, keep [T, k] bool) for one case: skewed scores (low experts preferred), each token's k
    distinct top experts, then the chapter's capacity rule (``workers/moe/router.keep_mask``)."""
    import torch

    from workers.moe.config import MoEConfig
    from workers.moe.router import keep_mask

    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(tokens, n_experts, generator=gen, dtype=torch.float64)
    scores += 1.5 * torch.linspace(1.0, 0.0, n_experts, dtype=torch.float64)  # a busy expert, so capacity drops
    if empty is not None:
        scores[:, empty] = -float("inf")
    experts = scores.topk(top_k, dim=-1).indices  # [T, k]
    cfg = MoEConfig(experts=n_experts, top_k=top_k, capacity_factor=capacity_factor)
    return experts, keep_mask(experts, n_experts, cfg.capacity(tokens))


def _splits_problem(splits, ep: int) -> str | None:
    """Why ``splits`` cannot be ``all_to_all_single``'s split sizes (a sequence of Python ints), or None."""
    import math

    import torch

    if isinstance(splits, torch.Tensor):
        return ("send_splits is a tensor: torch.distributed.all_to_all_single takes its split sizes as a list of "
                "Python ints and refuses a tensor (TypeError: incompatible function arguments); return "
                "counts.tolist()")
    if not isinstance(splits, (list, tuple)):
        return f"send_splits must be a list of {ep} ints (the rows for each EP rank), got {type(splits).__name__}"
    for i, v in enumerate(splits):
        if isinstance(v, float) and not math.isfinite(v):
            return f"send_splits[{i}] is {v}: a split size is a number of rows, a Python int"
        if type(v) is not int:
            return (f"send_splits[{i}] is {v!r}, of type {type(v).__name__}: all_to_all_single needs Python ints "
                    "(a number of rows); .tolist() of an integer tensor gives them")
    return None


def check_dispatch_plan(answer) -> tuple[str, str]:
    """``answer(experts, keep, n_experts, ep)`` = (order, send_splits): the permutation that sorts the kept choices
    ``experts[keep]`` by expert, and how many of them go to each EP rank."""
    import torch

    for tokens, n_experts, top_k, ep, cf, seed, empty in DISPATCH_CASES:
        experts, keep = dispatch_case(tokens, n_experts, top_k, ep, cf, seed, empty)
        kept = experts[keep]  # [A], (token, choice) order
        A, per = int(keep.sum()), n_experts // ep
        counts = torch.bincount(kept, minlength=n_experts)
        want_splits = counts.view(ep, per).sum(dim=1).tolist()
        where = (f"for experts [T={tokens}, k={top_k}], n_experts={n_experts}, ep={ep} ({A} of {tokens * top_k} "
                 f"choices kept{', expert ' + str(empty) + ' chosen by no token' if empty is not None else ''})")
        given_experts, given_keep = experts.clone(), keep.clone()
        try:
            result = answer(given_experts, given_keep, n_experts, ep)
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001 - named with the case that raised it
            unchosen = n_experts - (int(kept.max()) + 1 if A else 0)
            hint = (f" (the last {unchosen} expert(s) got no kept choice here, so torch.bincount(experts[keep]) has "
                    f"fewer than {n_experts} entries unless you pass minlength=n_experts)" if unchosen else "")
            return FAIL, f"{where}: your function raised {type(exc).__name__}: {exc}{hint}"
        for name, given, original in (("experts", given_experts, experts), ("keep", given_keep, keep)):
            if not torch.equal(given, original):
                return FAIL, (f"{where}: your function changed {name} in place (an in-place op such as //= or "
                              f"masked_fill_ on it): compute on new tensors; the caller still reads {name} after the "
                              "dispatch")
        if not (isinstance(result, (tuple, list)) and len(result) == 2):
            return FAIL, (f"{where}: return a pair (order, send_splits): order an int64 tensor of positions into "
                          f"experts[keep], send_splits a list of {ep} ints; got {type(result).__name__}")
        order, splits = result
        order = order if isinstance(order, torch.Tensor) else torch.as_tensor(order)
        problem = _splits_problem(splits, ep)
        if problem:
            return FAIL, f"{where}: {problem}"
        splits = list(splits)
        if order.dtype.is_floating_point or order.dtype == torch.bool or order.dim() != 1:
            return FAIL, (f"{where}: order must be a 1-D integer tensor of positions into experts[keep] (like "
                          f"torch.argsort's result), got dtype {order.dtype} and shape {tuple(order.shape)}")
        if A < tokens * top_k and (len(order) == tokens * top_k or sum(splits) == tokens * top_k):
            return FAIL, (f"{where}: you listed all {tokens * top_k} choices, but only {A} are kept: the dropped "
                          "choices (keep False) are never sent. Work on experts[keep], not experts.reshape(-1)")
        if len(splits) != ep:
            if len(splits) == n_experts:
                return FAIL, (f"{where}: send_splits has {n_experts} entries, one per expert; the all-to-all needs one "
                              f"count per EP rank ({ep}): add up the counts of the {per} expert(s) each rank holds "
                              "(bincount(...).view(ep, -1).sum(1))")
            return FAIL, f"{where}: send_splits has {len(splits)} entries; give one per EP rank, {ep}"
        if sum(splits) != A:
            return FAIL, f"{where}: send_splits adds up to {sum(splits)}, but {A} rows are sent: one per kept choice"
        if splits != want_splits:
            round_robin = torch.bincount(kept % ep, minlength=ep).tolist()
            if splits == round_robin:
                return FAIL, (f"{where}: send_splits is {splits}, expected {want_splits}: you gave expert e to rank "
                              f"e % ep (round robin); EP rank r holds a contiguous block of experts, [r*E/ep, "
                              f"(r+1)*E/ep), so expert e goes to rank e // (E/ep) = e // {per}")
            return FAIL, (f"{where}: send_splits is {splits}, expected {want_splits}: rank r receives the kept "
                          f"choices of experts [r*{per}, (r+1)*{per})")
        if len(order) != A:
            return FAIL, f"{where}: order has {len(order)} entries; give one per kept choice, {A}"
        order = order.long()
        ids = kept.sort().values
        if torch.equal(order, ids) and not torch.equal(torch.sort(order).values, torch.arange(A)):
            return FAIL, (f"{where}: order holds the sorted expert ids, not positions: return the permutation that "
                          "sorts them (torch.argsort(experts[keep], stable=True)), which says which row goes where")
        if not torch.equal(torch.sort(order).values, torch.arange(A)):
            return FAIL, (f"{where}: order must hold each position 0..{A - 1} into experts[keep] exactly once (a "
                          "permutation: every kept row is sent once)")
        sent = kept[order]
        if not bool((sent[1:] >= sent[:-1]).all()):
            if torch.equal(order, torch.arange(A)):
                return FAIL, (f"{where}: order is the identity: the rows stay in token order, so one destination's "
                              "rows are not contiguous and the split sizes do not describe them; sort them by expert "
                              "(torch.argsort(experts[keep], stable=True))")
            return FAIL, (f"{where}: experts[keep][order] is {sent.tolist()}, not sorted by expert (ascending): rank "
                          "0's experts must come first, then rank 1's, ...")
    return PASS, (f"the permutation and the split sizes are right in all {len(DISPATCH_CASES)} cases (top-1 and top-2, "
                  "with and without drops, ep 1, 2 and 4, an expert without tokens)")


NO_GRADIENTS = NOT_APPLICABLE + "no gradients are accumulated: the answer is called once per case, on fresh inputs"
LOCAL_ARITHMETIC = NOT_APPLICABLE + "the check does not watch the wire; the traffic is the chapter's all-to-all's"
NO_MEMORY = NOT_APPLICABLE + "the answer keeps no buffer to release: a few small tensors per call"
NO_BITS = NOT_APPLICABLE + "values are compared to a tolerance (float64 sums in another order), or are integers"

register(Exercise("dispatch_plan", "16", "dispatch_plan",
                  "The dispatch: sort the kept token choices by expert, and count the rows for each EP rank",
                  local=check_dispatch_plan, tries={
                      "non-finite": "split sizes are checked to be Python ints; a NaN among them is named",
                      "order": NO_GRADIENTS,
                      "sizes": NOT_APPLICABLE + "n_experts is a multiple of ep in every case, as the layer requires",
                      "ragged": "experts that no kept choice reaches, the last ones too, and dropped choices: the "
                                "counts keep one entry per expert and the permutation covers the kept choices only",
                      "layouts": "ep 1, 2 and 4 with 4 and 8 experts, one and two experts per rank: the splits are "
                                 "per EP rank, expert e on rank e // (E/ep)",
                      "traffic": LOCAL_ARITHMETIC,
                      "mutation": "experts and keep are compared with copies taken before the call",
                      "output": "order must be a 1-D integer tensor, send_splits a list of Python ints (what "
                                "all_to_all_single accepts; it refuses a tensor)",
                      "memory": NO_MEMORY,
                      "bits": NO_BITS}))
register(Exercise("load_balancing_loss", "16", "load_balancing_loss",
                  "The Switch load-balancing loss on the whole batch's counts (an all-reduce), this rank's probabilities",
                  worker=CHECKER, world_sizes=(2, 4), tries={
                      "non-finite": "a NaN or infinite term is named before its value is compared",
                      "order": NO_GRADIENTS,
                      "sizes": NOT_APPLICABLE + "nothing is split between the ranks: each holds its own tokens",
                      "ragged": "a batch with 13, 2, 9 and 5 tokens on the ranks: f divides by the group's tokens "
                                "(not this rank's times the group's size), and an all_gather of unequal shapes is "
                                "named instead of aborting the ranks",
                      "layouts": "the world, then at world 4 two groups of 2 (consecutive and non-contiguous ranks) "
                                 "with their own data: the answer's collectives must use the group it was given",
                      "traffic": NOT_APPLICABLE + "the statistics are small (E + 1 numbers); the result, not the "
                                 "collective, is compared",
                      "mutation": "probs and experts are compared with copies after the call (probs.detach() shares "
                                  "probs' memory)",
                      "output": NOT_APPLICABLE + "a 0-dim tensor is required and its value and gradient compared; it "
                                "is never stored in a buffer of the caller's",
                      "memory": NO_MEMORY,
                      "bits": NO_BITS}))
register(Exercise("combine", "16", "combine",
                  "The combine: each token's weighted sum of its experts' rows, inside a real expert-parallel layer",
                  worker=CHECKER, world_sizes=(2, 4), tries={
                      "non-finite": "a NaN or infinite output row is named (a token that kept no choice divides 0 by "
                                    "0 if the weights are renormalised)",
                      "order": NOT_APPLICABLE + "one forward and one backward of the layer; no gradient arrives early "
                               "or twice",
                      "sizes": NOT_APPLICABLE + "the tokens are this rank's own; the combine divides nothing between "
                               "ranks",
                      "ragged": "tokens that kept one, two or none of their choices, and a rank whose last token kept "
                                "none: the output has one row per token, zeros for those",
                      "layouts": NOT_APPLICABLE + "the combine is per-rank arithmetic: EP 2 and 4 change its data, "
                                 "not its rule",
                      "traffic": LOCAL_ARITHMETIC,
                      "mutation": "rows, token_index and weight are compared with copies taken before the call, and "
                                  "the diagnosis reads the copies",
                      "output": "the answer runs with the default device elsewhere than its inputs (a GPU rank's "
                                "case); the output must be on the rows' device, in their dtype, [tokens, h]",
                      "memory": NO_MEMORY,
                      "bits": NO_BITS}))
