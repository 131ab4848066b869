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


def layout_and_traffic():
    """2x2x2x1 (dp x tp x pp x cp), ZeRO-0, 2 micro-batches: a stage holds 2 layers' TP halves plus its half of the
    embedding (split by vocabulary) and the positions, 13,920 parameters, 4 x 8 x 13,920 = 445,440 bytes of state
    (< 600 kB). Rank 0 sends, per step:"""
    hidden, seq, vocab, E = 32, 16, 32, 8  # float64
    dp, tp, pp, cp, m = 2, 2, 2, 1, 2
    b = 8 // (dp * m)  # samples per micro-batch
    msg = b * (seq // cp) * hidden * E  # one [s/cp, b, h] activation: 8,192 bytes
    layers = 4 // pp
    tp_bytes = m * layers * 4 * 2 * (tp - 1) / tp * msg  # 4 all-reduces per layer (f and g, forward and backward)
    tp_bytes += m * 2 * (tp - 1) / tp * msg  # and the embedding's: each TP rank looked up its own words' rows
    pp_bytes = m * msg  # the first stage sends each activation forward, the whole tensor from each TP rank
    per_layer = 3 * hidden * hidden // tp + 3 * hidden // tp + hidden * hidden // tp + hidden  # qkv, proj
    per_layer += 4 * hidden * hidden // tp + 4 * hidden // tp + 4 * hidden * hidden // tp + hidden  # fc1, fc2
    per_layer += 4 * hidden  # two LayerNorms, replicated
    params = layers * per_layer + vocab // tp * hidden + seq * hidden  # + its embedding rows and positions (stage 0)
    group = dp * cp
    dp_bytes = 2 * (group - 1) / group * params * E  # ring all-reduce of every gradient over dp x cp
    layout = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "zero": 0, "micro_batches": m, "sequence_parallel": False}
    return layout, {"tp": tp_bytes, "cp": 0.0, "pp": pp_bytes, "dp": dp_bytes}
