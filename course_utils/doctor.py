"""``python -m course_utils.doctor``: what this machine has, and what the course will use on it."""
from __future__ import annotations

import importlib.util
import os
import platform
import sys


def _version(module: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return None
    try:
        return getattr(__import__(module), "__version__", "installed")
    except Exception as exc:  # noqa: BLE001 - a broken optional install is worth reporting, not crashing on
        return f"present but fails to import ({type(exc).__name__}: {exc})"


# The README's "Hardware" table: which row a learner is on (a cluster is several machines: torchrun's business).
HARDWARE_ROWS = {0: "a CPU only", 1: "one GPU"}


def hardware_row(n_gpus: int) -> str:
    """The README's Hardware row for a machine with ``n_gpus`` GPUs."""
    return HARDWARE_ROWS.get(n_gpus, "several GPUs")


def plan_for(world_size: int) -> str:
    """What the rank runtime (workers/runtime.py) picks for ``world_size`` ranks on this one machine, in its words;
    the devices are added where a GPU is involved (on the CPU the reason already says where the ranks run)."""
    from workers.runtime import select_placement

    devices = [select_placement(r, world_size).device for r in range(world_size)]
    why = select_placement(0, world_size).why
    return why if all(d == "cpu" for d in devices) else f"{why} (ranks on {', '.join(devices)})"


def report() -> list[tuple[str, str]]:
    import torch
    import torch.distributed as dist

    from course_utils.validate import max_world_size

    cuda = torch.cuda.is_available()
    n_gpus = torch.cuda.device_count() if cuda else 0
    rows = [
        ("hardware row", f"{hardware_row(n_gpus)} (README, Hardware): the labs run with world sizes 1 to "
                         f"{max_world_size()} on this machine"),
        ("python", f"{sys.version.split()[0]} ({platform.machine()}, {os.cpu_count()} CPU cores)"),
        ("torch", torch.__version__),
        ("CUDA", f"{torch.version.cuda} with {n_gpus} GPU(s)" if cuda else "not available (CPU build or no GPU)"),
    ]
    for i in range(n_gpus):
        props = torch.cuda.get_device_properties(i)
        rows.append((f"  GPU {i}", f"{props.name}, {props.total_memory / 2**30:.0f} GiB"))
    nccl = dist.is_nccl_available()
    nccl_version = ".".join(map(str, torch.cuda.nccl.version())) if nccl and cuda else None
    rows += [
        ("gloo", "available" if dist.is_gloo_available() else "MISSING: multi-rank labs cannot run"),
        ("NCCL", nccl_version or ("built in, but no GPU" if nccl else "not available")),
        ("Triton", _version("triton") or "not installed (chapter 07 uses its PyTorch kernel instead)"),
        ("flash-attn", _version("flash_attn") or "not installed (optional)"),
    ]
    for ws in (1, 2, 4, 8):
        rows.append((f"world size {ws}", plan_for(ws)))
    return rows


def main() -> None:
    rows = report()
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


if __name__ == "__main__":
    main()
