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
