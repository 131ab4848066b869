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

def loss_max_not_reduced(logits, target, group):
    # Each rank subtracts its own largest logit: nothing overflows, but the ranks' sums are in different units.
    import torch.distributed as dist

    part = logits.shape[-1]
    start = dist.get_rank(group) * part
    z = logits - logits.max(dim=-1).values.unsqueeze(-1)
    elsewhere = (target < start) | (target >= start + part)
    local = (target - start).masked_fill(elsewhere, 0)
    predicted = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(elsewhere, 0.0)
    dist.all_reduce(predicted, group=group)
    sum_exp = z.exp().sum(dim=-1)
    dist.all_reduce(sum_exp, group=group)
    return sum_exp.log() - predicted


def loss_target_not_masked(logits, target, group):
    # The index is clamped into the shard (no crash), but the logit it picks on the other ranks is kept.
    import torch.distributed as dist

    part = logits.shape[-1]
    start = dist.get_rank(group) * part
    logits_max = logits.max(dim=-1).values
    dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
    z = logits - logits_max.unsqueeze(-1)
    local = (target - start).clamp(0, part - 1)
    predicted = z.gather(-1, local.unsqueeze(-1)).squeeze(-1)
    dist.all_reduce(predicted, group=group)
    sum_exp = z.exp().sum(dim=-1)
    dist.all_reduce(sum_exp, group=group)
    return sum_exp.log() - predicted


def loss_sum_not_reduced(logits, target, group):
    # The max and the target's logit are reduced, the denominator is not: each rank normalises over its own words.
    import torch.distributed as dist

    part = logits.shape[-1]
    start = dist.get_rank(group) * part
    logits_max = logits.max(dim=-1).values
    dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
    z = logits - logits_max.unsqueeze(-1)
    elsewhere = (target < start) | (target >= start + part)
    local = (target - start).masked_fill(elsewhere, 0)
    predicted = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(elsewhere, 0.0)
    dist.all_reduce(predicted, group=group)
    return z.exp().sum(dim=-1).log() - predicted


def loss_without_max(logits, target, group):
    # The algebra without the max: exact on ordinary logits, infinite once exp() overflows.
    import torch.distributed as dist

    part = logits.shape[-1]
    start = dist.get_rank(group) * part
    elsewhere = (target < start) | (target >= start + part)
    local = (target - start).masked_fill(elsewhere, 0)
    predicted = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(elsewhere, 0.0)
    dist.all_reduce(predicted, group=group)
    sum_exp = logits.exp().sum(dim=-1)
    dist.all_reduce(sum_exp, group=group)
    return sum_exp.log() - predicted


def loss_max_summed(logits, target, group):
    # The max all-reduced with the default op (SUM): the same shift everywhere, right on ordinary logits, but on
    # large ones the sum of the ranks' maxima pushes every exponential to 0.
    import torch.distributed as dist

    part = logits.shape[-1]
    start = dist.get_rank(group) * part
    logits_max = logits.max(dim=-1).values
    dist.all_reduce(logits_max, group=group)
    z = logits - logits_max.unsqueeze(-1)
    elsewhere = (target < start) | (target >= start + part)
    local = (target - start).masked_fill(elsewhere, 0)
    predicted = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(elsewhere, 0.0)
    dist.all_reduce(predicted, group=group)
    sum_exp = z.exp().sum(dim=-1)
    dist.all_reduce(sum_exp, group=group)
    return sum_exp.log() - predicted


def loss_gathers_logits(logits, target, group):
    # The right number the expensive way: the whole [s, b, V] logits gathered on every rank, then the dense loss.
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    shards = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, logits.contiguous(), group=group)
    full = torch.cat(shards, dim=-1)
    return F.cross_entropy(full.flatten(0, 1), target.flatten(), reduction="none").view(target.shape)


def loss_subtracts_in_place(logits, target, group):
    # Megatron's memory saving copied without its context: the max subtracted from the caller's logits in place.
    import torch.distributed as dist

    part = logits.shape[-1]
    start = dist.get_rank(group) * part
    logits_max = logits.max(dim=-1).values
    dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
    logits.sub_(logits_max.unsqueeze(-1))
    elsewhere = (target < start) | (target >= start + part)
    local = (target - start).masked_fill(elsewhere, 0)
    predicted = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(elsewhere, 0.0)
    dist.all_reduce(predicted, group=group)
    sum_exp = logits.exp().sum(dim=-1)
    dist.all_reduce(sum_exp, group=group)
    return sum_exp.log() - predicted


def loss_returns_mean(logits, target, group):
    # The right per-token losses, averaged: one number where the caller expects [s, b].
    import torch.distributed as dist

    part = logits.shape[-1]
    start = dist.get_rank(group) * part
    logits_max = logits.max(dim=-1).values
    dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
    z = logits - logits_max.unsqueeze(-1)
    elsewhere = (target < start) | (target >= start + part)
    local = (target - start).masked_fill(elsewhere, 0)
    predicted = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(elsewhere, 0.0)
    dist.all_reduce(predicted, group=group)
    sum_exp = z.exp().sum(dim=-1)
    dist.all_reduce(sum_exp, group=group)
    return (sum_exp.log() - predicted).mean()


def loss_on_world_group(logits, target, group):
    # The three all-reduces without group=: right when the group is the whole world, wrong inside a larger one.
    import torch.distributed as dist

    part = logits.shape[-1]
    start = dist.get_rank(group) * part
    logits_max = logits.max(dim=-1).values
    dist.all_reduce(logits_max, op=dist.ReduceOp.MAX)
    z = logits - logits_max.unsqueeze(-1)
    elsewhere = (target < start) | (target >= start + part)
    local = (target - start).masked_fill(elsewhere, 0)
    predicted = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(elsewhere, 0.0)
    dist.all_reduce(predicted)
    sum_exp = z.exp().sum(dim=-1)
    dist.all_reduce(sum_exp)
    return sum_exp.log() - predicted


def loss_target_unchecked_index(logits, target, group):
    # target - start used as an index without a mask: outside this rank's block it points outside the shard.
    import torch.distributed as dist

    part = logits.shape[-1]
    start = dist.get_rank(group) * part
    logits_max = logits.max(dim=-1).values
    dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
    z = logits - logits_max.unsqueeze(-1)
    predicted = z.gather(-1, (target - start).unsqueeze(-1)).squeeze(-1)
    dist.all_reduce(predicted, group=group)
    sum_exp = z.exp().sum(dim=-1)
    dist.all_reduce(sum_exp, group=group)
    return sum_exp.log() - predicted

# Marked after their definitions, not with a decorator: an answer travels as its source (to the ranks, and into
# a notebook cell in the browser test), and a decorator line would travel with it.
tries("output")(column_gathers_output)
tries("layouts")(column_f_on_world_group)
tries("layouts")(row_g_on_world_group)
tries("output")(swiglu_up_off_by_one)
tries("non-finite")(column_leaves_a_nan)
tries("non-finite")(row_leaves_a_nan)
tries("non-finite")(swiglu_leaves_a_nan)
tries("non-finite")(loss_without_max)
tries("non-finite")(loss_max_summed)
tries("traffic")(loss_gathers_logits)
tries("mutation")(loss_subtracts_in_place)
tries("output")(loss_returns_mean)
tries("layouts")(loss_on_world_group)


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
    ("vocab_parallel_loss", loss_max_not_reduced, "each rank subtracted its own largest logit"),
    ("vocab_parallel_loss", loss_target_not_masked, "every rank added a logit to the target's"),
    ("vocab_parallel_loss", loss_sum_not_reduced, "over its own"),
    ("vocab_parallel_loss", loss_without_max, "exp() overflowed"),
    ("vocab_parallel_loss", loss_max_summed, "not SUM"),
    ("vocab_parallel_loss", loss_gathers_logits, "the logits (or their exponentials) were gathered"),
    ("vocab_parallel_loss", loss_subtracts_in_place, "caller's logits (or target) changed"),
    ("vocab_parallel_loss", loss_returns_mean, "you returned one number"),
    ("vocab_parallel_loss", loss_on_world_group, "used the default (world) group instead of the group"),
    ("vocab_parallel_loss", loss_target_unchecked_index, "indexing this rank's logits with the target failed"),
]
