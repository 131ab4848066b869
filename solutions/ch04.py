"""Reference answers for chapter 04's exercises (each self-contained: it travels to the ranks as source)."""


def column_parallel_forward(x, weight, bias, group):
    """This rank's output columns ``x A_r + b_r``; x enters through f so that its gradient is summed over ranks."""
    import torch.nn.functional as F

    from workers.parallel.mappings import copy_to_tensor_model_parallel_region

    x = copy_to_tensor_model_parallel_region(x, group)  # f: identity forward, all-reduce backward
    return F.linear(x, weight, bias)  # [s, b, out/t]


def row_parallel_forward(x, weight, bias, group):
    """``sum_r x_r A_r`` with g, then the bias, once."""
    import torch.nn.functional as F

    from workers.parallel.mappings import reduce_from_tensor_model_parallel_region

    partial = F.linear(x, weight)  # [s, b, out], this rank's addend
    return reduce_from_tensor_model_parallel_region(partial, group) + bias  # g, then the bias once


def swiglu_shard(w, rank, tp):
    """Rows of the fused [gate; up] for this rank: its block of gate, then the same block of up."""
    import torch

    ffn = w.shape[0] // 2
    n = ffn // tp
    return torch.cat([w[rank * n:(rank + 1) * n], w[ffn + rank * n:ffn + (rank + 1) * n]])


def vocab_parallel_loss(logits, target, group):
    """Per-token cross-entropy ``[s, b]`` from this rank's ``logits [s, b, V/t]``: three all-reduces of ``[s, b]``."""
    import torch.distributed as dist

    part = logits.shape[-1]
    start = dist.get_rank(group) * part  # this rank holds words [start, start + part)
    logits_max = logits.max(dim=-1).values  # [s, b], this rank's words only
    dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)  # the same shift on every rank
    z = logits - logits_max.unsqueeze(-1)  # [s, b, V/t], at most 0: exp cannot overflow; the caller's logits untouched
    elsewhere = (target < start) | (target >= start + part)
    local = (target - start).masked_fill(elsewhere, 0)  # an index inside the shard; its pick is zeroed below
    predicted = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(elsewhere, 0.0)  # [s, b]
    dist.all_reduce(predicted, group=group)  # exactly one rank holds each target
    sum_exp = z.exp().sum(dim=-1)  # [s, b]
    dist.all_reduce(sum_exp, group=group)  # the denominator runs over the whole vocabulary
    return sum_exp.log() - predicted  # log sum_j exp(z_j - max) - (z_target - max)
