"""Restart and roll back: a rank dies (or hangs) mid-step, torchrun restarts every rank, the job reloads its newest
complete checkpoint and goes on; the result says which steps were done twice and where the wall time went.

    torchrun --nproc-per-node 2 workers/ch17_restart.py --ckpt-dir /tmp/r0                    # uninterrupted
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1                                                 # see below
    torchrun --nproc-per-node 2 --max-restarts 1 workers/ch17_restart.py --ckpt-dir /tmp/r1 --fault kill --fault-step 7
    COURSE_COLLECTIVE_TIMEOUT=5 torchrun --nproc-per-node 2 --max-restarts 1 workers/ch17_restart.py \
        --ckpt-dir /tmp/r2 --fault hang --fault-rank 0 --fault-step 10
    torchrun --nproc-per-node 2 workers/ch17_restart.py --ckpt-dir /tmp/r3 --fault slow --fault-step 5 --slow-s 0.3

From a notebook: ``course_utils.run("workers.ch17_restart", 2, max_restarts=1, collective_timeout=5, ckpt_dir=...,
fault="hang")`` (a run torchrun may restart always gets ranks of its own). ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``:
torchrun >= 2.5 keeps one TCP store for all restarts of a job, and the process group's keys in it do not name the
attempt, so a restarted rank can read the gloo address of a rank that died ("Gloo connectFullMesh failed ...
Connection refused", pytorch/pytorch#135712; seen here on torch 2.13). The launcher sets it for such runs.

This is section 3.3.4 of "The Llama 3 Herd of Models" on two ranks: 419 unexpected interruptions in 54 days, each
one a restart from the last checkpoint. The run is chapter 08's (``workers/checkpointing/training.py``: dropout,
AdamW, warmup + cosine, a shuffled data order with a position, augmentation drawing from numpy and python) in
float64, checkpointed with DCP every ``ckpt_every`` steps (``workers/resilience/state.py``). The fault strikes only on
the first attempt (``TORCHELASTIC_RESTART_COUNT`` 0). Every rank returns its final weights; rank 0 also returns the
run as its journal tells it (``workers/resilience/journal.py: ledger``): the steps of the final trajectory with
their losses and attempts, the steps that were lost and redone, and the wall-time split.
"""
from __future__ import annotations

import os

import torch

from workers.checkpointing.training import RunConfig
from workers.resilience import trainer
from workers.resilience.faults import FAULTS
from workers.resilience.journal import read_events, ledger
from workers.runtime import at_least, batch_over_world, entrypoint, one_of, refusal


def check_params(world_size, steps, ckpt_every, ckpt_dir, fault, fault_step, fault_rank, global_batch, slow_s=0.3,
                 slow_steps=3, **_):
    # the straggler's steps must lie inside the run (a fault_step outside it is refused on its own)
    numbers = all(isinstance(v, int) for v in (fault_step, slow_steps, steps)) and 1 <= fault_step <= steps
    return refusal(
        one_of("fault", fault, FAULTS), at_least("steps", steps), at_least("ckpt_every", ckpt_every),
        batch_over_world(global_batch, world_size),
        None if ckpt_dir else "ckpt_dir is empty: give the directory the checkpoints and the journal go to",
        None if fault == "none" or (isinstance(fault_step, int) and 1 <= fault_step <= steps) else
        f"fault_step={fault_step} is not a step of this run: choose 1 to {steps}",
        None if fault != "torn" or not isinstance(ckpt_every, int) or ckpt_every < 1
        or (isinstance(fault_step, int) and fault_step % ckpt_every == 0) else
        f"fault_step={fault_step} saves no checkpoint to tear: with ckpt_every={ckpt_every} choose a multiple of "
        f"{ckpt_every}",
        None if fault == "none" or (isinstance(fault_rank, int) and 0 <= fault_rank < world_size) else
        f"fault_rank={fault_rank} is not a rank of a world of {world_size}: use 0 to {world_size - 1}",
        at_least("slow_steps", slow_steps),
        None if isinstance(slow_s, (int, float)) and not isinstance(slow_s, bool) and slow_s > 0 else
        f"slow_s={slow_s!r} is not a stall: give the straggler's seconds per step, more than 0",
        None if fault != "slow" or not numbers or slow_steps < 1 or fault_step + slow_steps - 1 <= steps else
        f"slow_steps={slow_steps} from fault_step={fault_step} runs past steps={steps}: choose slow_steps of at most "
        f"{max(steps - fault_step + 1, 1)}, or an earlier fault_step",
        None if fault != "node" or fault_rank != 0 else
        "fault_rank=0 is on node 0, whose agent hosts the job's rendezvous: lose a rank of another node")


def main(ctx, steps: int = 12, ckpt_every: int = 4, ckpt_dir: str = "build/ch17/restart", fault: str = "none",
         fault_step: int = 7, fault_rank: int = 1, hang_s: float = 600.0, slow_s: float = 0.3, slow_steps: int = 3,
         fresh: bool = True, seed: int = 0,
         n_samples: int = 64, global_batch: int = 8, dropout: float = 0.2, lr: float = 3e-3, warmup_steps: int = 3):
    """Train ``steps`` steps with a DCP checkpoint every ``ckpt_every``, resuming from the newest complete one.

    ``fault="slow"``: rank ``fault_rank`` stalls ``slow_s`` seconds after its forward in ``slow_steps`` steps from
    ``fault_step`` on, on every attempt (a straggler: nothing fails, nothing restarts).
    ``fresh``: the first attempt removes the checkpoints and journal an earlier job left in ``ckpt_dir`` (its
    restarts never do); ``--fresh false`` resumes a job relaunched by hand after it ran out of restarts."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    # torchrun's run id is the same for every attempt of one launch; a world started without torchrun has none
    run_id = os.environ.get("TORCHELASTIC_RUN_ID") or f"pid{os.getpid()}"
    if fault == "node" and ctx.rank == fault_rank and attempt == 0 and int(os.environ.get("GROUP_RANK", 0)) == 0:
        raise ValueError(f"fault_rank={fault_rank} is on node 0, whose agent hosts the job's rendezvous: lose a rank "
                         "of another node")
    cfg = RunConfig(n_samples=n_samples, global_batch=global_batch, dropout=dropout, lr=lr,
                    warmup_steps=warmup_steps, total_steps=steps, seed=seed)
    out = trainer.run(ctx, cfg, steps=steps, ckpt_every=ckpt_every, ckpt_dir=ckpt_dir, fault=fault,
                      fault_step=fault_step, fault_rank=fault_rank, hang_s=hang_s, attempt=attempt, run_id=run_id,
                      fresh=fresh, slow_s=slow_s, slow_steps=slow_steps)
    out["store_port"] = int(os.environ["MASTER_PORT"])  # the job's TCP store: free again once the job is over
    if ctx.rank == 0:
        record = ledger(read_events(ckpt_dir, run_id))
        out.update(record, losses=torch.tensor(record["losses"], dtype=torch.float64),  # [steps] float64
                   ckpt_dir=ckpt_dir, ckpt_every=ckpt_every)
    return out


if __name__ == "__main__":
    entrypoint(main)
