"""Plausible wrong answers for chapter 04, each with a fragment of the message the check must give."""


def column_without_f(x, weight, bias, group):
    # Right forward, but the input gradient never gets the other ranks' contributions.
    import torch.nn.functional as F

    return F.linear(x, weight, bias)


def column_gathers_output(x, weight, bias, group):
    # Returns the whole output: that is gather_output=True, not what a column layer feeding a row layer wants.
    import torch.nn.functional as F

    from workers.parallel.mappings import copy_to_tensor_model_parallel_region, gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(F.linear(copy_to_tensor_model_parallel_region(x, group),
                                                             weight, bias), group)


def row_bias_on_every_rank(x, weight, bias, group):
    # The bias double-count: added before the all-reduce, so the sum holds it t times.
    import torch.nn.functional as F

    from workers.parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(F.linear(x, weight, bias), group)


def row_without_reduce(x, weight, bias, group):
    import torch.nn.functional as F

    return F.linear(x, weight) + bias


def row_bias_divided(x, weight, bias, group):
    # A "fix" of the double count: bias/t on every rank. The forward is right; the bias gradient is not.
    import torch.distributed as dist
    import torch.nn.functional as F

    from workers.parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(F.linear(x, weight) + bias / dist.get_world_size(group), group)


def swiglu_naive_chunk(w, rank, world_size):
    return w.chunk(world_size, dim=0)[rank]


def swiglu_up_then_gate(w, rank, world_size):
    # The right rows in the wrong order: silu is applied to up and multiplied by gate.
    import torch

    ffn = w.shape[0] // 2
    n = ffn // world_size
    return torch.cat([w[ffn + rank * n:ffn + (rank + 1) * n], w[rank * n:(rank + 1) * n]])


WRONG = [
    ("column_parallel_forward", column_without_f, "only this rank's contribution"),
    ("column_parallel_forward", column_gathers_output, "whole output"),
    ("row_parallel_forward", row_bias_on_every_rank, "added it on every rank before the all-reduce"),
    ("row_parallel_forward", row_without_reduce, "partial product"),
    ("row_parallel_forward", row_bias_divided, "bias gradient"),
    ("swiglu_shard", swiglu_naive_chunk, "contiguous chunk"),
    ("swiglu_shard", swiglu_up_then_gate, "in that order"),
]
