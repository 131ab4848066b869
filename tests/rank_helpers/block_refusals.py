"""Build a ``ParallelBlock`` the block must refuse, and count the process groups made before the refusal.

``dist.new_group`` is wrapped for the duration (the attention's KV-replica groups are made through it), and
the world's own table of groups is counted before and after: a group made and then abandoned by a refused
construction stays on a warm rank for good. Any group it did make is destroyed here, so a failing run
leaves the warm ranks as clean as a passing one.
"""
import torch.distributed as dist
from torch.distributed import distributed_c10d

from workers.parallel.block import ParallelBlock
from workers.model.dense import BlockConfig


def _groups_in_world() -> int:
    return len(distributed_c10d._world.pg_map)  # every process group this rank knows, the world's included


def main(ctx, hidden: int = 32, heads: int = 4, kv_heads: int = 1, ffn: int = 33, activation: str = "gelu"):
    cfg = BlockConfig(hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, activation=activation)
    real, made = dist.new_group, []

    def counted(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    before = _groups_in_world()
    dist.new_group = counted
    try:
        ParallelBlock(cfg)
        error = ""
    except ValueError as exc:
        error = str(exc)
    finally:
        dist.new_group = real
    added = _groups_in_world() - before
    for pg in made:
        if pg not in (None, dist.GroupMember.NON_GROUP_MEMBER):
            dist.destroy_process_group(pg)
    return {"error": error, "new_group_calls": len(made), "groups_added": added}
