"""A process group whose creation loses its connection, on purpose: the fault ``course_utils.launcher.run`` retries.

Gloo rarely fails this way on a loaded machine (``DistNetworkError: Broken pipe`` from ``new_group``,
pytorch/pytorch#11364). Here every rank's ``ProcessGroupGloo`` constructor raises that error while ``attempts``
(a file, one line per run) has fewer than ``faults`` lines, so the error comes out of torch's real
``new_group`` -> ``_new_process_group_helper`` path; later runs make the group and all-reduce over it. With
``error="ValueError"`` the fault is one a worker's own code could cause, and must not be retried.
"""
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d


def main(ctx, attempts: str = "", faults: int = 1, error: str = "DistNetworkError"):
    path = Path(attempts)
    before = len(path.read_text().splitlines()) if path.exists() else 0
    dist.barrier()  # every rank has read the count before rank 0 adds this run to it
    if ctx.rank == 0:
        with path.open("a") as f:
            f.write("run\n")
    if before < faults:
        def broken(*args, **kwargs):
            raise dist.DistNetworkError("Broken pipe") if error == "DistNetworkError" else ValueError("bad ranks")

        real, distributed_c10d.ProcessGroupGloo = distributed_c10d.ProcessGroupGloo, broken
        try:
            dist.new_group(list(range(ctx.world_size)))
        finally:
            distributed_c10d.ProcessGroupGloo = real
    group = dist.new_group(list(range(ctx.world_size)))
    x = torch.ones(1)
    dist.all_reduce(x, group=group)
    dist.destroy_process_group(group)
    return {"sum": x.item(), "run": before + 1}
