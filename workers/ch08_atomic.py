"""A save killed midway: what the naive writer leaves behind, and why the atomic one leaves nothing wrong.

    python workers/ch08_atomic.py --part save --writer atomic --step 1 --ckpt-dir /tmp/ck
    python workers/ch08_atomic.py --part save --writer atomic --step 2 --ckpt-dir /tmp/ck --kill-at-bytes 500000
    python workers/ch08_atomic.py --part scan --ckpt-dir /tmp/ck

``save`` writes the checkpoint of step ``step``: three files shaped like a real one (``model.pt``, then
``optimizer.pt`` twice its size as AdamW's two moments are, then ``meta.pt``), each tagged with its step.
``writer="naive"`` is ``torch.save`` straight to the final names in ``ckpt_dir/<name>`` (default the step's name;
``name="latest"`` saves over the previous checkpoint in place, as many scripts do). ``writer="atomic"`` stages,
fsyncs, writes the manifest last and renames (``checkpointing/atomic.py``). With ``kill_at_bytes`` (counted
over the whole save) or ``kill_after_file``, the rank SIGKILLs itself at that point of the write: the run then
fails with "died without a Python traceback", as a preempted job does.

``scan`` (a new process, after the crash) reports every entry of ``ckpt_dir``: does each file load, which step
does each file say it is from, is the manifest complete; then what a naive loader picks (the newest directory)
and what ``atomic.latest_valid`` picks, and whether each pick loads into one consistent step.
"""
from __future__ import annotations

import os

import torch

from workers.checkpointing import atomic
from workers.checkpointing.faults import KillAfterBytes, naive_save_dir
from workers.runtime import at_least, entrypoint, one_of, refusal

WRITERS = ("naive", "atomic")
FILES = ("model.pt", "optimizer.pt", "meta.pt")


def check_params(world_size, part, ckpt_dir, writer, step, kill_at_bytes, kill_after_file, how, **_):
    crash = (kill_at_bytes >= 0 or kill_after_file) and world_size != 1
    return refusal(one_of("part", part, ("save", "scan")),
                   None if ckpt_dir else
                   "ckpt_dir is empty: give the directory the checkpoints go to (a temporary directory is fine)",
                   one_of("writer", writer, WRITERS), at_least("step", step, 0),
                   one_of("kill_after_file", kill_after_file, ("",) + FILES),  # '': no kill after a file
                   f"a rank that kills itself leaves the other {world_size - 1} waiting in their next collective: "
                   "run the crash at world_size=1" if crash else None,
                   one_of("how", how, ("sigkill", "exit")))


def checkpoint_files(step: int, megabytes: float) -> dict:
    """The objects of step ``step``'s checkpoint: model 1/3 of the bytes, AdamW's two moments 2/3, a small meta."""
    n = max(1, int(megabytes * 2**20 / 4 / 3))  # fp32 numbers per tensor
    g = torch.Generator().manual_seed(step)
    return {"model.pt": {"step": step, "weights": torch.randn(n, generator=g)},
            "optimizer.pt": {"step": step, "exp_avg": torch.randn(n, generator=g),
                             "exp_avg_sq": torch.rand(n, generator=g)},
            "meta.pt": {"step": step, "config": {"megabytes": megabytes}}}


def _try_load(path: str) -> dict:
    try:
        obj = torch.load(path, weights_only=True)
        return {"loads": True, "step": obj.get("step"), "error": ""}
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return {"loads": False, "step": None, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}


def inspect_dir(path: str) -> dict:
    """Load every file of one checkpoint directory the way a naive loader would, and say what came out."""
    files = {name: {"bytes": os.path.getsize(os.path.join(path, name)), **_try_load(os.path.join(path, name))}
             for name in sorted(os.listdir(path)) if name in FILES}
    steps = {f["step"] for f in files.values() if f["loads"]}
    complete = set(files) == set(FILES) and all(f["loads"] for f in files.values())
    others = {name: os.path.getsize(os.path.join(path, name)) for name in sorted(os.listdir(path)) if name not in FILES}
    return {"files": files, "others": others, "all_load": complete, "consistent": complete and len(steps) == 1,
            "steps": sorted(s for s in steps if s is not None)}


def naive_latest(root: str) -> str | None:
    """What a typical script resumes from: ``latest`` if there is one, else the highest-named directory."""
    dirs = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)) and not d.startswith("."))
    if not dirs:
        return None
    return "latest" if "latest" in dirs else dirs[-1]


def _scan(ckpt_dir: str) -> dict:
    entries = []
    for e in atomic.scan(ckpt_dir):
        path = os.path.join(ckpt_dir, e["name"])
        entries.append({**e, **(inspect_dir(path) if os.path.isdir(path) else {})})
    naive = naive_latest(ckpt_dir)
    found = atomic.latest_valid(ckpt_dir)
    return {"entries": entries,
            "naive_pick": {"name": naive, **inspect_dir(os.path.join(ckpt_dir, naive))} if naive else None,
            "atomic_pick": ({"name": os.path.basename(found["path"]), "step": found["step"],
                             "skipped": found["skipped"], **inspect_dir(found["path"])} if found else None)}


def main(ctx, part: str = "save", ckpt_dir: str = "build/ch08/atomic", writer: str = "atomic", step: int = 1,
         name: str = "", kill_at_bytes: int = -1, kill_after_file: str = "", how: str = "sigkill",
         megabytes: float = 1.0):
    """``save`` one checkpoint (maybe dying midway), or ``scan`` what is on disk."""
    out = {"pid": os.getpid()}
    if ctx.rank != 0:
        return out  # one writer; the other ranks have nothing to do here
    if part == "scan":
        return {**out, **_scan(ckpt_dir)}
    os.makedirs(ckpt_dir, exist_ok=True)
    files = checkpoint_files(step, megabytes)
    fault = KillAfterBytes(kill_at_bytes, kill_after_file, how) if kill_at_bytes >= 0 or kill_after_file else None
    if writer == "naive":
        path = os.path.join(ckpt_dir, name or atomic.step_name(step))
        naive_save_dir(path, files, fault)
    else:
        path = atomic.save_checkpoint(ckpt_dir, step, files, fault=fault)
    return {**out, "path": os.path.basename(path), "files": {n: os.path.getsize(os.path.join(path, n))
                                                             for n in sorted(os.listdir(path))}}


if __name__ == "__main__":
    entrypoint(main)
