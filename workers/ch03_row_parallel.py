"""Row-parallel gradient synchronisation, on real ranks, with every collective logged.

    torchrun --nproc-per-node 2 workers/ch03_row_parallel.py --mode row --input-is-parallel true

``mode="row"``: a row-parallel linear Y = X W + b (W stored [in, out], split by rows, as in the chapter):

    X_r = X[:, block r]  (given, input_is_parallel=True)  or  scatter(X)  (X replicated)
    Y   = g(X_r W_r) + b                       bias added once, after the reduce

``mode="mlp"``: Megatron's MLP, Y = g(GeLU(f(X) A_r) B_r) + b, A split by columns and B by rows.

Every rank returns its output, the gradients of everything it holds, and the log of collectives with
the pass (forward / backward) each ran in; the notebook compares them with ``reference.linear_reference``
and ``reference.mlp_reference``.
"""
import torch

from workers.layout.mesh import Mesh
from workers.parallel import mappings as M
from workers.parallel.problems import row_parallel_problem
from workers.runtime import divides, divides_world, entrypoint, one_of, refusal

MODES = ("row", "mlp")


def check_params(world_size, mode, hidden, ffn, tp, **_):
    group = tp or world_size
    split, name = (hidden, "hidden") if mode == "row" else (ffn, "ffn")  # what the row-parallel layer cuts
    return refusal(one_of("mode", mode, MODES), divides_world("tp", group, world_size)) or \
        divides("tp", group, name, split)


def main(ctx, mode: str = "row", input_is_parallel: bool = False, batch: int = 4, hidden: int = 8, out: int = 6,
         ffn: int = 16, seed: int = 0, tp: int = 0):
    """One row-parallel layer (or MLP) forward and backward in this rank's group of ``tp`` ranks (0: the world)."""
    p = {k: v.to(ctx.device) for k, v in row_parallel_problem(mode, seed, batch, hidden, out, ffn).items()}
    with Mesh.for_world(("tp",), tp=tp or ctx.world_size) as mesh, M.record_communication() as log:
        group, me, size = mesh.group("tp"), mesh.rank_in("tp"), mesh.size("tp")
        if mode == "row":
            sent = _row(p, group, me, size, input_is_parallel)
        else:
            sent = _mlp(p, group, me, size)
    return {**sent, "communication": log, "tp": size, "group_rank": me}


def _row(p: dict, group, me: int, tp: int, input_is_parallel: bool) -> dict:
    rows = p["weight"].shape[0] // tp
    block = slice(me * rows, (me + 1) * rows)
    w_r = p["weight"][block].clone().requires_grad_()  # [h/n, o]
    bias = p["bias"].clone().requires_grad_()  # [o], replicated
    if input_is_parallel:
        x = p["x"][:, block].clone().requires_grad_()  # [b, h/n]: the previous layer left X split
        x_r = x
    else:
        x = p["x"].clone().requires_grad_()  # [b, h], replicated
        x_r = M.scatter_to_tensor_model_parallel_region(x, group=group)  # [b, h/n]
    y = M.reduce_from_tensor_model_parallel_region(x_r @ w_r, group=group) + bias  # [b, o]
    y.backward(p["grad_output"])
    return {"output": y, "grad_input": x.grad, "grad_weight": w_r.grad, "grad_bias": bias.grad,
            "block": [block.start, block.stop]}


def _mlp(p: dict, group, me: int, tp: int) -> dict:
    cols = p["w_in"].shape[1] // tp
    block = slice(me * cols, (me + 1) * cols)
    a_r = p["w_in"][:, block].clone().requires_grad_()  # [h, 4h/n]: column parallel
    b_r = p["w_out"][block].clone().requires_grad_()  # [4h/n, h]: row parallel
    bias = p["bias"].clone().requires_grad_()  # [h], replicated
    x = p["x"].clone().requires_grad_()  # [b, h], replicated
    h_r = torch.nn.functional.gelu(M.copy_to_tensor_model_parallel_region(x, group=group) @ a_r)  # [b, 4h/n]
    y = M.reduce_from_tensor_model_parallel_region(h_r @ b_r, group=group) + bias  # [b, h]
    y.backward(p["grad_output"])
    return {"output": y, "grad_input": x.grad, "grad_w_in": a_r.grad, "grad_w_out": b_r.grad,
            "grad_bias": bias.grad, "block": [block.start, block.stop]}


if __name__ == "__main__":
    entrypoint(main)
