"""The smallest worker: each rank reports who it is, then all ranks sum their rank ids.

    torchrun --nproc-per-node 4 workers/hello.py
"""
import os

import torch
import torch.distributed as dist

from workers.runtime import entrypoint


def main(ctx, value: float = 1.0):
    x = torch.tensor([float(ctx.rank) + value], device=ctx.device)
    dist.all_reduce(x)  # SUM over ranks: value*n + n(n-1)/2
    env = {k: os.environ.get(k, "") for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                               "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return {"sum": x.item(), "pid": os.getpid(), "env": env, "backend": ctx.backend, "device": str(ctx.device)}


if __name__ == "__main__":
    entrypoint(main)
