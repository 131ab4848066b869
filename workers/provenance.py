"""Where a measurement came from: one record, written by every script that writes a measurement.

``record()`` returns a flat, JSON-serialisable dict; a writer stores it under the key ``"provenance"`` of its
output, next to its own measurement fields, and ``course_utils.reference_data.label`` is the one reader that
turns it into a caption. The schema (every key always present):

============== ============================================================================================
device         the GPU's name (``torch.cuda.get_device_name``: "NVIDIA H200"), or the CPU's model name
               followed by " (CPU)" ("AMD EPYC 9654 96-Core Processor (CPU)")
device_kind    "cuda" or "cpu"
torch          ``torch.__version__``
cuda           ``torch.version.cuda`` (the CUDA torch was built with), None for a CPU build
triton         Triton's version, or None when it is not installed (never imported unless needed)
python         ``platform.python_version()``
cpu_capability the ATen CPU kernels this process runs: ``torch.backends.cpu.get_cpu_capability()`` (AVX512,
               AVX2, DEFAULT, SVE256...): it decides CPU numbers bit for bit, so it is recorded on GPUs too
date           when the record was made, UTC, ISO 8601 to the second ("2026-12-02T14:03:00+00:00")
command        the command that produced the measurement: the one given, else ``sys.argv`` joined
============== ============================================================================================

No host name, user name or home directory: absolute paths in the command are shown relative to the
repository (or by their file name), so a committed record carries nothing personal.

Rank side: this module must not import ``course_utils`` (the notebook side imports it, not the reverse).
"""
from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIELDS = ("device", "device_kind", "torch", "cuda", "triton", "python", "cpu_capability", "date", "command")


def cpu_model() -> str:
    """The processor's model name (Linux: /proc/cpuinfo), else what the platform module knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def triton_version() -> str | None:
    for dist in ("triton", "pytorch-triton", "pytorch-triton-rocm"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    try:  # a source build without distribution metadata
        import triton

        return getattr(triton, "__version__", None)
    except Exception:  # noqa: BLE001 - absent or broken: not installed for our purpose
        return None


def _anonymous(arg: str) -> str:
    """An argument with no absolute path in it: relative to the repository, else the file's name."""
    if not os.path.isabs(arg):
        return arg
    path = Path(arg)
    try:
        return str(path.resolve().relative_to(ROOT))
    except (ValueError, OSError):
        return path.name


def command_line(argv: list[str] | None = None) -> str:
    argv = list(sys.argv if argv is None else argv)
    return shlex.join(_anonymous(a) for a in argv) if argv else ""


def record(command: str | None = None, *, device=None) -> dict:
    """The provenance of a measurement made now, in this process. ``device``: the device measured ("cuda",
    "cuda:1", "cpu", a ``torch.device``); default: the first GPU if one is visible, else the CPU."""
    import torch

    kind = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda":
        index = torch.device(device).index if device is not None else None
        name = torch.cuda.get_device_name(index or 0)
    else:
        kind, name = "cpu", f"{cpu_model()} (CPU)"
    return {
        "device": name,
        "device_kind": kind,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version(),
        "python": platform.python_version(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command if command is not None else command_line(),
    }
