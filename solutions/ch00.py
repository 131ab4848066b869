"""Reference answers for chapter 00's exercises (self-contained functions with the notebook's names)."""


def layout_70b():
    """Llama 3 70B on 256 H100s (32 nodes of 8): TP fills a node over NVLink, 4 pipeline stages, 8 replicas."""
    return dict(tp=8, pp=4, dp=8, zero=1)


def min_gpus_fsdp(n_params, gpu_memory_bytes, reserved_bytes=0.0):
    """Smallest N with 16 * n_params / N <= gpu_memory_bytes - reserved_bytes (ZeRO-3 shards all 16 bytes)."""
    import math

    return max(1, math.ceil(16 * n_params / (gpu_memory_bytes - reserved_bytes)))


def max_tp(heads, kv_heads, gpus_per_node=8):
    """The largest TP degree that gives every GPU whole query heads and whole KV heads, inside one node."""
    import math

    return math.gcd(heads, kv_heads, gpus_per_node)


def zero_total_bytes(n_params, n_gpus, stage):
    """Bytes of model states per GPU, mixed-precision Adam (2 + 2 + 12 bytes per parameter), ZeRO stage 0-3."""
    params = 2 * n_params / (n_gpus if stage >= 3 else 1)
    grads = 2 * n_params / (n_gpus if stage >= 2 else 1)
    optimizer = 12 * n_params / (n_gpus if stage >= 1 else 1)
    return params + grads + optimizer
