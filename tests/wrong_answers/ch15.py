"""Plausible wrong answers for chapter 15, each with a fragment of the message the check must give.

Answers are marked with ``tries(...)(answer)`` after their definition, never with a decorator: an answer travels as
its source (to the ranks, and into a notebook cell in the browser test), and a decorator line would travel with it."""
from tests.wrong_answers import tries


def mesh_groups_tp_outermost(dp, pp, cp, tp, dim):
    sizes = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
    order = ("tp", "cp", "pp", "dp")  # reversed: tp outermost
    stride = 1
    for d in reversed(order[order.index(dim) + 1:]):
        stride *= sizes[d]
    n, world = sizes[dim], dp * pp * cp * tp
    return [[s + i * stride for i in range(n)] for s in range(world) if (s // stride) % n == 0]


def mesh_groups_consecutive(dp, pp, cp, tp, dim):
    n = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}[dim]
    return [list(range(s, s + n)) for s in range(0, dp * pp * cp * tp, n)]  # right for tp only


def mesh_groups_stride_by_own_size(dp, pp, cp, tp, dim):
    n, world = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}[dim], dp * pp * cp * tp
    if n == 1:
        return [[r] for r in range(world)]
    return [[s + i * n for i in range(n)] for s in range(world) if (s // n) % n == 0]  # stride n, not inner product


def mesh_groups_cp_outside_pp(dp, pp, cp, tp, dim):
    sizes = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
    order = ("dp", "cp", "pp", "tp")  # cp and pp swapped: the same grid while either is 1
    stride = 1
    for d in reversed(order[order.index(dim) + 1:]):
        stride *= sizes[d]
    n, world = sizes[dim], dp * pp * cp * tp
    return [[s + i * stride for i in range(n)] for s in range(world) if (s // stride) % n == 0]


def mesh_groups_none_for_size_one(dp, pp, cp, tp, dim):
    from solutions.ch15 import mesh_groups

    n = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}[dim]
    return [] if n == 1 else mesh_groups(dp, pp, cp, tp, dim)  # "nothing to group along a dimension of size 1"


def mesh_groups_nan_rank(dp, pp, cp, tp, dim):
    from solutions.ch15 import mesh_groups

    groups = mesh_groups(dp, pp, cp, tp, dim)
    groups[-1][-1] = float("nan")  # one rank NaN
    return groups


def mesh_groups_only_mine(dp, pp, cp, tp, dim):
    sizes = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
    order = ("dp", "pp", "cp", "tp")
    stride = 1
    for d in reversed(order[order.index(dim) + 1:]):
        stride *= sizes[d]
    return [[i * stride for i in range(sizes[dim])]]  # rank 0's group only


def micro_batch_loss_per_micro_mean(summed_ce, micro_tokens, global_tokens, micro_batches, dp, cp):
    return summed_ce / micro_tokens / micro_batches / dp  # right only when every micro-batch has as many tokens


def micro_batch_loss_own_tokens(summed_ce, micro_tokens, global_tokens, micro_batches, dp, cp):
    return summed_ce / micro_tokens


def micro_batch_loss_divided_by_dp(summed_ce, micro_tokens, global_tokens, micro_batches, dp, cp):
    return summed_ce / global_tokens / dp  # as if the all-reduce averaged


def micro_batch_loss_item(summed_ce, micro_tokens, global_tokens, micro_batches, dp, cp):
    return summed_ce.item() / global_tokens  # the right number, as a Python float: nothing to backpropagate


def micro_batch_loss_fresh_tensor(summed_ce, micro_tokens, global_tokens, micro_batches, dp, cp):
    import torch

    # the right number in a new tensor that asks for a gradient: cut off from the model's graph
    return torch.tensor(summed_ce.item() / global_tokens, dtype=summed_ce.dtype, requires_grad=True)


def micro_batch_loss_float32(summed_ce, micro_tokens, global_tokens, micro_batches, dp, cp):
    return (summed_ce / global_tokens).float()  # "losses are float32": rounds a float64 run's loss


def micro_batch_loss_mean_times_share(summed_ce, micro_tokens, global_tokens, micro_batches, dp, cp):
    # the micro-batch's mean, weighted by its share of the tokens: the global mean, except 0/0 for an empty one
    return summed_ce / micro_tokens * (micro_tokens / global_tokens)


def micro_batch_loss_dp_over_m(summed_ce, micro_tokens, global_tokens, micro_batches, dp, cp):
    # "the all-reduce averages over dp, accumulation sums over m": undone by x dp / m, which is 1 where dp = m
    return summed_ce / global_tokens * dp / micro_batches


def _layout(dp, tp, pp, cp, zero=0, m=2):
    return {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "zero": zero, "micro_batches": m, "sequence_parallel": False}


def layout_and_traffic_pure_dp():
    return _layout(8, 1, 1, 1, 1, 1), {"tp": 0, "cp": 0, "pp": 0, "dp": 0}  # ZeRO-1 still keeps 943 kB per rank


def layout_and_traffic_refused():
    return _layout(2, 4, 1, 1, 0, 3), {"tp": 0, "cp": 0, "pp": 0, "dp": 0}  # 3 micro-batches do not divide 8 / 2


def layout_and_traffic_planner_dp():
    from solutions.ch15 import layout_and_traffic

    layout, predicted = layout_and_traffic()
    stage_params = 2 * (2 * 32 * 32 + 2 * 32 * 32 + 2 * 32 * 128 + 2 * 32) + 32 * 32  # weights only, as the planner
    return layout, {**predicted, "dp": 2 * 1 / 2 * stage_params / 2 * 8}


def layout_and_traffic_pp_both_ways():
    from solutions.ch15 import layout_and_traffic

    layout, predicted = layout_and_traffic()
    return layout, {**predicted, "pp": 2 * predicted["pp"]}  # a send each way, as a middle stage does


def layout_and_traffic_nan_prediction():
    from solutions.ch15 import layout_and_traffic

    layout, predicted = layout_and_traffic()
    return layout, {**predicted, "cp": float("nan")}  # "no ring: not a number"


# Marked after their definitions, not with a decorator: an answer travels as its source (to the ranks, and into
# a notebook cell in the browser test), and a decorator line would travel with it.
tries("output")(micro_batch_loss_float32)
tries("non-finite", "ragged")(micro_batch_loss_mean_times_share)
tries("layouts")(micro_batch_loss_dp_over_m)
tries("layouts")(mesh_groups_cp_outside_pp)
tries("ragged")(mesh_groups_none_for_size_one)
tries("non-finite")(mesh_groups_nan_rank)
tries("output")(mesh_groups_only_mine)
tries("sizes")(layout_and_traffic_refused)
tries("traffic")(layout_and_traffic_pp_both_ways)
tries("non-finite")(layout_and_traffic_nan_prediction)


WRONG = [
    ("mesh_groups", mesh_groups_tp_outermost, "with tp outermost"),
    ("mesh_groups", mesh_groups_consecutive, "innermost dimension only"),
    ("mesh_groups", mesh_groups_stride_by_own_size, "the product of the sizes"),
    ("mesh_groups", mesh_groups_only_mine, "you returned one group"),
    ("mesh_groups", mesh_groups_cp_outside_pp, "you ordered the grid dp, cp, pp, tp"),
    ("mesh_groups", mesh_groups_none_for_size_one, "every rank is a group of its own"),
    ("mesh_groups", mesh_groups_nan_rank, "a rank is nan"),
    ("micro_batch_loss", micro_batch_loss_per_micro_mean, "averaged over its own tokens"),
    ("micro_batch_loss", micro_batch_loss_own_tokens, "this micro-batch's tokens"),
    ("micro_batch_loss", micro_batch_loss_divided_by_dp, "divided once more by dp"),
    ("micro_batch_loss", micro_batch_loss_item, "return a tensor computed from summed_ce"),
    ("micro_batch_loss", micro_batch_loss_fresh_tensor, "not connected to the model's graph"),
    ("micro_batch_loss", micro_batch_loss_float32, "a float32 loss rounds away"),
    ("micro_batch_loss", micro_batch_loss_mean_times_share, "a micro-batch without a valid token"),
    ("micro_batch_loss", micro_batch_loss_dp_over_m, "scales the loss by dp / micro_batches"),
    ("layout_and_traffic", layout_and_traffic_pure_dp, "does not fit"),
    ("layout_and_traffic", layout_and_traffic_refused, "is refused before launch"),
    ("layout_and_traffic", layout_and_traffic_planner_dp, "That is the planner's figure"),
    ("layout_and_traffic", layout_and_traffic_pp_both_ways, "sends nothing backward"),
    ("layout_and_traffic", layout_and_traffic_nan_prediction, "your prediction along cp is nan"),
]
