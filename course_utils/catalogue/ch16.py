"""Chapter 16's graded exercises: the dispatch's permutation and split sizes (checked here, a pure function), the
Switch load-balancing loss on global statistics and the combine inside a real expert-parallel layer (on ranks,
``workers/exercises/ch16.py``)."""
from course_utils.exercises import FAIL, PASS, Exercise, register

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


def _as_ints(value) -> list[int] | None:
    import torch

    try:
        out = value.tolist() if isinstance(value, torch.Tensor) else list(value)
        if any(isinstance(v, float) and v != int(v) for v in out):
            return None
        return [int(v) for v in out]
    except (TypeError, ValueError):
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
        result = answer(experts.clone(), keep.clone(), n_experts, ep)
        if not torch.equal(experts, dispatch_case(tokens, n_experts, top_k, ep, cf, seed, empty)[0]):
            return FAIL, f"{where}: your function changed experts in place: sort a copy (the router still needs it)"
        if not (isinstance(result, (tuple, list)) and len(result) == 2):
            return FAIL, (f"{where}: return a pair (order, send_splits): order an int64 tensor of positions into "
                          f"experts[keep], send_splits a list of {ep} ints; got {type(result).__name__}")
        order, splits = result
        order = order if isinstance(order, torch.Tensor) else torch.as_tensor(order)
        splits = _as_ints(splits)
        if splits is None:
            return FAIL, f"{where}: send_splits must be a list of {ep} ints (the rows for each EP rank)"
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


register(Exercise("dispatch_plan", "16", "dispatch_plan",
                  "The dispatch: sort the kept token choices by expert, and count the rows for each EP rank",
                  local=check_dispatch_plan))
register(Exercise("load_balancing_loss", "16", "load_balancing_loss",
                  "The Switch load-balancing loss on the whole batch's counts (an all-reduce), this rank's probabilities",
                  worker=CHECKER, world_sizes=(2, 4)))
register(Exercise("combine", "16", "combine",
                  "The combine: each token's weighted sum of its experts' rows, inside a real expert-parallel layer",
                  worker=CHECKER, world_sizes=(2, 4)))
