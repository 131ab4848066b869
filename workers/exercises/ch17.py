"""Rank-side check for chapter 17's ``resume_position``, run inside the real restart path.

``resume_position(checkpoint, failed_step, rank, world_size)`` returns the rows of the dataset this rank reads in the
first step after a restart. ``checkpoint`` is what the newest complete checkpoint holds, read back from its DCP folder:
``{"step": S, "config": {...}}`` (the step it was saved after, and the run's settings: ``n_samples``,
``global_batch``, ``seed``, ``world_size``, ...); ``failed_step`` is the step the job was in when a rank died.

For each case every rank runs chapter 17's trainer (``workers/resilience/trainer.py``: chapter 08's run in float64
under DDP, DCP checkpoints) three times, in a folder of the case's own:

1. uninterrupted, to the last step: the weights a restarted job must end with;
2. the job that fails during step ``failed_step``: it trains to step ``failed_step - 1`` with a checkpoint every
   ``ckpt_every`` steps and stops there, as a rank killed in the middle of step ``failed_step`` stops it (torchrun's
   restart cannot be had on warm ranks; what the restart reads is the same);
3. the restart (attempt 1): the real code finds the newest complete checkpoint and loads it (weights, AdamW, the
   schedule, every rank's RNG streams and the data position, ``sampler.load_state_dict``), and its first step reads
   the rows the learner's function returned instead of the ones the restored sampler gives (recorded: the real
   code's own resume); the rest of the run is the real one.

The learner's rows must be the real resume's, on every rank, and the restarted job then ends with the uninterrupted
job's weights: bit for bit at 2 ranks (float64, the same operations in the same order: ``tests/test_ch17_restart.py``'s
argument), within 1e-12 at 4 (a four-way sum whose order the restarted DDP need not keep). Rows that differ are named from what they are (``resume_problem``, a pure function the tests also call):
a step's rows other than the next one's (the failed step's, the checkpoint's own step, the one after next, the
epoch's first), the whole global batch on every rank, the right rows on the wrong ranks, epoch 0's order in a later
epoch, an epoch counted with its incomplete last batch, and the sampler's saved (epoch, position) read without its
rollover at an epoch's end. The cases: 60 rows in global batches of 8 (7 steps an epoch, 4 rows dropped), a
checkpoint in the middle of epoch 0, one in epoch 2, and one that closes epoch 1, at world 2 and 4.
"""
from __future__ import annotations

import copy
import math
import numbers
import os
import shutil
import tempfile
import uuid

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from workers.checkpointing.sampler import ShuffledSampler
from workers.checkpointing.training import RunConfig, augment
from workers.exercises.support import Wrong, agree, run_exercise
from workers.faults import patched
from workers.resilience import state, trainer

# (n_samples, global_batch, seed, steps, ckpt_every, failed_step): 60 rows in batches of 8, 7 steps an epoch.
RESUME_CASES = (
    (60, 8, 0, 10, 5, 9),  # checkpoint after step 5, mid epoch 0; steps 6, 7, 8 done again
    (60, 8, 1, 24, 4, 23),  # checkpoint after step 20, mid epoch 2 (steps 15-21); steps 21, 22 done again
    (60, 8, 2, 18, 7, 17),  # checkpoint after step 14, the last of epoch 1: the restart opens epoch 2
)
NO_FAULT = {"fault": "none", "fault_step": 1, "fault_rank": 0, "hang_s": 0.0}


# -- the data order, as the real sampler reads it -------------------------------------------------------------------

def steps_per_epoch(n_samples: int, global_batch: int) -> int:
    return n_samples // global_batch  # the sampler drops an incomplete last batch


def rows_at(n_samples: int, global_batch: int, seed: int, world_size: int, rank: int, step: int) -> list[int]:
    """The rows the real sampler gives ``rank`` in step ``step`` (1-based) of an uninterrupted run."""
    epoch, position = divmod(step - 1, steps_per_epoch(n_samples, global_batch))
    sampler = ShuffledSampler(n_samples, global_batch, seed=seed, rank=rank, world_size=world_size)
    sampler.load_state_dict({"epoch": epoch, "position": position, "seed": seed, "n_samples": n_samples,
                             "global_batch": global_batch})
    return sampler.next_indices().tolist()


def _order(n_samples: int, seed: int) -> torch.Tensor:
    return torch.randperm(n_samples, generator=torch.Generator().manual_seed(seed))  # [n_samples]


def _slice(order: torch.Tensor, position: int, global_batch: int, world_size: int, rank: int) -> list[int]:
    per_rank = global_batch // world_size
    start = position * global_batch + rank * per_rank
    return order[start:start + per_rank].tolist()


# -- what a learner's rows are --------------------------------------------------------------------------------------

def _is_index(v) -> bool:
    """An int, a numpy integer or a 0-dim integer tensor (a bool is not an index)."""
    if isinstance(v, torch.Tensor):
        return v.dim() == 0 and not (v.dtype.is_floating_point or v.dtype.is_complex or v.dtype == torch.bool)
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def as_rows(value, n_samples: int) -> list[int]:
    """The learner's rows as a list of ints, or Wrong saying why they cannot be row indices."""
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise Wrong(f"your rows are a tensor of dtype {value.dtype}: rows are indices into the dataset, integers "
                        "(the sampler's torch.randperm gives int64)")
        if value.dim() != 1:
            raise Wrong(f"you returned a tensor of shape {list(value.shape)}: return this rank's rows only, as a 1-D "
                        "list or tensor (every rank calls your function with its own rank and reads only its rows)")
        rows = value.tolist()
    elif isinstance(value, (list, tuple)):
        rows = list(value)
        for v in rows:
            if isinstance(v, (list, tuple)) or (isinstance(v, torch.Tensor) and v.dim() > 0):
                raise Wrong("you returned a nested list: return this rank's rows only, as a 1-D list of ints "
                            "(every rank calls your function with its own rank and reads only its rows)")
            if not _is_index(v):
                raise Wrong(f"row {v!r} is a {type(v).__name__}, not an int: rows are indices into the dataset "
                            "(use // for the arithmetic that makes them)")
        rows = [int(v) for v in rows]
    else:
        raise Wrong(f"return this rank's rows as a list of ints or a 1-D integer tensor, not {type(value).__name__}")
    outside = [r for r in rows if not 0 <= r < n_samples]
    if outside:
        raise Wrong(f"row {outside[0]} is not a row of a dataset of {n_samples} rows (0 to {n_samples - 1})")
    return rows


def resume_problem(mine: list[int], everyone: list[list[int]], rank: int, world_size: int, n_samples: int,
                   global_batch: int, seed: int, saved_step: int, failed_step: int) -> str | None:
    """What is wrong with ``mine``, this rank's rows for the first step after a restart from the checkpoint saved after
    step ``saved_step`` (``everyone``: every rank's answer, rank order), or None when they are the real sampler's."""
    B, n, S, F = global_batch, n_samples, saved_step, failed_step
    per_rank, spe = B // world_size, steps_per_epoch(n, B)
    want = rows_at(n, B, seed, world_size, rank, S + 1)
    if mine == want:
        return None
    epoch, position = divmod(S, spe)  # where the next step reads: global batch `position` of epoch `epoch`
    at = (f"rows {want} of step {S + 1} (global batch {position} of epoch {epoch}, counting from 0; this rank's "
          f"slice [{rank * per_rank}:{(rank + 1) * per_rank}] of it)")

    if S % spe == 0 and S > 0:  # the checkpoint closes an epoch: the sampler saved (epoch, position = spe)
        closed = S // spe - 1
        if mine == _slice(_order(n, seed + closed), spe, B, world_size, rank):
            return (f"the checkpoint closes epoch {closed} (step {S} was its last), and you read past its last full "
                    f"batch: {len(mine)} of the {n - spe * B} leftover rows (some ranks get none); the sampler drops "
                    f"that incomplete last batch (n_samples // global_batch = {spe} steps an epoch) and opens epoch "
                    f"{closed + 1}: read {at}")
    if world_size > 1 and len(mine) == B:
        return (f"you returned {B} rows, a whole global batch: each of the {world_size} ranks reads only its "
                f"global_batch // world_size = {per_rank} rows of it (with every rank reading all {B}, each row would "
                f"be trained on {world_size} times in this step); read {at}")
    if len(mine) != per_rank:
        return (f"you returned {len(mine)} rows; each rank reads global_batch // world_size = {per_rank} rows a step: "
                f"read {at}")
    everything = sorted(r for rows in everyone for r in rows)
    if everything == sorted(rows_at(n, B, seed, 1, 0, S + 1)):
        return (f"together your ranks read step {S + 1}'s global batch, but rank {rank} got {mine} instead of {want}: "
                f"the sampler gives rank r the {per_rank} consecutive rows [r*{per_rank}:(r+1)*{per_rank}] of the "
                "global batch (another split reads the same rows, on ranks with other dropout masks and noise, so the "
                "run is no longer the uninterrupted one)")

    steps = {x: rows_at(n, B, seed, world_size, rank, x) for x in range(1, max(F + 1, S + 2) + 2 * spe + 1)}
    if mine == steps[F] or mine == steps[F + 1]:
        x = F if mine == steps[F] else F + 1
        skipped = f"steps {S + 1} to {x - 1}" if x - 1 > S + 1 else f"step {S + 1}"
        return (f"these are the rows of step {x}, {'the step the job failed in' if x == F else 'the step after it'}: "
                f"the weights were rolled back to the checkpoint saved after step {S}, so the data must be too, or "
                f"the rows of {skipped} are never trained on. Resume from the checkpoint's step (checkpoint['step']), "
                "not from failed_step")
    if mine == steps[S]:
        return (f"these are the rows of step {S}, which the checkpoint already holds (it was saved after step {S}): "
                f"they would be trained on twice. checkpoint['step'] counts the steps done, so {S} global batches are "
                f"read; read {at}")
    if mine == steps[S + 2]:
        return (f"these are the rows of step {S + 2}: step {S + 1}'s batch would be skipped (off by one batch). After "
                f"{S} steps, {S} global batches are read: read {at}")
    first = epoch * spe + 1  # the first step of the epoch the next step is in
    if first <= S and mine == steps[first]:
        return (f"these are the rows of step {first}, the first of epoch {epoch}: you restarted the epoch, so its "
                f"{S + 1 - first} steps read before the checkpoint would be trained on twice (what DistributedSampler "
                f"does unless the loop skips them). The position in the epoch is {S} - {epoch} x {spe} = {position}: "
                f"read {at}")
    if epoch > 0 and mine == _slice(_order(n, seed), position, B, world_size, rank):
        return (f"these are the rows at the right position of epoch 0's order, but step {S + 1} is in epoch {epoch}, "
                f"and every epoch is shuffled anew: torch.randperm(n_samples, generator=torch.Generator()"
                f".manual_seed(seed + epoch)); read {at}")
    ceil_spe = math.ceil(n / B)
    if ceil_spe != spe:
        e, p = divmod(S, ceil_spe)
        if mine == _slice(_order(n, seed + e), p, B, world_size, rank):
            return (f"an epoch has n_samples // global_batch = {spe} steps, not {ceil_spe}: the sampler drops the "
                    f"incomplete last batch ({n} rows, {B} a step: the last {n - spe * B} rows of each epoch's order "
                    f"are never read), so after {S} steps it is at global batch {position} of epoch {epoch}; read {at}")
    if sorted(mine) == sorted(want):
        return (f"these are the right rows in another order: order matters (each row gets the noise drawn for its "
                f"place in the batch, and the loss adds the rows up in that order): read {at}, in the sampler's order")
    for x, rows in steps.items():
        if mine == rows:
            how = ("which was read before the checkpoint: it would be trained on twice" if x <= S else
                   f"so the rows of steps {S + 1} to {x - 1} would be skipped")
            return f"these are the rows of step {x}, {how}; read {at}"
    return f"these rows are not the ones the restored sampler reads: read {at}"


# -- the check ------------------------------------------------------------------------------------------------------

def _held(ckpt_dir: str, ctx, cfg: RunConfig) -> dict:
    """What the newest complete checkpoint holds besides tensors: its step and config, read back with DCP (the same
    template the trainer saves: chapter 08's config, the dtype and the world size)."""
    found = state.find(ckpt_dir, ctx.rank)
    if found is None:
        raise RuntimeError(f"the failing job wrote no complete checkpoint in {ckpt_dir}")
    held = {"step": -1, "config": {**cfg.as_dict(), "dtype": "float64", "world_size": ctx.world_size}}
    dcp.load(held, checkpoint_id=found[1])  # non-tensor values are replaced by the saved ones
    return {"step": int(held["step"]), "config": dict(held["config"])}


def _first_step_reads(rows: torch.Tensor | None, seen: dict):
    """``trainer.next_batch`` for the restarted attempt: its first call records the rows the restored sampler gives
    (the real resume; the sampler moves on as it would) and reads ``rows`` instead (None: the sampler's own);
    every later call is the real one. The random draws (numpy's noise, python's feature) are the real ones'."""
    real_next_batch = trainer.next_batch

    def next_batch(data, sampler, cfg, device):
        if "rows" in seen:
            return real_next_batch(data, sampler, cfg, device)
        seen["rows"] = sampler.next_indices()  # [B / world_size]
        idx = seen["rows"] if rows is None else rows
        x, dropped = augment(data[0][idx], cfg)  # [b, d_in]
        return {"indices": idx, "dropped": dropped, "x": x.to(device), "y": data[1][idx].to(device)}
    return next_batch


def _resume_case(ctx, answer, case, root: str, run_id: str) -> None:
    n, B, seed, steps, every, failed = case
    cfg = RunConfig(n_samples=n, global_batch=B, seed=seed, total_steps=steps)
    straight = trainer.run(ctx, cfg, steps=steps, ckpt_every=steps + 1, ckpt_dir=os.path.join(root, "straight"),
                           attempt=0, run_id=f"{run_id}-straight", fresh=True, **NO_FAULT)
    job = os.path.join(root, "job")
    trainer.run(ctx, cfg, steps=failed - 1, ckpt_every=every, ckpt_dir=job, attempt=0, run_id=run_id, fresh=True,
                **NO_FAULT)
    checkpoint = _held(job, ctx, cfg)
    saved = checkpoint["step"]
    where = (f"with the checkpoint saved after step {saved} and the job failed during step {failed} ({n} rows in "
             f"global batches of {B}: {steps_per_epoch(n, B)} steps an epoch)")
    given = copy.deepcopy(checkpoint)
    value = answer(given, failed, ctx.rank, ctx.world_size)
    box = {}

    def well_formed():
        if given != checkpoint:
            changed = sorted(k for k in checkpoint["config"] if given.get("config", {}).get(k) != checkpoint["config"][k])
            what = (f"config[{changed[0]!r}] {checkpoint['config'][changed[0]]} -> {given['config'].get(changed[0])}"
                    if changed else "its entries")
            raise Wrong(f"{where}: your function changed the checkpoint it was given ({what}): the restart still "
                        "reads it, for the weights, the optimizer and the RNG streams (and state.load compares its "
                        "config with the run's); compute on copies")
        try:
            box["rows"] = as_rows(value, n)
        except Wrong as exc:
            raise Wrong(f"{where}: {exc}") from None
    agree(well_formed)
    mine = box["rows"]
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    well_sized = all(len(rows) == B // ctx.world_size for rows in everyone)
    seen = {}
    feed = torch.tensor(mine, dtype=torch.long) if well_sized else None
    with patched(trainer, "next_batch", _first_step_reads(feed, seen)):
        restarted = trainer.run(ctx, cfg, steps=steps, ckpt_every=every, ckpt_dir=job, attempt=1, run_id=run_id,
                                fresh=False, **NO_FAULT)
    real = seen["rows"].tolist()
    if restarted["first_step"] != saved + 1 or real != rows_at(n, B, seed, ctx.world_size, ctx.rank, saved + 1):
        raise RuntimeError(f"the checker's model of the data order disagrees with the real resume (first step "
                           f"{restarted['first_step']}, rows {real}): fix workers/exercises/ch17.py")

    def same_rows():
        if mine != real:
            problem = resume_problem(mine, everyone, ctx.rank, ctx.world_size, n, B, seed, saved, failed)
            raise Wrong(f"{where}: {problem}")
    agree(same_rows)

    # Every rank holds DDP's weights, so every rank reaches the same verdict. At 2 ranks the restarted job is the
    # uninterrupted one bit for bit (a + b is exact in either order: test_ch17_restart's argument); at 4, gloo adds
    # four gradients per element, and the restarted DDP's first step need not add them in the order the uninterrupted
    # run did at that step (a last-bit difference, 1.4e-17 measured here), so the weights are held to 1e-12 there.
    exact = ctx.world_size <= 2
    same = (torch.equal(restarted["weights"], straight["weights"]) if exact else
            torch.allclose(restarted["weights"], straight["weights"], rtol=0.0, atol=1e-12))
    if not same:
        err = (restarted["weights"] - straight["weights"]).abs().max().item()
        raise RuntimeError(f"{where}: the rows are the restored sampler's, yet the restarted job's weights differ from "
                           f"the uninterrupted job's by up to {err:.3g}: the restart path lost some state")


def check_resume_position(ctx, answer) -> None:
    box = [tempfile.mkdtemp(prefix="ch17_resume_") if ctx.rank == 0 else None, uuid.uuid4().hex[:12]]
    dist.broadcast_object_list(box, src=0)
    root, run_id = box
    try:
        for i, case in enumerate(RESUME_CASES):
            _resume_case(ctx, answer, case, os.path.join(root, f"case{i}"), f"ex17-{run_id}-{i}")
        dist.barrier()  # every rank is done with the folder before rank 0 removes it
    finally:
        if ctx.rank == 0:
            shutil.rmtree(root, ignore_errors=True)


CHECKS = {"resume_position": check_resume_position}


def main(ctx, exercise: str = "", answer=None):
    return run_exercise(ctx, CHECKS, exercise, answer)
