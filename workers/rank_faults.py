"""Things that go wrong on real ranks, on purpose: the faults chapter 01 injects and the launcher's tests.

    torchrun --nproc-per-node 2 workers/rank_faults.py --mode skip_collective --group-timeout 5

From a notebook, ``course_utils.run(..., collective_timeout=5)`` sets the timeout of the default group
instead; ``group_timeout`` is for plain torchrun, where no launcher is there to set it.
"""
import os
import time

import torch
import torch.distributed as dist

from workers.runtime import entrypoint, one_of, refusal

MODES = ("ok", "raise", "die", "skip_collective", "shape_mismatch", "sleep", "slow_metrics")


def check_params(world_size, mode, bad_rank, **_):
    return refusal(one_of("mode", mode, MODES),
                   None if 0 <= bad_rank < world_size else
                   f"bad_rank={bad_rank} is not a rank of a world of {world_size}: use 0 to {world_size - 1}")


def main(ctx, mode: str = "ok", bad_rank: int = 1, seconds: float = 30.0, group_timeout: float = 0.0):
    """Run one fault. ``group_timeout`` > 0 runs the collective in a fresh group with that timeout (seconds)."""
    group = ctx.new_group(timeout_s=group_timeout) if group_timeout > 0 else None
    me_bad = ctx.rank == bad_rank
    x = torch.ones(4, device=ctx.device) * (ctx.rank + 1)
    if mode == "raise" and me_bad:
        raise ValueError(f"rank {ctx.rank} was told to fail")
    if mode == "die" and me_bad:
        os._exit(7)  # no traceback, no goodbye: like a segfault or the OOM killer
    if mode == "skip_collective" and me_bad:
        time.sleep(seconds)  # never joins the all_reduce below
        return {"skipped": True}
    if mode == "shape_mismatch" and me_bad:
        x = torch.ones(5, device=ctx.device)
    if mode == "sleep":
        time.sleep(seconds)
    if mode == "slow_metrics":
        for step in range(int(seconds * 10)):
            ctx.metric(step=step, value=float(step))
            time.sleep(0.1)
    dist.all_reduce(x, group=group)
    return {"sum": x, "pid": os.getpid()}


if __name__ == "__main__":
    entrypoint(main)
