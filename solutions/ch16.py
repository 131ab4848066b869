"""Reference answers for chapter 16's exercises (each self-contained: it may travel to the ranks as source)."""


def dispatch_plan(experts, keep, n_experts, ep):
    """The permutation that sorts the kept (token, choice) pairs by expert, and the rows for each EP rank (rank r
    holds experts [r E/ep, (r+1) E/ep), so sorted by expert is sorted by destination)."""
    import torch

    kept = experts[keep]  # [A]: the kept choices' experts, (token, choice) order
    order = torch.argsort(kept, stable=True)  # [A]: by expert, token order within
    counts = torch.bincount(kept, minlength=n_experts)  # [E] rows per expert
    send_splits = counts.view(ep, n_experts // ep).sum(dim=1).tolist()  # [ep] rows per EP rank
    return order, send_splits


def load_balancing_loss(probs, experts, n_experts, top_k, group):
    """This rank's term of the Switch loss, E * sum_i f_i P_i: f_i from the choices of every rank of ``group`` (an
    all-reduce of the counts and of the token count; no gradient), P_i the mean over this rank's tokens."""
    import torch
    import torch.distributed as dist

    counts = torch.bincount(experts.reshape(-1), minlength=n_experts).to(probs.dtype)  # [E], before drops
    tokens = torch.tensor([float(experts.shape[0])], dtype=probs.dtype, device=probs.device)
    stats = torch.cat([counts, tokens])  # [E + 1]: one all-reduce for both
    dist.all_reduce(stats, group=group)
    f = stats[:-1] / (stats[-1] * top_k)  # [E], sums to 1
    return n_experts * (f * probs.mean(dim=0)).sum()


def combine(rows, token_index, weight, tokens):
    """Each token's output: the sum of its kept rows, each times its routing weight (0 where every choice dropped)."""
    out = rows.new_zeros((tokens, rows.shape[-1]))  # [T, h]
    return out.index_add(0, token_index, rows * weight[:, None])
