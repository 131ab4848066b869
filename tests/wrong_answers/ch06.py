"""Plausible wrong answers for chapter 06, each with a fragment of the message the check must give."""
from tests.wrong_answers import tries


def block_without_f(x, parts, group):
    # The forward all-reduces are there; the backward ones are not: LayerNorm and input gradients are partial.
    from workers.parallel.mappings import reduce_from_tensor_model_parallel_region as g

    h = x + g(parts.attention_partial(parts.ln1(x)), group) + parts.attention_bias
    return h + g(parts.mlp_partial(parts.ln2(h)), group) + parts.mlp_bias


def block_bias_inside_g(x, parts, group):
    from workers.parallel.mappings import (copy_to_tensor_model_parallel_region as f,
                                           reduce_from_tensor_model_parallel_region as g)

    h = x + g(parts.attention_partial(f(parts.ln1(x), group)) + parts.attention_bias, group)
    return h + g(parts.mlp_partial(f(parts.ln2(h), group)) + parts.mlp_bias, group)


def block_one_all_reduce(x, parts, group):
    # Sums once, at the end: the second LayerNorm then normalises a partial sum.
    from workers.parallel.mappings import (copy_to_tensor_model_parallel_region as f,
                                           reduce_from_tensor_model_parallel_region as g)

    h = x + parts.attention_partial(f(parts.ln1(x), group)) + parts.attention_bias
    return g(h + parts.mlp_partial(f(parts.ln2(h), group)), group) + parts.mlp_bias


def block_three_all_reduces(x, parts, group):
    # An extra g on the residual stream, which is already replicated.
    from workers.parallel.mappings import (copy_to_tensor_model_parallel_region as f,
                                           reduce_from_tensor_model_parallel_region as g)

    h = x + g(parts.attention_partial(f(parts.ln1(x), group)), group) + parts.attention_bias
    h = g(h, group)
    return h + g(parts.mlp_partial(f(parts.ln2(h), group)), group) + parts.mlp_bias


def block_biases_on_rank_zero(x, parts, group):
    # Bias inside g, but on rank 0 only: the output is right everywhere; the other ranks' bias copies get no
    # gradient.
    import torch.distributed as dist

    from workers.parallel.mappings import (copy_to_tensor_model_parallel_region as f,
                                           reduce_from_tensor_model_parallel_region as g)

    first = dist.get_rank(group) == 0
    a = parts.attention_partial(f(parts.ln1(x), group))
    h = x + g(a + parts.attention_bias if first else a, group)
    m = parts.mlp_partial(f(parts.ln2(h), group))
    return h + g(m + parts.mlp_bias if first else m, group)


def block_detached_off_rank_zero(x, parts, group):
    # "Only rank 0 needs the output": the others detach it, so they would skip the backward and its f
    # all-reduces, which rank 0 then waits for. The check must say so, not hang.
    import torch.distributed as dist

    from workers.parallel.mappings import (copy_to_tensor_model_parallel_region as f,
                                           reduce_from_tensor_model_parallel_region as g)

    h = x + g(parts.attention_partial(f(parts.ln1(x), group)), group) + parts.attention_bias
    y = h + g(parts.mlp_partial(f(parts.ln2(h), group)), group) + parts.mlp_bias
    return y if dist.get_rank(group) == 0 else y.detach()


def share_without_s_squared(seq, hidden):
    return 8 * hidden / (24 * hidden)


def share_only_scores(seq, hidden):
    return 4 * seq / (24 * hidden + 4 * seq)


def block_g_without_group(x, parts, group):
    # g called without its group: right when the group is the whole world, wrong inside a TP group of a larger world.
    from workers.parallel.mappings import (copy_to_tensor_model_parallel_region as f,
                                           reduce_from_tensor_model_parallel_region as g)

    h = x + g(parts.attention_partial(f(parts.ln1(x), group))) + parts.attention_bias
    return h + g(parts.mlp_partial(f(parts.ln2(h), group))) + parts.mlp_bias


def block_f_without_group(x, parts, group):
    # f called without its group: the forward is right everywhere (f is the identity); the backward all-reduces
    # the LayerNorm outputs' gradients over the whole world, mixing in the other group's gradients.
    from workers.parallel.mappings import (copy_to_tensor_model_parallel_region as f,
                                           reduce_from_tensor_model_parallel_region as g)

    h = x + g(parts.attention_partial(f(parts.ln1(x))), group) + parts.attention_bias
    return h + g(parts.mlp_partial(f(parts.ln2(h))), group) + parts.mlp_bias


def block_nan_in_output(x, parts, group):
    # The right block with one output entry NaN (what a 0 / 0 in a hand-made normalisation leaves behind).
    from workers.parallel.mappings import (copy_to_tensor_model_parallel_region as f,
                                           reduce_from_tensor_model_parallel_region as g)

    h = x + g(parts.attention_partial(f(parts.ln1(x), group)), group) + parts.attention_bias
    y = h + g(parts.mlp_partial(f(parts.ln2(h), group)), group) + parts.mlp_bias
    y = y.clone()
    y[0, 0, 0] = float("nan")
    return y


def block_averages_the_residual(x, parts, group):
    # "Keep the residual in sync": an all-reduce of the replicated stream, divided back by the group size. The
    # forward values are right; the all-reduce is one too many.
    import torch.distributed as dist

    from workers.parallel.mappings import (copy_to_tensor_model_parallel_region as f,
                                           reduce_from_tensor_model_parallel_region as g)

    h = x + g(parts.attention_partial(f(parts.ln1(x), group)), group) + parts.attention_bias
    h = g(h, group) / dist.get_world_size(group)
    return h + g(parts.mlp_partial(f(parts.ln2(h), group)), group) + parts.mlp_bias


def share_nan_at_long_sequences(seq, hidden):
    # Right below s = 8192; NaN beyond (what an overflowed intermediate in a narrower type gives).
    if seq > 8192:
        return float("nan")
    return (8 * hidden + 4 * seq) / (24 * hidden + 4 * seq)


def share_s_and_h_swapped(seq, hidden):
    return (8 * seq + 4 * hidden) / (24 * seq + 4 * hidden)


def blocks_ring_turned_left(rank, tp, step):
    # Shards taken from the right neighbour: the same as the course's ring at tp 2, where both neighbours are one rank.
    return (rank + step) % tp, (rank + step + 1) % tp


def blocks_bit_mask_wrap(rank, tp, step):
    # "mod tp" written as a bit mask: right for tp 1, 2, 4, 8; wrong for tp 3.
    return (rank - step) & (tp - 1), (rank - step - 1) & (tp - 1)


def blocks_nothing_sent_last(rank, tp, step):
    # "Which block does it send": at the last step nothing is sent, so nothing is returned; that step still computes
    # the rank's own block.
    return (rank - step) % tp, (rank - step - 1) % tp if step < tp - 1 else None


def blocks_scatter_like_gather(rank, tp, step):
    # The reduce-scatter ring given the all-gather ring's order: it then starts on its own block and never ends on it.
    return (rank - step) % tp, (rank - step) % tp


def blocks_every_rank_in_order(rank, tp, step):
    # Every rank multiplies shard 0, then 1, ...: at step 0 two ranks would need the same shard, which only one holds.
    return step, (rank - step - 1) % tp


def blocks_no_wrap(rank, tp, step):
    # The right formulas without the wrap-around: rank -1 does not exist.
    return rank - step, rank - step - 1


# Marked after their definitions, not with a decorator: an answer travels as its source (to the ranks, and into
# a notebook cell in the browser test), and a decorator line would travel with it.
tries("non-finite")(block_nan_in_output)
tries("traffic")(block_averages_the_residual)
tries("layouts")(block_g_without_group)
tries("output")(block_detached_off_rank_zero)
tries("non-finite")(share_nan_at_long_sequences)
tries("layouts")(share_s_and_h_swapped)
tries("layouts")(blocks_ring_turned_left)
tries("sizes")(blocks_bit_mask_wrap)
tries("output")(blocks_nothing_sent_last)

WRONG = [
    ("block_forward", block_without_f, "Pass the LayerNorm outputs through f"),
    ("block_forward", block_bias_inside_g, "holds each bias"),
    ("block_forward", block_one_all_reduce, "summed over ranks with g before it joins the residual stream"),
    ("block_forward", block_three_all_reduces, "needs exactly two"),
    ("block_forward", block_biases_on_rank_zero, "each copy must get the full gradient"),
    ("block_forward", block_detached_off_rank_zero, "not requiring grad"),
    ("block_forward", block_g_without_group, "used the default (world) group instead of the group it was given"),
    ("block_forward", block_f_without_group, "in the backward pass, copy_to_tensor_model_parallel_region ran over 4"),
    ("attention_flop_share", share_without_s_squared, "does not change with s"),
    ("attention_flop_share", share_only_scores, "only the s² part"),
    ("attention_flop_share", share_nan_at_long_sequences, "The share is NaN or infinite"),
    ("attention_flop_share", share_s_and_h_swapped, "s and h swapped"),
    ("block_forward", block_nan_in_output, "NaN or infinite value(s)"),
    ("block_forward", block_averages_the_residual, "your forward ran 3 all-reduces"),
    ("collective_matmul_blocks", blocks_ring_turned_left, "Your shards travel to the left"),
    ("collective_matmul_blocks", blocks_bit_mask_wrap, "wraps around only when tp is a power of two"),
    ("collective_matmul_blocks", blocks_nothing_sent_last, "At the last step nothing is sent"),
    ("collective_matmul_blocks", blocks_scatter_like_gather, "That is the all-gather ring's order"),
    ("collective_matmul_blocks", blocks_every_rank_in_order, "At step 0 each rank multiplies its own shard"),
    ("collective_matmul_blocks", blocks_no_wrap, "wrap around the ring with % tp"),
]
