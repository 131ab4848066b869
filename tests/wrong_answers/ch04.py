"""Plausible wrong answers for chapter 04, each with a fragment of the message the check must give."""
from tests.wrong_answers import tries


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


def row_bias_on_rank_zero(x, weight, bias, group):
    # Another "fix" of the double count: only rank 0 adds the bias, inside g. The output is right on every
    # rank; the other ranks' copies of the bias get no gradient (they would drift apart at the first step).
    import torch.distributed as dist
    import torch.nn.functional as F

    from workers.parallel.mappings import reduce_from_tensor_model_parallel_region

    partial = F.linear(x, weight)
    if dist.get_rank(group) == 0:
        partial = partial + bias
    return reduce_from_tensor_model_parallel_region(partial, group)


def column_f_on_world_group(x, weight, bias, group):
    # A hand-written f whose backward all-reduces on the default group: right when the group is the whole
    # world, wrong inside a tensor-parallel group of a larger world (it sums the other groups' gradients in).
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    class CopyTo(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.clone()
            dist.all_reduce(grad)  # group= forgotten
            return grad

    return F.linear(CopyTo.apply(x), weight, bias)


def row_g_on_world_group(x, weight, bias, group):
    # g called without its group argument: it sums over the whole world.
    import torch.nn.functional as F

    from workers.parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(F.linear(x, weight)) + bias


def swiglu_naive_chunk(w, rank, tp):
    return w.chunk(tp, dim=0)[rank]


def swiglu_up_then_gate(w, rank, tp):
    # The right rows in the wrong order: silu is applied to up and multiplied by gate.
    import torch

    ffn = w.shape[0] // 2
    n = ffn // tp
    return torch.cat([w[ffn + rank * n:ffn + (rank + 1) * n], w[rank * n:(rank + 1) * n]])


def swiglu_up_off_by_one(w, rank, tp):
    # Wrong on every rank, but the shape is wrong on the last rank only: its up slice runs past the end of
    # the fused weight and comes out one row short. The check must say so, not hang in the MLP's all-reduce
    # that the other ranks enter.
    import torch

    ffn = w.shape[0] // 2
    n = ffn // tp
    return torch.cat([w[rank * n:(rank + 1) * n], w[ffn + rank * n + 1:ffn + (rank + 1) * n + 1]])


def column_leaves_a_nan(x, weight, bias, group):
    # The right layer, but one output value is NaN.
    import torch.nn.functional as F

    from workers.parallel.mappings import copy_to_tensor_model_parallel_region

    y = F.linear(copy_to_tensor_model_parallel_region(x, group), weight, bias)
    y[0, 0, 0] = float("nan")
    return y


def row_leaves_a_nan(x, weight, bias, group):
    # The right layer, but one output value is NaN.
    import torch.nn.functional as F

    from workers.parallel.mappings import reduce_from_tensor_model_parallel_region

    y = reduce_from_tensor_model_parallel_region(F.linear(x, weight), group) + bias
    y[0, 0, 0] = float("nan")
    return y


def swiglu_leaves_a_nan(w, rank, tp):
    # The right rows, but one value is NaN.
    import torch

    ffn = w.shape[0] // 2
    n = ffn // tp
    out = torch.cat([w[rank * n:(rank + 1) * n], w[ffn + rank * n:ffn + (rank + 1) * n]])
    out.view(-1)[0] = float("nan")
    return out

# Marked after their definitions, not with a decorator: an answer travels as its source (to the ranks, and into
# a notebook cell in the browser test), and a decorator line would travel with it.
tries("output")(column_gathers_output)
tries("layouts")(column_f_on_world_group)
tries("layouts")(row_g_on_world_group)
tries("output")(swiglu_up_off_by_one)
tries("non-finite")(column_leaves_a_nan)
tries("non-finite")(row_leaves_a_nan)
tries("non-finite")(swiglu_leaves_a_nan)


WRONG = [
    ("column_parallel_forward", column_without_f, "only this rank's contribution"),
    ("column_parallel_forward", column_gathers_output, "whole output"),
    ("column_parallel_forward", column_f_on_world_group, "used the default (world) group instead of the group"),
    ("column_parallel_forward", column_leaves_a_nan, "output columns holds NaN or inf"),
    ("row_parallel_forward", row_g_on_world_group, "used the default (world) group instead of the group"),
    ("row_parallel_forward", row_bias_on_every_rank, "added it on every rank before the all-reduce"),
    ("row_parallel_forward", row_without_reduce, "partial product"),
    ("row_parallel_forward", row_bias_divided, "bias gradient"),
    ("row_parallel_forward", row_bias_on_rank_zero, "copy of the bias gets no gradient"),
    ("row_parallel_forward", row_leaves_a_nan, "output holds NaN or inf"),
    ("swiglu_shard", swiglu_naive_chunk, "contiguous chunk"),
    ("swiglu_shard", swiglu_up_then_gate, "in that order"),
    ("swiglu_shard", swiglu_up_off_by_one, "silently cut short"),
    ("swiglu_shard", swiglu_leaves_a_nan, "holds NaN or inf"),
]
