"""The whole idea of distributed training in one file: join a group, sum a tensor across it, leave.

    torchrun --standalone --nproc-per-node 4 workers/ch01_minimal.py

Plain PyTorch on purpose (no course runtime): this is the script you would run on a real cluster.
"""
import os

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])                    # which process am I, 0..world_size-1, across all nodes
local_rank = int(os.environ["LOCAL_RANK"])        # which process am I on this node: picks the GPU
world_size = int(os.environ["WORLD_SIZE"])        # how many processes in the whole job
use_gpu = torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"])  # one GPU per local rank?
device = torch.device(f"cuda:{local_rank}" if use_gpu else "cpu")
if use_gpu:
    torch.cuda.set_device(device)                 # before init: NCCL binds this rank to this GPU
dist.init_process_group(backend="nccl" if use_gpu else "gloo")  # rendezvous at MASTER_ADDR:MASTER_PORT

x = torch.tensor([rank + 1.0], device=device)     # rank r holds r + 1
dist.all_reduce(x, op=dist.ReduceOp.SUM)          # every rank now holds 1 + 2 + ... + n
expected = world_size * (world_size + 1) / 2
print(f"rank {rank}/{world_size} (local_rank {local_rank}, {device}): all_reduce -> {x.item():g}, "
      f"n(n+1)/2 = {expected:g}", flush=True)
assert x.item() == expected, "the sum is wrong: some rank did not take part"
dist.destroy_process_group()
