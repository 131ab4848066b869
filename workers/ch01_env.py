"""Who am I? What torchrun tells each rank through environment variables.

    # two "nodes" on one machine, two processes each: run both lines, in two terminals (any free port)
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --rdzv-backend static \
             --master-addr 127.0.0.1 --master-port 29511 workers/ch01_env.py
    torchrun --nnodes 2 --node-rank 1 --nproc-per-node 2 --rdzv-backend static \
             --master-addr 127.0.0.1 --master-port 29511 workers/ch01_env.py

``rank`` is unique in the job; ``local_rank`` is unique on a node and is what picks the GPU;
``world_size`` counts every process on every node.
"""
import os
import socket

import torch
import torch.distributed as dist

from workers.runtime import entrypoint

# The variables torchrun (torch.distributed.run) sets for every worker process it starts.
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
                 "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS")


def main(ctx, gpus_per_node: int = 0):
    """Report this rank's identity, its torchrun variables, and the GPU it would pick.

    ``gpus_per_node`` simulates a GPU node on a CPU machine (0: use what this machine has).
    """
    gpus = gpus_per_node or (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    # Confirm the identities with a collective: every rank learns every rank's (node, local_rank).
    dev = ctx.comm_device("all_gather")
    me = torch.tensor([ctx.rank, ctx.node_rank, ctx.local_rank], device=dev)
    table = torch.empty(ctx.world_size * 3, dtype=me.dtype, device=dev)
    dist.all_gather(list(table.split(3)), me)
    return {
        "rank": dist.get_rank(), "world_size": dist.get_world_size(),
        "local_rank": ctx.local_rank, "local_world_size": ctx.local_world_size, "node_rank": ctx.node_rank,
        "env": {k: os.environ.get(k) for k in TORCHRUN_VARS},
        "host": socket.gethostname(), "pid": os.getpid(),
        "everyone": table.view(ctx.world_size, 3),  # rows: (rank, node, local_rank), seen by all ranks
        "gpus_per_node": gpus,
        # Mapping ranks to GPUs: only local_rank stays inside 0..gpus-1 on every node.
        "device_by_local_rank": f"cuda:{ctx.local_rank}" if gpus else "cpu",
        "device_by_rank": f"cuda:{ctx.rank}" if gpus else "cpu",
        "device_by_rank_exists": bool(gpus) and ctx.rank < gpus,
        "device": str(ctx.device), "backend": ctx.backend,
    }


if __name__ == "__main__":
    entrypoint(main)
