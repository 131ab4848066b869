"""The Megatron block on real ranks: one forward/backward against the dense block, or a few training steps.

    torchrun --nproc-per-node 4 workers/ch06_block.py --sequence-parallel true
    torchrun --nproc-per-node 2 workers/ch06_block.py --steps 5

``steps=0``: each rank returns its part of the output, the input gradient and every parameter gradient,
with the collectives it ran (compared with ``dense.reference`` by ``course_utils.tp_check``).
``steps>0``: Adam on a mean squared error for that many steps from the same initial weights; each rank
returns its losses (streamed as metrics too) and its final parameters, to set against the dense block.
"""
from workers.parallel.dense import BlockConfig
from workers.parallel.groups import TensorParallelGroups
from workers.parallel.harness import DTYPES, forward_backward, problem, train_parallel
from workers.runtime import entrypoint
from workers.parallel.grid import choose_divisor


def check_params(world_size, tp_size=0, hidden=32, n_heads=4, n_kv_heads=0, ffn_hidden=0, activation="gelu", seq=8, batch=2,
                 sequence_parallel=False, hidden_dropout=0.0, fault="", dtype="float32", steps=0, lr=1e-3, **_):
    if dtype not in DTYPES:
        return f"dtype={dtype!r} is not supported: choose one of {', '.join(DTYPES)}"
    if steps < 0 or lr <= 0:
        return f"steps={steps} must be >= 0 and lr={lr} positive"
    if tp_size < 0 or (tp_size and world_size % tp_size):
        return f"tp_size={tp_size} does not divide world_size={world_size}: {choose_divisor(world_size)}"
    cfg = BlockConfig(hidden=hidden, n_heads=n_heads, n_kv_heads=n_kv_heads, ffn_hidden=ffn_hidden,
                      activation=activation, hidden_dropout=hidden_dropout)
    return problem("block", cfg, tp_size or world_size, seq, batch, sequence_parallel=sequence_parallel, fault=fault)


def main(ctx, hidden: int = 32, n_heads: int = 4, n_kv_heads: int = 0, ffn_hidden: int = 0, activation: str = "gelu",
         bias: bool = True, seq: int = 8, batch: int = 2, seed: int = 0, sequence_parallel: bool = False,
         hidden_dropout: float = 0.0, fault: str = "", dtype: str = "float32", steps: int = 0, lr: float = 1e-3,
         tp_size: int = 0):
    """One forward/backward of the sharded block (steps=0), or ``steps`` optimizer steps of it.

    ``tp_size`` (0: the whole world): tensor-parallel groups of that size, each running the same block.
    """
    cfg = BlockConfig(hidden=hidden, n_heads=n_heads, n_kv_heads=n_kv_heads, ffn_hidden=ffn_hidden,
                      activation=activation, bias=bias, hidden_dropout=hidden_dropout)
    with TensorParallelGroups(tp_size) as tp:
        if steps:
            out = train_parallel(cfg, seq=seq, batch=batch, steps=steps, lr=lr, seed=seed, group=tp.group,
                                 device=ctx.device, sequence_parallel=sequence_parallel, fault=fault,
                                 on_step=lambda step, loss: ctx.metric(step=step, loss=loss))
        else:
            out = forward_backward("block", cfg, seq=seq, batch=batch, seed=seed, group=tp.group, device=ctx.device,
                                   dtype=DTYPES[dtype], sequence_parallel=sequence_parallel, fault=fault)
        return {**out, "config": cfg.as_dict(), **tp.describe()}


if __name__ == "__main__":
    entrypoint(main)
