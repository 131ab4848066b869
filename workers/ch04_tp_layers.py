"""Column-parallel, row-parallel and the Megatron MLP on real ranks, against the dense module (chapter 04).

    torchrun --nproc-per-node 4 workers/ch04_tp_layers.py --module mlp --hidden 16

Every rank builds the same dense module from ``seed``, keeps its shard (``from_dense``), runs forward and
backward on its part of the same input, and returns its part of the output and input gradient, every
parameter gradient with the indices of the dense entries it holds, and the collectives it ran.
``course_utils.tp_check.compare`` rebuilds the full tensors and compares them with the dense module.
``fault`` injects one broken collective (``workers/parallel/faults.py``) to show that the check catches it.
"""
from workers.layout.mesh import Mesh
from workers.model.dense import BlockConfig
from workers.parallel.harness import DTYPES, forward_backward, problem
from workers.runtime import divides_world, entrypoint, one_of, refusal


def check_params(world_size, tp=0, module="mlp", hidden=16, ffn=0, activation="gelu", seq=4, batch=2,
                 gather_output=False, input_is_parallel=True, fault="", dtype="float32", split="right", **_):
    bad = refusal(one_of("dtype", dtype, list(DTYPES)), one_of("split", split, ("right", "naive")),
                  one_of("module", module, ("column", "row", "mlp")),  # chapter 04's modules
                  divides_world("tp", tp or world_size, world_size))
    if bad:
        return bad
    cfg = BlockConfig(hidden=hidden, heads=1, ffn=ffn, activation=activation)
    return problem(module, cfg, tp or world_size, seq, batch, gather_output=gather_output,
                   input_is_parallel=input_is_parallel, fault=fault)


def main(ctx, module: str = "mlp", hidden: int = 16, ffn: int = 0, activation: str = "gelu",
         bias: bool = True, seq: int = 4, batch: int = 2, seed: int = 0, gather_output: bool = False,
         input_is_parallel: bool = True, split: str = "right", fault: str = "", dtype: str = "float32",
         tp: int = 0):
    """Forward and backward of one sharded module; its parts of every tensor, and the collectives it ran.

    ``tp`` splits the world into tensor-parallel groups of that size, each running the same module
    independently: TP 1, 2 and 4 on one set of 4 ranks. ``tp`` 0 (the default) means one group, the whole
    world; ``ffn`` 0 means 4 x hidden.
    """
    cfg = BlockConfig(hidden=hidden, heads=1, ffn=ffn, activation=activation, bias=bias)
    with Mesh.for_world(("tp",), tp=tp or ctx.world_size) as mesh:
        out = forward_backward(module, cfg, seq=seq, batch=batch, seed=seed, group=mesh.group("tp"),
                               device=ctx.device, dtype=DTYPES[dtype], gather_output=gather_output,
                               input_is_parallel=input_is_parallel, split=split, fault=fault)
        return {**out, "config": cfg.as_dict(), **mesh.describe("tp")}


if __name__ == "__main__":
    entrypoint(main)
