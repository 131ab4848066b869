"""Scratch folders for the files a notebook's experiments write (checkpoints, profiler traces).

They live under ``build/scratch/`` at the repository root (ignored by git) and are emptied each time they
are asked for, so rerunning a chapter replaces its files instead of piling up copies: a temporary
directory would be left behind whenever the kernel is stopped without running its finalizers, which is
how Jupyter and papermill stop kernels.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from course_utils.paths import ROOT

SCRATCH = ROOT / "build" / "scratch"
# torchrun writes each rank's stdout/stderr (what ``--tee`` streams back) and error.json under its log
# directory; without ``--log-dir`` that is a fresh ``torchelastic_*`` folder in the system temp directory per
# launch, which nothing removes. Each job gets ``build/scratch/torchelastic/<job id>`` instead, removed when
# the job closes, or by the reaper when its notebook died first.
TORCHELASTIC_LOGS = SCRATCH / "torchelastic"


def scratch_dir(name: str) -> Path:
    """An empty folder ``build/scratch/<name>`` (whatever an earlier run left there is removed first).

    ``COURSE_SCRATCH_DIR`` moves these folders elsewhere: two executions of the chapters at once (``make test``
    runs papermill and nbval side by side) must not empty each other's checkpoints."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name in (".", ".."):
        raise ValueError(f"scratch folder name {name!r}: use letters, digits, '_', '-' and '.' only")
    path = Path(os.environ.get("COURSE_SCRATCH_DIR") or SCRATCH) / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def job_log_dir(job_id: str) -> Path:
    """``build/scratch/torchelastic/<job_id>``: where one job's torchrun agents keep their log files."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", job_id) or job_id in (".", ".."):
        raise ValueError(f"job id {job_id!r}: use letters, digits, '_', '-' and '.' only")
    return TORCHELASTIC_LOGS / job_id


def remove_job_log_dir(path: str | Path) -> None:
    """Remove a folder made by ``job_log_dir``, in this checkout or another one, and nothing else.

    The reaper reads the path from a registry file, which a stray edit or another program could have
    changed: only a ``build/scratch/torchelastic/<job id>`` folder is ever deleted.
    """
    path = Path(path)
    *where, name = path.parts[-4:]
    if path.is_absolute() and where == ["build", "scratch", "torchelastic"] and name != "..":
        shutil.rmtree(path, ignore_errors=True)
