"""Bitwise resume: N steps straight == k steps, save, a new process, load, N - k steps.

    torchrun --nproc-per-node 2 workers/ch08_resume.py --mode straight --steps 12
    torchrun --nproc-per-node 2 workers/ch08_resume.py --mode save --save-at 5 --ckpt-dir /tmp/run
    torchrun --nproc-per-node 2 workers/ch08_resume.py --mode resume --steps 12 --ckpt-dir /tmp/run
    torchrun --nproc-per-node 2 workers/ch08_resume.py --mode save --precision fp16 --omit scaler --ckpt-dir /tmp/f16

The run is ``workers/checkpointing/training.py`` under DDP: dropout, AdamW, warmup + cosine, a shuffled data
order with a position, numpy and python-random augmentation, every rank with its own RNG streams. ``save``
writes an atomic checkpoint (``checkpointing/atomic.py``) holding every part of ``checkpointing/state.py``:
rank 0 writes ``model_optim.pt`` (model, optimizer, scheduler, sampler, scaler, step, config: replicated under
DDP; the scaler too, since every rank sees the same all-reduced inf), every rank writes its own ``rng_rank_R.pt``.
``--omit rng,sampler`` leaves parts out of what is saved, so the resumed run falls back to what a fresh process
has (seeds from the start, position 0, warmup from step 0, zero Adam moments, a loss scale back at 65536) and
the notebook can watch the curves split.

``precision="fp16"`` trains under fp16 autocast with a ``torch.amp.GradScaler`` (``growth_interval=2``: the scale
doubles until the fp16 backward overflows, and those steps are skipped); each step records the scale it used
and whether it was skipped.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from workers.checkpointing import atomic
from workers.checkpointing.state import capture_training_state, restore_training_state
from workers.checkpointing.training import (RunConfig, flat_params, make_dataset, make_model, make_optimizer,
                                            make_sampler, make_scaler, make_scheduler, next_batch, rank_seed,
                                            seed_rngs, train_step)
from workers.runtime import at_least, batch_over_world, entrypoint, one_of, refusal

MODES = ("straight", "save", "resume")
OMITTABLE = ("rng", "sampler", "scheduler", "optimizer", "scaler")
PRECISIONS = ("fp32", "fp16")
SHARED_FILE = "model_optim.pt"


def _omit_list(omit: str) -> list[str]:
    return [p.strip() for p in omit.split(",") if p.strip()]


def check_params(world_size, mode, steps, save_at, ckpt_dir, omit, global_batch, precision, growth_interval, **_):
    omitted = _omit_list(omit)
    bad = [p for p in omitted if p not in OMITTABLE]
    return refusal(
        one_of("mode", mode, MODES), one_of("precision", precision, PRECISIONS),
        (why := at_least("growth_interval", growth_interval)) and f"{why} (good steps in a row before the scale grows)",
        batch_over_world(global_batch, world_size),
        None if 1 <= save_at < steps else
        f"save_at={save_at} must be at least 1 and below steps={steps}, so that there is something to resume",
        f"mode={mode!r} needs ckpt_dir: the directory the checkpoints go to (a temporary directory is fine)"
        if mode in ("save", "resume") and not ckpt_dir else None,
        f"omit={omit!r}: the parts that can be left out are {', '.join(OMITTABLE)}" if bad else None,
        "omit='scaler' needs precision='fp16': an fp32 run has no loss scaler to leave out"
        if "scaler" in omitted and precision != "fp16" else None)


def _config(steps, n_samples, global_batch, dropout, lr, warmup_steps, seed, precision, growth_interval) -> RunConfig:
    return RunConfig(n_samples=n_samples, global_batch=global_batch, dropout=dropout, lr=lr,
                     warmup_steps=warmup_steps, total_steps=steps, seed=seed, precision=precision,
                     growth_interval=growth_interval)


def _save(ctx, root: str, step: int, state: dict) -> dict:
    """Every rank writes its files into one staging directory; rank 0 commits once all are there."""
    if ctx.rank == 0:
        os.makedirs(root, exist_ok=True)
        atomic.begin(root, step)
    dist.barrier()
    staging = atomic.staging_path(root, step)
    rng = state.pop("rng", None)
    if ctx.rank == 0:
        atomic.atomic_torch_save(state, os.path.join(staging, SHARED_FILE))
    if rng is not None:
        atomic.atomic_torch_save({"rng": rng}, os.path.join(staging, f"rng_rank_{ctx.rank}.pt"))
    dist.barrier()  # every file is durable before the manifest lists it
    files = {}
    if ctx.rank == 0:
        final = atomic.commit(root, step, {"world_size": ctx.world_size})
        files = atomic.read_manifest(final)["files"]
    dist.barrier()
    return {"checkpoint": atomic.step_name(step), "files": {k: v["bytes"] for k, v in files.items()}}


def _load(ctx, root: str, cfg: RunConfig) -> tuple[dict, dict]:
    found = [atomic.latest_valid(root) if ctx.rank == 0 else None]
    dist.broadcast_object_list(found, src=0)  # one decision, even if a save is being written meanwhile
    if found[0] is None:
        raise FileNotFoundError(f"no complete checkpoint under {root}: run mode='save' first")
    path = found[0]["path"]
    state = torch.load(os.path.join(path, SHARED_FILE), weights_only=True)  # our RNG format loads with the default
    if state["config"] != cfg.as_dict():
        diff = {k: (v, cfg.as_dict()[k]) for k, v in state["config"].items() if cfg.as_dict()[k] != v}
        raise ValueError(f"the checkpoint was written with other settings {diff} (saved, now): "
                         "resume with the same ones")
    saved_world = atomic.read_manifest(path)["world_size"]
    if saved_world != ctx.world_size:
        raise ValueError(f"the checkpoint was written at world size {saved_world}, this run has {ctx.world_size}: a "
                         "bitwise resume needs the same ranks (each holds its own rows and RNG streams)")
    rng_file = os.path.join(path, f"rng_rank_{ctx.rank}.pt")
    if os.path.exists(rng_file):
        state["rng"] = torch.load(rng_file, weights_only=True)["rng"]
    return state, found[0]


def main(ctx, mode: str = "straight", steps: int = 12, save_at: int = 5, ckpt_dir: str = "", omit: str = "",
         seed: int = 0, dropout: float = 0.2, n_samples: int = 64, global_batch: int = 8, lr: float = 3e-3,
         warmup_steps: int = 3, precision: str = "fp32", growth_interval: int = 2):
    """Train (all of it, the first ``save_at`` steps and save, or resume and finish); return every step's record."""
    cfg = _config(steps, n_samples, global_batch, dropout, lr, warmup_steps, seed, precision, growth_interval)
    seed_rngs(rank_seed(cfg, ctx.rank))  # what a fresh process does; a resume then overwrites it from the checkpoint
    data = make_dataset(cfg)
    model = make_model(cfg).to(ctx.device)
    ddp = DDP(model, device_ids=[ctx.device.index] if ctx.is_cuda else None)
    optimizer = make_optimizer(model, cfg)
    scheduler = make_scheduler(optimizer, cfg)
    sampler = make_sampler(cfg, ctx.rank, ctx.world_size)
    scaler = make_scaler(cfg, ctx.device.type)  # None in fp32

    out: dict = {"pid": os.getpid(), "mode": mode}
    first, last = 1, (save_at if mode == "save" else steps)
    if mode == "resume":
        state, found = _load(ctx, ckpt_dir, cfg)
        info = restore_training_state(state, model, optimizer, scheduler, sampler, scaler=scaler)
        first = info["step"] + 1
        out.update(resumed_from=info["step"], restored=info["restored"], checkpoint=os.path.basename(found["path"]),
                   skipped=found["skipped"])
    out["start_weights"] = flat_params(model)  # [P]: after the load, before the first step of this run

    records = {"steps": [], "losses": [], "local_losses": [], "lrs": [], "weights": [], "indices": [], "scales": [],
               "skipped": []}
    for step in range(first, last + 1):
        batch = next_batch(data, sampler, cfg, ctx.device)
        lr_now = optimizer.param_groups[0]["lr"]
        scale = scaler.get_scale() if scaler is not None else 1.0  # the loss scale this step's backward uses
        loss = train_step(ddp, optimizer, scheduler, batch, scaler)
        records["scales"].append(scale)
        records["skipped"].append(scaler is not None and scaler.get_scale() < scale)  # backed off: inf, step skipped
        mean = loss.clone() / ctx.world_size
        dist.all_reduce(mean)  # the global loss (equal shards): identical on every rank
        records["steps"].append(step)
        records["losses"].append(mean.item())
        records["local_losses"].append(loss.item())
        records["lrs"].append(lr_now)
        records["weights"].append(flat_params(model))
        records["indices"].append(batch["indices"])
        ctx.metric(step=step, loss=mean.item(), lr=lr_now)
    out.update(steps=records["steps"], losses=torch.tensor(records["losses"]),  # [n] fp32, as computed
               local_losses=torch.tensor(records["local_losses"]),
               lrs=torch.tensor(records["lrs"], dtype=torch.float64),
               weights=torch.stack(records["weights"]),  # [n, P]
               indices=torch.stack(records["indices"]),  # [n, B/world]
               scales=records["scales"], skipped=records["skipped"])
    if scaler is not None:
        out["scaler_state"] = dict(scaler.state_dict())  # after the last step: what a save here would hold

    if mode == "save":
        omitted = _omit_list(omit)
        state = capture_training_state(model, optimizer, scheduler, sampler, step=save_at, scaler=scaler,
                                       config=cfg.as_dict(), omit=omitted)
        out["saved_parts"] = list(state)
        out.update(_save(ctx, ckpt_dir, save_at, state))
    return out


if __name__ == "__main__":
    entrypoint(main)
