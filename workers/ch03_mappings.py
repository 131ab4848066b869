"""Run every mapping of ``workers/parallel/mappings.py`` on real ranks; send back inputs, outputs and gradients.

    torchrun --nproc-per-node 4 workers/ch03_mappings.py --mapping all --tp 2

Each rank builds the inputs and output gradients of *all* ranks from one seed (``reference.example``),
keeps its own, runs forward and backward, and returns its input, the gradient it was given, its output
and the gradient of its input: everything the notebook needs to rebuild the run in one process
(``reference.compare``). ``tp`` < world size splits the world into tensor-parallel groups of that
size ([0..tp-1], [tp..2tp-1], ...) and every mapping runs inside its own group only; ``tp`` 0 (the
default) means one group, the whole world.
"""
import warnings

import torch
import torch.distributed as dist

from workers.layout.mesh import Mesh
from workers.parallel import mappings
from workers.parallel.reference import MAPPING_NAMES, example, uneven_splits
from workers.runtime import at_least, divides_world, entrypoint, one_of, refusal

DTYPES = {"float64": torch.float64, "float32": torch.float32}


def check_params(world_size, mapping, rows, cols, dtype, tp, implementation, **_):
    return refusal(one_of("mapping", mapping, ("all",) + tuple(MAPPING_NAMES)), one_of("dtype", dtype, list(DTYPES)),
                   at_least("rows", rows), at_least("cols", cols),  # the block sizes per rank
                   divides_world("tp", tp or world_size, world_size),
                   "an implementation replaces one mapping: pass mapping='<its name>' with it"
                   if implementation is not None and mapping == "all" else None)


def run_mapping(ctx, name: str, fn, group, group_index: int, *, rows: int, cols: int, dtype: torch.dtype,
                seed: int, uneven: bool, tensor_parallel_output_grad: bool) -> dict:
    n, me = dist.get_world_size(group), dist.get_rank(group)
    options, kwargs = {}, {}
    if name == "gather_from_sequence_parallel_region":
        options["tensor_parallel_output_grad"] = kwargs["tensor_parallel_output_grad"] = tensor_parallel_output_grad
    if name == "all_to_all" and uneven:
        splits = uneven_splits(n)
        options["input_split_sizes"] = splits
        kwargs = {"input_split_sizes": splits[me], "output_split_sizes": [splits[s][me] for s in range(n)]}
    inputs, grad_outputs = example(name, n, rows, cols, seed=seed + 1000 * group_index, dtype=dtype, **options)
    x = inputs[me].clone().to(ctx.device).requires_grad_()
    y = fn(x, group=group, **kwargs)
    y.backward(grad_outputs[me].to(ctx.device))
    return {"input": inputs[me], "grad_output": grad_outputs[me], "output": y, "grad_input": x.grad,
            "options": {k: v for k, v in options.items()}}


def main(ctx, mapping: str = "all", rows: int = 2, cols: int = 3, dtype: str = "float64", seed: int = 0,
         tp: int = 0, uneven: bool = False, tensor_parallel_output_grad: bool = True, implementation=None):
    """Forward and backward of each mapping; ``implementation`` (a function) replaces the library's.

    ``tp``: the ranks per tensor-parallel group (0: the whole world).
    """
    names = MAPPING_NAMES if mapping == "all" else (mapping,)
    records = {}
    # Record warnings too: the library must not lean on deprecated collectives (torch 2.13 renamed some).
    with Mesh.for_world(("tp",), tp=tp or ctx.world_size) as mesh, mappings.record_communication() as log, \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, name in enumerate(names):
            fn = implementation if implementation is not None else mappings.MAPPINGS[name]
            records[name] = run_mapping(ctx, name, fn, mesh.group("tp"), mesh.index("tp"), rows=rows, cols=cols,
                                        dtype=DTYPES[dtype], seed=seed + i, uneven=uneven,
                                        tensor_parallel_output_grad=tensor_parallel_output_grad)
    return {"records": records, "group_ranks": mesh.ranks("tp"), "group_rank": mesh.rank_in("tp"),
            "communication": log, "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}


if __name__ == "__main__":
    entrypoint(main)
