"""Chapter 08's run, in float64 under DDP, made to survive a restart: resume from the newest complete checkpoint, go
on, and write down what happened.

Every attempt runs this from the top, as torchrun re-runs a script: build everything fresh, load the newest complete
checkpoint if there is one (the *rollback*: steps after it are done again), train to ``steps``, save every
``ckpt_every`` steps. The restarted run equals the uninterrupted one bit for bit because the checkpoint holds every
input of the next step (weights, AdamW's moments, the schedule's position, the data order's position, each rank's
RNG streams) and both runs execute the same float64 operations in the same order: DDP averages two ranks' gradients
(a + b is exact whichever comes first), gloo's all_reduce is deterministic, and nothing else is random.

``forward_loss`` is a module attribute on purpose: the faults (``faults.py``) replace it for a run.
"""
from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from workers.checkpointing.training import (RunConfig, make_dataset, make_model, make_optimizer, make_sampler,
                                            make_scheduler, next_batch, rank_seed, seed_rngs)
from workers.faults import injected
from workers.resilience import faults, state
from workers.resilience.board import Board, CollectiveFailed
from workers.resilience.journal import Journal, started_before


def forward_loss(model: nn.Module, batch: dict, step: int) -> torch.Tensor:
    """This rank's mean squared error on its rows of the step's batch (``step``: for the faults' aim)."""
    return nn.functional.mse_loss(model(batch["x"]), batch["y"])  # [b, d_out] -> []


def flat_weights(model: nn.Module) -> torch.Tensor:
    """Every parameter as one float64 vector in parameter order: torch.equal across runs means bit for bit."""
    return torch.cat([p.detach().reshape(-1).to("cpu") for p in model.parameters()])  # [P] float64


def run(ctx, cfg: RunConfig, *, steps: int, ckpt_every: int, ckpt_dir: str, fault: str, fault_step: int,
        fault_rank: int, hang_s: float, attempt: int, run_id: str, fresh: bool, slow_s: float = 0.3,
        slow_steps: int = 3) -> dict:
    if fresh and attempt == 0:
        # A new job starts from nothing; only its restarts (attempt > 0) find and load what it saved.
        if ctx.rank == 0:
            state.clear(ckpt_dir)
        dist.barrier()  # nobody opens a journal that rank 0 is about to remove
    if started_before(ckpt_dir, ctx.rank, run_id, attempt):
        raise ValueError(f"ckpt_dir={ckpt_dir!r} already holds a run of these ranks (warm ranks run every task with "
                         "one torchrun run id): give each run a directory of its own")
    journal = Journal(ckpt_dir, ctx.rank, attempt, run_id)
    journal.write("start", world_size=ctx.world_size)
    board = Board(ctx.rank, ctx.world_size, run_id, attempt)
    try:
        return _train(ctx, cfg, journal, board, steps=steps, ckpt_every=ckpt_every, ckpt_dir=ckpt_dir, fault=fault,
                      fault_step=fault_step, fault_rank=fault_rank, hang_s=hang_s, attempt=attempt, slow_s=slow_s,
                      slow_steps=slow_steps)
    except CollectiveFailed as exc:
        # on record before the process ends: the ledger times detection from it, the notebook shows it
        journal.write("failure", step=exc.step, collective=exc.collective, missing=exc.missing, message=str(exc))
        raise
    finally:
        journal.close()


def _train(ctx, cfg: RunConfig, journal: Journal, board: Board, *, steps: int, ckpt_every: int, ckpt_dir: str,
           fault: str, fault_step: int, fault_rank: int, hang_s: float, attempt: int, slow_s: float = 0.3,
           slow_steps: int = 3) -> dict:
    board.enter(0, "start")
    seed_rngs(rank_seed(cfg, ctx.rank))  # a fresh process's streams; a reload replaces them with the saved ones
    data = make_dataset(cfg)
    model = make_model(cfg).double().to(ctx.device)
    board.enter(0, "DDP's weight broadcast")
    with board.naming():
        ddp = DDP(model, device_ids=[ctx.device.index] if ctx.is_cuda else None)
    optimizer = make_optimizer(model, cfg)
    scheduler = make_scheduler(optimizer, cfg)
    sampler = make_sampler(cfg, ctx.rank, ctx.world_size)
    config = {**cfg.as_dict(), "dtype": "float64", "world_size": ctx.world_size}

    board.enter(0, "checkpoint choice (broadcast)")
    with board.naming():
        found = state.find(ckpt_dir, ctx.rank)
    first = 1
    if found is not None:
        board.enter(found[0], "checkpoint load (dcp.load)")
        t0 = time.time()
        with board.naming():
            resumed, saved_world = state.load(found[1], ddp, optimizer, scheduler, sampler, ctx.rank, config)
        journal.write("reload", step=resumed, t0=t0, t1=time.time(), skipped=state.incomplete(ckpt_dir),
                      saved_world=saved_world, world_size=ctx.world_size)
        first = resumed + 1

    aim = dict(rank=ctx.rank, attempt=attempt, at_step=fault_step, at_rank=fault_rank, journal=journal, hang_s=hang_s,
               slow_s=slow_s, slow_steps=slow_steps)
    trainer = sys.modules[__name__]  # the step calls forward_loss through the module: a fault replaces it there
    with injected(fault, lambda: faults.patches(trainer, **aim)):
        for step in range(first, steps + 1):
            t0 = time.time()
            batch = next_batch(data, sampler, cfg, ctx.device)  # float32 rows and augmentation, as in chapter 08
            batch["x"], batch["y"] = batch["x"].double(), batch["y"].double()  # [b/n, d_in], [b/n, d_out]
            optimizer.zero_grad(set_to_none=True)
            loss = trainer.forward_loss(ddp, batch, step)
            arrive = time.time()  # at the gradient all_reduce: the ledger's waiting is the spread of these over ranks
            board.enter(step, "gradient all_reduce (DDP's backward)")
            with board.naming():
                loss.backward()  # DDP averages the gradients over the ranks here
            optimizer.step()
            scheduler.step()
            mean = loss.detach() / ctx.world_size
            board.enter(step, "loss all_reduce")
            with board.naming():
                dist.all_reduce(mean)  # the global loss (equal shards): the same on every rank
            t1 = time.time()
            journal.write("step", step=step, loss=mean.item(), t0=t0, t1=t1, arrive=arrive,
                          rows=batch["indices"].tolist())
            ctx.metric(step=step, loss=mean.item(), attempt=attempt, step_s=t1 - t0)
            if step % ckpt_every == 0:
                board.enter(step, "checkpoint save (dcp.save)")
                t0 = time.time()
                with board.naming():
                    state.save(ckpt_dir, step, ddp, optimizer, scheduler, sampler, ctx.rank, config)
                journal.write("checkpoint", step=step, t0=t0, t1=time.time())
    board.enter(steps, "final barrier")
    with board.naming():
        dist.barrier()  # every rank's journal is written before rank 0 reads them all
    return {"weights": flat_weights(model), "attempt": attempt, "first_step": first}
