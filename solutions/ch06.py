"""Reference answers for chapter 06's exercises (each self-contained: it travels to the ranks as source)."""


def block_forward(x, parts, group):
    """Pre-LN block: f before each sub-layer's partial computation, g after it, then the bias, then the residual."""
    from workers.parallel.mappings import (copy_to_tensor_model_parallel_region as f,
                                           reduce_from_tensor_model_parallel_region as g)

    h = x + g(parts.attention_partial(f(parts.ln1(x), group)), group) + parts.attention_bias
    return h + g(parts.mlp_partial(f(parts.ln2(h), group)), group) + parts.mlp_bias


def attention_flop_share(seq, hidden):
    """(8bsh^2 + 4bs^2h) / (24bsh^2 + 4bs^2h): QKV 6bsh^2 + scores 2bs^2h + P.V 2bs^2h + output 2bsh^2, MLP 16bsh^2."""
    return (8 * hidden + 4 * seq) / (24 * hidden + 4 * seq)


def collective_matmul_blocks(rank, tp, step):
    """The ring sends to rank + 1 and receives from rank - 1. All-gather ring: at step k rank r holds (and multiplies)
    the shard of rank r - k, passed one hop per step. Reduce-scatter ring: at step k rank r adds its addend to block
    r - k - 1 and sends the running sum on; the last step (k = tp - 1) completes its own block, which it keeps."""
    return (rank - step) % tp, (rank - step - 1) % tp
