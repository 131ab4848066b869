"""Scratch folders for the files a notebook's experiments write (checkpoints, profiler traces).

They live under ``build/scratch/`` at the repository root (ignored by git) and are emptied each time they
are asked for, so rerunning a chapter replaces its files instead of piling up copies: a temporary
directory would be left behind whenever the kernel is stopped without running its finalizers, which is
how Jupyter and papermill stop kernels.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRATCH = ROOT / "build" / "scratch"


def scratch_dir(name: str) -> Path:
    """An empty folder ``build/scratch/<name>`` (whatever an earlier run left there is removed first)."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name in (".", ".."):
        raise ValueError(f"scratch folder name {name!r}: use letters, digits, '_', '-' and '.' only")
    path = SCRATCH / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path
