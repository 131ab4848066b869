"""Reference answers for chapter 15's exercises (each self-contained: it may travel as source)."""


def mesh_groups(dp, pp, cp, tp, dim):
    """Every group along ``dim`` of ``arange(dp*pp*cp*tp).view(dp, pp, cp, tp)``: ranks that differ only along it."""
    sizes = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
    order = ("dp", "pp", "cp", "tp")  # outermost first: tp innermost
    stride = 1
    for d in reversed(order[order.index(dim) + 1:]):
        stride *= sizes[d]  # a step along dim skips every combination of the dimensions inside it
    n, world = sizes[dim], dp * pp * cp * tp
    starts = [r for r in range(world) if (r // stride) % n == 0]  # coordinate 0 along dim
    return [[s + i * stride for i in range(n)] for s in starts]


def micro_batch_loss(summed_ce, micro_tokens, global_tokens, micro_batches, dp, cp):
    """This micro-batch's share of the global mean: its tokens' summed loss over the global batch's token count.
    Summed over micro-batches (accumulation) and over dp x cp (the gradient all-reduce sums) it is the mean."""
    return summed_ce / global_tokens
