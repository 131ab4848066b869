"""Chapter 08's whole training state, saved and loaded with DCP (``torch.distributed.checkpoint``).

One checkpoint is a folder ``step_{S:06d}`` that every rank writes into together (``dcp.save``): the model and AdamW
as DCP state dicts (``get_state_dict``: keys without DDP's ``module.`` prefix; replicated tensors written once), the
schedule, the data order's position and the step (the same on every rank, written once), and each rank's RNG streams
under a key of its own (``rng_rank{R}``: ranks draw different dropout masks and noise, chapter 08). DCP writes
``.metadata`` last, to a temporary name it then renames, after every rank's data is written: a folder without it is a
save that was cut short, and ``latest_complete`` skips it.

Loading fills a template of the same structure in place: the fresh objects' own state dicts (``get_state_dict`` also
creates AdamW's zero moments, so DCP knows their shapes), then puts each part back, the RNG last.
"""
from __future__ import annotations

import os
import re
import shutil

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from workers.checkpointing.state import rng_state, set_rng_state

STEP_DIR = re.compile(r"^step_(\d{6})$")


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:06d}")


def latest_complete(root: str) -> tuple[int, str] | None:
    """The newest checkpoint whose ``.metadata`` exists (DCP writes it last): (step, folder), or None."""
    found = sorted((int(m.group(1)), os.path.join(root, name)) for name in (os.listdir(root) if os.path.isdir(root)
                   else []) if (m := STEP_DIR.match(name)) and os.path.exists(os.path.join(root, name, ".metadata")))
    return found[-1] if found else None


def clear(root: str) -> None:
    """Remove this worker's checkpoints and journal from ``root`` (and nothing else a learner may keep there)."""
    for name in os.listdir(root) if os.path.isdir(root) else []:
        if STEP_DIR.match(name) or name == "journal":
            shutil.rmtree(os.path.join(root, name))


def _state(model, optimizer, scheduler, sampler, rank: int, step: int, config: dict) -> dict:
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd, "scheduler": scheduler.state_dict(), "sampler": sampler.state_dict(),
            f"rng_rank{rank}": rng_state(), "step": step, "config": dict(config)}


def save(root: str, step: int, model, optimizer, scheduler, sampler, rank: int, config: dict,
         after_write=None) -> str:
    """Every rank calls it after step ``step``; returns the folder once every rank's part and the metadata are written.

    ``after_write`` (chapter 17's torn save): called on this rank once its own files are written, before DCP's last
    phase, in which the coordinator collects every rank's write results and writes ``.metadata``."""
    path = step_dir(root, step)
    writer = dcp.FileSystemWriter(path) if after_write is None else _WriteThen(path, after_write)
    dcp.save(_state(model, optimizer, scheduler, sampler, rank, step, config), storage_writer=writer)
    return path


class _WriteThen(dcp.FileSystemWriter):
    """A FileSystemWriter that calls ``then()`` once this rank's data is on disk."""

    def __init__(self, path: str, then):
        super().__init__(path)
        self._then = then

    def write_data(self, plan, planner):
        written = super().write_data(plan, planner)
        written.wait()  # the files are closed (and fsynced: FileSystemWriter's default) before the strike
        self._then()
        return written


def incomplete(root: str) -> list[int]:
    """Steps whose folder exists without ``.metadata``: saves cut short, which ``latest_complete`` passes over."""
    return sorted(int(m.group(1)) for name in (os.listdir(root) if os.path.isdir(root) else [])
                  if (m := STEP_DIR.match(name)) and not os.path.exists(os.path.join(root, name, ".metadata")))


def find(root: str, rank: int) -> tuple[int, str] | None:
    """Rank 0 picks the checkpoint and every rank takes its choice: ranks must never load different steps."""
    choice = [latest_complete(root) if rank == 0 else None]
    dist.broadcast_object_list(choice, src=0)
    return choice[0]


def load(path: str, model, optimizer, scheduler, sampler, rank: int, config: dict) -> tuple[int, int]:
    """Fill the fresh objects from the checkpoint at ``path``; returns the step it was written after and the world
    size that wrote it.

    The world may have shrunk since (a lost node, chapter 17): DDP's weights and AdamW's moments are replicated, DCP
    wrote them once and reads them back into any number of ranks; the data position is global (the next global
    batch, split over the ranks there are now); each rank takes its own saved RNG streams, and those of ranks that
    are gone stay in the folder unread."""
    state = _state(model, optimizer, scheduler, sampler, rank, -1, config)
    dcp.load(state, checkpoint_id=path)  # tensors in place; the rest (schedule, position, step) replaced
    saved = dict(state["config"])
    if {k: v for k, v in saved.items() if k != "world_size"} != {k: v for k, v in config.items() if k != "world_size"}:
        diff = {k: (v, config.get(k)) for k, v in saved.items() if config.get(k) != v and k != "world_size"}
        raise ValueError(f"the checkpoint in {path} was written with other settings {diff} (saved, now): resume with "
                         "the same ones, or give an empty ckpt_dir")
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(state["scheduler"])
    sampler.load_state_dict(state["sampler"])
    set_rng_state(state[f"rng_rank{rank}"])  # last: nothing after it may draw a random number before the next step
    return int(state["step"]), int(saved.get("world_size", config.get("world_size", 0)))
