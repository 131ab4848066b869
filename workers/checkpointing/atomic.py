"""Checkpoints a crash cannot corrupt: temporary name, fsync, one rename, a manifest written last.

A save can die at any byte (a preempted node, the OOM killer, a full disk). The rule that makes that safe:
**nothing under a final name is ever incomplete**. A file is written under a temporary name in the same
directory, flushed and ``os.fsync``-ed, then ``os.replace``-d onto its final name (one rename(2): readers see
the old file or the new one, never half of each); the directory is fsync-ed so the rename itself survives a
power cut. A checkpoint of several files (model, optimizer, one RNG file per rank) is built in a staging
directory ``.partial-step_XXXXXXXX``; when every file is there, ``MANIFEST.json`` (each file's size and sha256)
is written last, and the staging directory is renamed to ``step_XXXXXXXX``: that rename is the commit.

The loader trusts only committed directories whose manifest matches the files on disk, and takes the newest.
The manifest also catches what the rename cannot: a checkpoint copied file by file to other storage, or a
file damaged after the save. A naive save (``torch.save`` straight to the final name) has none of this: see
``faults.py``.

Nothing here needs a process group. With several ranks: rank 0 calls ``begin``, every rank writes its files
into the staging directory, a barrier, rank 0 calls ``commit``, a barrier.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile

import torch

MANIFEST = "MANIFEST.json"
STAGING_PREFIX = ".partial-"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_name(step: int) -> str:
    return f"step_{step:08d}"  # zero-padded: names sort in step order


def fsync_dir(path: str) -> None:
    """Make a rename (or a new file) in ``path`` durable: the directory entry is data too."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, write, fault=None) -> None:
    """``write(file)`` into a temporary file next to ``path``, fsync it, then rename it onto ``path``.

    Same directory, so same filesystem: ``os.replace`` across filesystems fails (EXDEV), and ``shutil.move``
    then falls back to a copy, which is not atomic. ``fault`` (``faults.KillAfterBytes``) wraps the file to
    kill this process mid-write in the demos.
    """
    directory, name = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(fault.wrap(f, name) if fault is not None else f)
            f.flush()  # python's buffer -> the kernel
            os.fsync(f.fileno())  # the kernel's page cache -> the disk, before the rename can be
        os.replace(tmp, path)  # the commit of this file: one rename(2)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)  # an exception (not a kill) can still clean up; a kill leaves the .tmp, which is ignored
        raise
    fsync_dir(directory)
    if fault is not None:
        fault.done(name)


def atomic_torch_save(obj, path: str, fault=None) -> None:
    atomic_write(path, lambda f: torch.save(obj, f), fault)


def file_digest(path: str, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_manifest(ckpt_dir: str, extra: dict | None = None) -> dict:
    """Record every file's size and sha256, atomically, as the last file of the checkpoint."""
    files = {name: {"bytes": os.path.getsize(os.path.join(ckpt_dir, name)),
                    "sha256": file_digest(os.path.join(ckpt_dir, name))}
             for name in sorted(os.listdir(ckpt_dir))
             if name != MANIFEST and not name.endswith(".tmp") and os.path.isfile(os.path.join(ckpt_dir, name))}
    manifest = {"format": 1, "files": files, **(extra or {})}
    atomic_write(os.path.join(ckpt_dir, MANIFEST), lambda f: f.write(json.dumps(manifest, indent=1).encode()))
    return manifest


def read_manifest(ckpt_dir: str) -> dict | None:
    try:
        with open(os.path.join(ckpt_dir, MANIFEST)) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def verify_checkpoint(ckpt_dir: str, check_hashes: bool = True) -> str | None:
    """None if ``ckpt_dir`` is a complete checkpoint, else the reason (one sentence) it is not."""
    if not os.path.exists(os.path.join(ckpt_dir, MANIFEST)):
        return f"no {MANIFEST}: not committed by the atomic writer, so it cannot be trusted"
    manifest = read_manifest(ckpt_dir)
    if manifest is None or "files" not in manifest:
        return f"{MANIFEST} is unreadable"
    for name, want in manifest["files"].items():
        path = os.path.join(ckpt_dir, name)
        if not os.path.isfile(path):
            return f"{name} is missing"
        size = os.path.getsize(path)
        if size != want["bytes"]:
            return f"{name} holds {size} bytes, the manifest says {want['bytes']}"
        if check_hashes and file_digest(path) != want["sha256"]:
            return f"{name}'s sha256 differs from the manifest (damaged after the save)"
    return None


def scan(root: str, check_hashes: bool = True) -> list[dict]:
    """Every entry under ``root``: its step (if it is named like a checkpoint) and why it is or is not valid."""
    out = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        match = _STEP_DIR.match(name)
        path = os.path.join(root, name)
        if match and os.path.isdir(path):
            reason = verify_checkpoint(path, check_hashes)
            out.append({"name": name, "step": int(match.group(1)), "valid": reason is None,
                        "reason": reason or "complete"})
        elif name.startswith(STAGING_PREFIX):
            out.append({"name": name, "step": None, "valid": False, "reason": "staging directory: never committed"})
        else:
            out.append({"name": name, "step": None, "valid": False, "reason": "not a checkpoint name"})
    return out


def latest_valid(root: str, check_hashes: bool = True) -> dict | None:
    """The newest complete checkpoint under ``root`` (``{"path", "step", "skipped"}``), or None if there is none.

    ``skipped`` lists the newer entries passed over, each with its reason: a partial save is never chosen.
    """
    entries = scan(root, check_hashes)
    skipped = []
    for e in sorted((e for e in entries if e["step"] is not None), key=lambda e: e["step"], reverse=True):
        if e["valid"]:
            return {"path": os.path.join(root, e["name"]), "step": e["step"], "skipped": skipped}
        skipped.append({"name": e["name"], "reason": e["reason"]})
    return None


def staging_path(root: str, step: int) -> str:
    return os.path.join(root, STAGING_PREFIX + step_name(step))


def begin(root: str, step: int) -> str:
    """A fresh, empty staging directory for ``step`` (one left by an earlier crash is removed first)."""
    staging = staging_path(root, step)
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    return staging


def commit(root: str, step: int, extra: dict | None = None) -> str:
    """Write the manifest (last), then rename the staging directory to ``step_XXXXXXXX``: the commit."""
    staging, final = staging_path(root, step), os.path.join(root, step_name(step))
    write_manifest(staging, {"step": step, **(extra or {})})
    fsync_dir(staging)
    trash = None
    if os.path.exists(final):  # the same step saved again (a rerun): rename(2) cannot replace a non-empty dir
        trash = os.path.join(root, f".trash-{step_name(step)}-{os.getpid()}")
        os.replace(final, trash)  # a crash here loses this step only; older checkpoints remain valid
    os.replace(staging, final)
    fsync_dir(root)
    if trash:
        shutil.rmtree(trash, ignore_errors=True)
    return final


def save_checkpoint(root: str, step: int, files: dict, extra: dict | None = None, fault=None) -> str:
    """Single-process convenience: stage every ``name -> object`` as a file, then commit."""
    os.makedirs(root, exist_ok=True)
    staging = begin(root, step)
    for name, obj in files.items():
        atomic_torch_save(obj, os.path.join(staging, name), fault)
    return commit(root, step, extra)

