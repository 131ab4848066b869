"""The Megatron block on real ranks: one forward/backward against the dense block, or the course's GPT trained.

    torchrun --nproc-per-node 4 workers/ch06_block.py --sequence-parallel true
    torchrun --nproc-per-node 2 workers/ch06_block.py --steps 5

``steps=0``: each rank returns its part of the output, the input gradient and every parameter gradient,
with the collectives it ran (compared with ``dense.reference`` by ``course_utils.tp_check``).
``steps>0``: the course's GPT (``workers/model/gpt.py``; two layers of this block's shape, a tied LM head) cut for
tensor (and sequence) parallelism by ``ParallelGPT``, trained for that many Adam steps on a fixed ragged batch of
random tokens (cross-entropy over the valid next tokens, ``harness.train_parallel``); each rank returns its losses
(streamed as metrics too) and its final parameter shards, to set against the same GPT trained in one process.
"""
from workers.layout.mesh import Mesh
from workers.model.dense import BlockConfig
from workers.parallel.harness import DTYPES, forward_backward, problem, train_parallel
from workers.runtime import at_least, divides_world, entrypoint, one_of, refusal


def check_params(world_size, tp=0, hidden=32, heads=4, kv_heads=0, ffn=0, activation="gelu", seq=8, batch=2,
                 sequence_parallel=False, hidden_dropout=0.0, fault="", dtype="float32", steps=0, lr=1e-3, **_):
    bad = refusal(one_of("dtype", dtype, list(DTYPES)), at_least("steps", steps, 0),
                  None if isinstance(lr, (int, float)) and lr > 0 else f"lr={lr!r} must be positive",
                  divides_world("tp", tp or world_size, world_size))
    if bad:
        return bad
    cfg = BlockConfig(hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, activation=activation,
                      hidden_dropout=hidden_dropout)
    return problem("block", cfg, tp or world_size, seq, batch, sequence_parallel=sequence_parallel, fault=fault)


def main(ctx, hidden: int = 32, heads: int = 4, kv_heads: int = 0, ffn: int = 0, activation: str = "gelu",
         bias: bool = True, seq: int = 8, batch: int = 2, seed: int = 0, sequence_parallel: bool = False,
         hidden_dropout: float = 0.0, fault: str = "", dtype: str = "float32", steps: int = 0, lr: float = 1e-3,
         tp: int = 0):
    """One forward/backward of the sharded block (steps=0), or ``steps`` optimizer steps of the GPT made of it.

    ``tp``: tensor-parallel groups of that size, each running the same block (or GPT); 0 (the default) means one
    group, the whole world. ``kv_heads`` 0 means as many as ``heads``, ``ffn`` 0 means 4 x hidden.
    """
    cfg = BlockConfig(hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, activation=activation, bias=bias,
                      hidden_dropout=hidden_dropout)
    with Mesh.for_world(("tp",), tp=tp or ctx.world_size) as mesh:
        if steps:
            out = train_parallel(cfg, seq=seq, batch=batch, steps=steps, lr=lr, seed=seed, group=mesh.group("tp"),
                                 device=ctx.device, dtype=DTYPES[dtype], sequence_parallel=sequence_parallel,
                                 fault=fault, on_step=lambda step, loss: ctx.metric(step=step, loss=loss))
        else:
            out = forward_backward("block", cfg, seq=seq, batch=batch, seed=seed, group=mesh.group("tp"),
                                   device=ctx.device, dtype=DTYPES[dtype], sequence_parallel=sequence_parallel,
                                   fault=fault)
        return {**out, "config": cfg.as_dict(), **mesh.describe("tp")}


if __name__ == "__main__":
    entrypoint(main)
