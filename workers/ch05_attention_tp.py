"""Attention split by heads (GQA included) on real ranks, against the dense module (chapter 05).

    torchrun --nproc-per-node 4 workers/ch05_attention_tp.py --n-heads 8 --n-kv-heads 2

Each rank keeps its n_heads/t query heads and the KV heads they read (split when t divides n_kv_heads,
replicated when n_kv_heads divides t), runs forward and backward on the same input, and returns its part
of every tensor and the collectives it ran. ``split="naive"`` cuts the fused [Q; K; V] weight into t
contiguous chunks instead of by heads: the run succeeds and the numbers are wrong, which is the point.
"""
from workers.parallel.attention import kv_heads_for_rank
from workers.parallel.dense import BlockConfig
from workers.parallel.groups import TensorParallelGroups
from workers.parallel.harness import DTYPES, forward_backward, problem
from workers.parallel.layers import group_size_rank
from workers.runtime import entrypoint
from workers.parallel.grid import choose_divisor


def check_params(world_size, tp_size=0, hidden=32, n_heads=4, n_kv_heads=0, seq=8, batch=2, sequence_parallel=False,
                 split="right", fault="", dtype="float32", **_):
    if dtype not in DTYPES:
        return f"dtype={dtype!r} is not supported: choose one of {', '.join(DTYPES)}"
    if split not in ("right", "naive"):
        return f"split={split!r} must be 'right' (by heads) or 'naive' (contiguous chunks)"
    if tp_size < 0 or (tp_size and world_size % tp_size):
        return f"tp_size={tp_size} does not divide world_size={world_size}: {choose_divisor(world_size)}"
    world_size = tp_size or world_size  # the rules below are about the tensor-parallel group
    cfg = BlockConfig(hidden=hidden, n_heads=n_heads, n_kv_heads=n_kv_heads)
    bad = problem("attention", cfg, world_size, seq, batch, sequence_parallel=sequence_parallel, fault=fault)
    if bad is None and split == "naive" and ((n_heads + 2 * cfg.kv_heads) * cfg.head_dim) % world_size:
        bad = f"the fused QKV weight's rows do not split into {world_size} equal chunks: choose another world size"
    if bad is None and split == "naive" and world_size > cfg.kv_heads:
        bad = ("split='naive' is only shown where the shapes happen to fit (n_kv_heads divisible by the world "
               "size); with replicated KV heads the naive chunk has the wrong number of rows")
    return bad


def main(ctx, hidden: int = 32, n_heads: int = 4, n_kv_heads: int = 0, bias: bool = True, causal: bool = True,
         seq: int = 8, batch: int = 2, seed: int = 0, sequence_parallel: bool = False, split: str = "right",
         fault: str = "", dtype: str = "float32", tp_size: int = 0):
    """Forward and backward of this rank's heads; its parts of every tensor, and the collectives it ran.

    ``tp_size`` (0: the whole world): tensor-parallel groups of that size, each running the same attention.
    """
    cfg = BlockConfig(hidden=hidden, n_heads=n_heads, n_kv_heads=n_kv_heads, bias=bias, causal=causal)
    with TensorParallelGroups(tp_size) as groups:
        out = forward_backward("attention", cfg, seq=seq, batch=batch, seed=seed, group=groups.group,
                               device=ctx.device, dtype=DTYPES[dtype], sequence_parallel=sequence_parallel,
                               split=split, fault=fault)
        tp, rank = group_size_rank(groups.group)
        heads = list(range(rank * n_heads // tp, (rank + 1) * n_heads // tp))
        return {**out, "config": cfg.as_dict(), "query_heads": heads, **groups.describe(),
                "kv_heads": kv_heads_for_rank(n_heads, cfg.kv_heads, tp, rank)}


if __name__ == "__main__":
    entrypoint(main)
