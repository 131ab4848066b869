"""Attention split by heads (GQA included) on real ranks, against the dense module (chapter 05).

    torchrun --nproc-per-node 4 workers/ch05_attention_tp.py --heads 8 --kv-heads 2

Each rank keeps its heads/t query heads and the KV heads they read (split when t divides kv_heads,
replicated when kv_heads divides t), runs forward and backward on the same input, and returns its part
of every tensor and the collectives it ran. ``split="naive"`` cuts the fused [Q; K; V] weight into t
contiguous chunks instead of by heads: the run succeeds and the numbers are wrong, which is the point.
"""
from workers.layout.mesh import Mesh
from workers.model.dense import BlockConfig
from workers.parallel.attention import kv_heads_for_rank
from workers.parallel.harness import DTYPES, forward_backward, problem
from workers.runtime import divides_world, entrypoint, one_of, refusal


def check_params(world_size, tp=0, hidden=32, heads=4, kv_heads=0, seq=8, batch=2, sequence_parallel=False,
                 split="right", fault="", dtype="float32", **_):
    bad = refusal(one_of("dtype", dtype, list(DTYPES)), one_of("split", split, ("right", "naive")),
                  divides_world("tp", tp or world_size, world_size))
    if bad:
        return bad
    tp = tp or world_size  # the rules below are about the tensor-parallel group
    cfg = BlockConfig(hidden=hidden, heads=heads, kv_heads=kv_heads)
    bad = problem("attention", cfg, tp, seq, batch, sequence_parallel=sequence_parallel, fault=fault)
    if bad is None and split == "naive" and ((heads + 2 * cfg.kv_heads) * cfg.head_dim) % tp:
        bad = f"the fused QKV weight's rows do not split into tp={tp} equal chunks: choose another tp"
    if bad is None and split == "naive" and tp > cfg.kv_heads:
        bad = (f"split='naive' is only shown where the shapes happen to fit (tp dividing kv_heads={cfg.kv_heads}); "
               f"with tp={tp} the KV heads are replicated and the naive chunk has the wrong number of rows")
    return bad


def main(ctx, hidden: int = 32, heads: int = 4, kv_heads: int = 0, bias: bool = True, causal: bool = True,
         seq: int = 8, batch: int = 2, seed: int = 0, sequence_parallel: bool = False, split: str = "right",
         fault: str = "", dtype: str = "float32", tp: int = 0):
    """Forward and backward of this rank's heads; its parts of every tensor, and the collectives it ran.

    ``tp``: tensor-parallel groups of that size, each running the same attention; 0 (the default) means one
    group, the whole world. ``kv_heads`` 0 means as many as ``heads`` (multi-head attention).
    Returns, besides the tensors, ``query_heads`` and ``kv_head_ids``: the heads this rank holds.
    """
    cfg = BlockConfig(hidden=hidden, heads=heads, kv_heads=kv_heads, bias=bias, causal=causal)
    with Mesh.for_world(("tp",), tp=tp or ctx.world_size) as mesh:
        out = forward_backward("attention", cfg, seq=seq, batch=batch, seed=seed, group=mesh.group("tp"),
                               device=ctx.device, dtype=DTYPES[dtype], sequence_parallel=sequence_parallel,
                               split=split, fault=fault)
        t, rank = mesh.size("tp"), mesh.rank_in("tp")
        query_heads = list(range(rank * heads // t, (rank + 1) * heads // t))
        return {**out, "config": cfg.as_dict(), "query_heads": query_heads, **mesh.describe("tp"),
                "kv_head_ids": kv_heads_for_rank(heads, cfg.kv_heads, t, rank)}


if __name__ == "__main__":
    entrypoint(main)
