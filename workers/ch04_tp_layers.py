"""Column-parallel, row-parallel and the Megatron MLP on real ranks, against the dense module (chapter 04).

    torchrun --nproc-per-node 4 workers/ch04_tp_layers.py --module mlp --hidden 16

Every rank builds the same dense module from ``seed``, keeps its shard (``from_dense``), runs forward and
backward on its part of the same input, and returns its part of the output and input gradient, every
parameter gradient with the indices of the dense entries it holds, and the collectives it ran.
``course_utils.tp_check.compare`` rebuilds the full tensors and compares them with the dense module.
``fault`` injects one broken collective (``workers/parallel/faults.py``) to show that the check catches it.
"""
from workers.parallel.dense import BlockConfig
from workers.parallel.groups import TensorParallelGroups
from workers.parallel.harness import DTYPES, forward_backward, problem
from workers.runtime import entrypoint
from workers.parallel.grid import choose_divisor


def check_params(world_size, tp_size=0, module="mlp", hidden=16, ffn_hidden=0, activation="gelu", seq=4, batch=2,
                 gather_output=False, input_is_parallel=True, fault="", dtype="float32", split="right", **_):
    if dtype not in DTYPES:
        return f"dtype={dtype!r} is not supported: choose one of {', '.join(DTYPES)}"
    if split not in ("right", "naive"):
        return f"split={split!r} must be 'right' or 'naive'"
    if tp_size < 0 or (tp_size and world_size % tp_size):
        return f"tp_size={tp_size} does not divide world_size={world_size}: {choose_divisor(world_size)}"
    if module not in ("column", "row", "mlp"):
        return f"module={module!r} is not a chapter 04 module: choose 'column', 'row' or 'mlp'"
    cfg = BlockConfig(hidden=hidden, n_heads=1, ffn_hidden=ffn_hidden, activation=activation)
    return problem(module, cfg, tp_size or world_size, seq, batch, gather_output=gather_output,
                   input_is_parallel=input_is_parallel, fault=fault)


def main(ctx, module: str = "mlp", hidden: int = 16, ffn_hidden: int = 0, activation: str = "gelu",
         bias: bool = True, seq: int = 4, batch: int = 2, seed: int = 0, gather_output: bool = False,
         input_is_parallel: bool = True, split: str = "right", fault: str = "", dtype: str = "float32",
         tp_size: int = 0):
    """Forward and backward of one sharded module; its parts of every tensor, and the collectives it ran.

    ``tp_size`` (0: the whole world) splits the world into tensor-parallel groups of that size, each
    running the same module independently: TP 1, 2 and 4 on one set of 4 ranks.
    """
    cfg = BlockConfig(hidden=hidden, n_heads=1, ffn_hidden=ffn_hidden, activation=activation, bias=bias)
    with TensorParallelGroups(tp_size) as tp:
        out = forward_backward(module, cfg, seq=seq, batch=batch, seed=seed, group=tp.group, device=ctx.device,
                               dtype=DTYPES[dtype], gather_output=gather_output, input_is_parallel=input_is_parallel,
                               split=split, fault=fault)
        return {**out, "config": cfg.as_dict(), **tp.describe()}


if __name__ == "__main__":
    entrypoint(main)
