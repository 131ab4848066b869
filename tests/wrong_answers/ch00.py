"""Plausible wrong answers for chapter 00, each with a fragment of the message the check must give."""
from tests.wrong_answers import tries


def layout_70b_pure_dp():
    return dict(tp=1, pp=1, dp=256, zero=1)  # 70B of weights and gradients on every GPU


def layout_70b_tp16():
    return dict(tp=16, pp=2, dp=8, zero=1)  # valid (KV heads copied), but TP over two nodes


def layout_70b_product_wrong():
    return dict(tp=8, pp=4, dp=4, zero=1)  # 128 GPUs' worth of layout on 256 GPUs


def layout_70b_pp_not_dividing_layers():
    return dict(tp=8, pp=32, dp=1, zero=1)  # fits, but 80 layers do not split into 32 equal stages


def min_gpus_weights_only(n_params, gpu_memory_bytes, reserved_bytes=0.0):
    import math

    return max(1, math.ceil(2 * n_params / (gpu_memory_bytes - reserved_bytes)))


def min_gpus_floor(n_params, gpu_memory_bytes, reserved_bytes=0.0):
    return max(1, int(16 * n_params / (gpu_memory_bytes - reserved_bytes)))


def min_gpus_int_plus_one(n_params, gpu_memory_bytes, reserved_bytes=0.0):
    return int(16 * n_params / (gpu_memory_bytes - reserved_bytes)) + 1


def min_gpus_ignores_reserved(n_params, gpu_memory_bytes, reserved_bytes=0.0):
    import math

    return max(1, math.ceil(16 * n_params / gpu_memory_bytes))


def min_gpus_round_to_nearest(n_params, gpu_memory_bytes, reserved_bytes=0.0):
    return max(1, round(16 * n_params / (gpu_memory_bytes - reserved_bytes)))  # 13.15 GPUs -> 13


def max_tp_halving_from_node(heads, kv_heads, gpus_per_node=8):
    tp = gpus_per_node  # derived from the node size: only powers of two below a node of 72 are tried
    while heads % tp or kv_heads % tp:
        tp //= 2
    return tp


def max_tp_min_of_kv_and_node(heads, kv_heads, gpus_per_node=8):
    return min(kv_heads, gpus_per_node)


def max_tp_ignores_kv_heads(heads, kv_heads, gpus_per_node=8):
    import math

    return math.gcd(heads, gpus_per_node)


def max_tp_ignores_node(heads, kv_heads, gpus_per_node=8):
    import math

    return math.gcd(heads, kv_heads)


def zero_total_stage2_as_stage1(n_params, n_gpus, stage):
    return (4 + 12 / n_gpus) * n_params if stage in (1, 2) else (16 * n_params / (n_gpus if stage == 3 else 1))


def zero_total_in_gb(n_params, n_gpus, stage):
    params = 2 * n_params / (n_gpus if stage >= 3 else 1)
    grads = 2 * n_params / (n_gpus if stage >= 2 else 1)
    return (params + grads + 12 * n_params / (n_gpus if stage >= 1 else 1)) / 1e9


def layout_70b_dp_by_true_division():
    tp, pp = 8, 4
    return dict(tp=tp, pp=pp, dp=256 / (tp * pp), zero=1)  # the right layout, but dp = 8.0, a float


def layout_70b_nan_degree():
    return dict(tp=8, pp=4, dp=float("nan"), zero=1)  # a degree left NaN (a 0 / 0 in numpy gives NaN, not an error)


def min_gpus_float_ceiling(n_params, gpu_memory_bytes, reserved_bytes=0.0):
    # Ceiling division by negation: right value, but a float (16 * n_params is a float).
    return max(1, -(-16 * n_params // (gpu_memory_bytes - reserved_bytes)))


def min_gpus_nan_when_reserved(n_params, gpu_memory_bytes, reserved_bytes=0.0):
    import math

    if reserved_bytes:
        return float("nan")  # stands for any slip that leaves a NaN where the reserved memory counts
    return max(1, math.ceil(16 * n_params / gpu_memory_bytes))


def max_tp_true_division(heads, kv_heads, gpus_per_node=8):
    import math

    # The right degree, as the node divided by the number of TP groups it holds: true division gives a float.
    return gpus_per_node / (gpus_per_node // math.gcd(heads, kv_heads, gpus_per_node))


def max_tp_nan(heads, kv_heads, gpus_per_node=8):
    import math

    return float("nan") if gpus_per_node > 8 else math.gcd(heads, kv_heads, gpus_per_node)


def zero_total_nan_for_one_gpu(n_params, n_gpus, stage):
    # The right formula, NaN on a single GPU (what (n_gpus - 1) / (n_gpus - 1) gives in numpy).
    if n_gpus == 1:
        return float("nan")
    params = 2 * n_params / (n_gpus if stage >= 3 else 1)
    grads = 2 * n_params / (n_gpus if stage >= 2 else 1)
    return params + grads + 12 * n_params / (n_gpus if stage >= 1 else 1)

# Marked after their definitions, not with a decorator: an answer travels as its source (to the ranks, and into
# a notebook cell in the browser test), and a decorator line would travel with it.
tries("sizes")(layout_70b_pp_not_dividing_layers)
tries("sizes")(min_gpus_int_plus_one)
tries("layouts")(max_tp_halving_from_node)
tries("sizes")(max_tp_min_of_kv_and_node)
tries("output")(layout_70b_dp_by_true_division)
tries("non-finite")(layout_70b_nan_degree)
tries("output")(min_gpus_float_ceiling)
tries("non-finite")(min_gpus_nan_when_reserved)
tries("output")(max_tp_true_division)
tries("non-finite")(max_tp_nan)
tries("non-finite")(zero_total_nan_for_one_gpu)


WRONG = [
    ("layout_70b", layout_70b_pure_dp, "does not fit"),
    ("layout_70b", layout_70b_tp16, "spans 2 nodes of 8 GPUs"),
    ("layout_70b", layout_70b_product_wrong, "makes 128 ranks, not the world's 256"),
    ("min_gpus_fsdp", min_gpus_weights_only, "only the 2-byte weights"),
    ("layout_70b", layout_70b_pp_not_dividing_layers, "pp=32 does not divide the 80 layers"),
    ("min_gpus_fsdp", min_gpus_floor, "round up (math.ceil), not down"),
    ("min_gpus_fsdp", min_gpus_round_to_nearest, "not to the nearest (round)"),
    ("min_gpus_fsdp", min_gpus_int_plus_one, "use math.ceil"),
    ("min_gpus_fsdp", min_gpus_ignores_reserved, "gpu_memory_bytes - reserved_bytes"),
    ("max_tp", max_tp_min_of_kv_and_node, "does not divide the 12 query heads"),
    ("max_tp", max_tp_ignores_kv_heads, "key/value heads"),
    ("max_tp", max_tp_halving_from_node, "halving from the node size (72 -> 36 -> 18 -> 9 -> 4)"),
    ("max_tp", max_tp_ignores_node, "does not tile a node of 8 GPUs"),
    ("zero_total_bytes", zero_total_stage2_as_stage1, "that is stage 1's total"),
    ("zero_total_bytes", zero_total_in_gb, "return bytes, not GB"),
    ("zero_total_bytes", zero_total_nan_for_one_gpu, "(NaN or infinite)"),
    ("layout_70b", layout_70b_dp_by_true_division, "dp is 8.0, a float"),
    ("layout_70b", layout_70b_nan_degree, "dp is nan (NaN or infinite)"),
    ("min_gpus_fsdp", min_gpus_float_ceiling, "a float: return an int"),
    ("min_gpus_fsdp", min_gpus_nan_when_reserved, "the GPU count is nan (NaN or infinite)"),
    ("max_tp", max_tp_true_division, "the TP degree is 8.0, a float"),
    ("max_tp", max_tp_nan, "the TP degree is nan (NaN or infinite)"),
]
