"""The world-size scaling trap: a replicated loss behind an all-reduce whose backward all-reduces too.

    torchrun --nproc-per-node 4 workers/ch03_scaling_trap.py

A row-parallel linear layer, then a loss that every rank computes identically:

    X_r = scatter(X)               [b, h/n]   this rank's columns of the replicated input
    P_r = X_r W_r                  [b, o]     this rank's partial sum (W_r: rows r*h/n .. of W)
    Y   = all_reduce(P_r)          [b, o]     replicated: Y = X W on every rank
    L   = 0.5 * ||Y||^2                       replicated: one logical loss, computed n times

The all-reduce runs with three backwards: Megatron's ``g`` (identity), a hand-written one that
all-reduces the gradient (the "symmetric" choice), and ``torch.distributed.nn.functional.all_reduce``,
which does the same. dL/dY = Y is already complete on every rank, so summing it over n ranks makes every
gradient upstream n times too large.
"""
import warnings

import torch.distributed as dist

from workers.parallel import mappings as M
from workers.layout.mesh import Mesh
from workers.parallel.faults import all_reduce_both_ways
from workers.parallel.problems import scaling_trap_problem
from workers.runtime import divides, divides_world, entrypoint


def _torch_distributed_nn(x, group):
    import torch.distributed.nn.functional as dnn

    with warnings.catch_warnings():  # deprecated in favour of _functional_collectives; shown for its backward
        warnings.simplefilter("ignore")
        return dnn.all_reduce(x, group=group if group is not None else dist.group.WORLD)


def _has_torch_distributed_nn() -> bool:
    try:
        import torch.distributed.nn.functional as dnn
    except ImportError:
        return False
    return hasattr(dnn, "all_reduce")


REDUCTIONS = {
    "megatron_g": lambda x, group: M.reduce_from_tensor_model_parallel_region(x, group=group),
    "all_reduce_backward": all_reduce_both_ways,
    "torch.distributed.nn.all_reduce": _torch_distributed_nn,
}


def check_params(world_size, hidden, tp, **_):
    group = tp or world_size
    return divides_world("tp", group, world_size) or divides("tp", group, "hidden", hidden)


def main(ctx, batch: int = 4, hidden: int = 8, out: int = 4, seed: int = 0, tp: int = 0):
    """Gradients of W_r and X under each backward of the all-reduce, for one tensor-parallel group size ``tp``
    (0: the whole world)."""
    x_full, w_full = scaling_trap_problem(seed, batch, hidden, out)
    results = {}
    with Mesh.for_world(("tp",), tp=tp or ctx.world_size) as mesh:
        group, size, me = mesh.group("tp"), mesh.size("tp"), mesh.rank_in("tp")
        rows = hidden // size
        for name, reduce in REDUCTIONS.items():
            if name.startswith("torch.") and not _has_torch_distributed_nn():
                continue
            x = x_full.clone().to(ctx.device).requires_grad_()  # replicated leaf, fresh for each variant
            w_r = w_full[me * rows:(me + 1) * rows].clone().to(ctx.device).requires_grad_()  # [h/n, o]
            x_r = M.scatter_to_tensor_model_parallel_region(x, group=group)  # [b, h/n]
            y = reduce(x_r @ w_r, group)  # [b, o], replicated
            loss = 0.5 * y.square().sum()
            loss.backward()
            results[name] = {"loss": loss.item(), "grad_weight": w_r.grad, "grad_input": x.grad}
    return {"results": results, "tp": size, "group_rank": me, "weight_rows": [me * rows, (me + 1) * rows]}


if __name__ == "__main__":
    entrypoint(main)
