#!/usr/bin/env bash
# Chapter 11's GPU measurements, for a session that has a GPU (for example through the course's device tool):
#
#   bash tools/gpu/ch11_memory.sh
#
# 1. workers/ch11_memory.py, a ~1.1B-parameter GPT (l=20, h=2048, V=32000, s=2048, bf16 with fp32 master
#    weights and AdamW), DDP (zero=0) and ZeRO-1 (zero=1), at world 1 (NCCL) and world 2 (two ranks
#    on one GPU: gloo on CUDA tensors): torch.cuda.memory_allocated after init, forward, backward and step, with
#    the accounted tensor bytes next to it;
# 2. workers/ch11_fp8_gemm.py: an 8192^3 GEMM in bf16 and in FP8 (torch._scaled_mm), time and error.
#
# Writes data/gpu/ch11_memory_<gpu>.json and data/gpu/ch11_fp8_gemm_<gpu>.json (<gpu> = h200 on an H200), each
# with its provenance (workers/provenance.py: device, versions, date, this command); commit them, and chapter 11 plots
# them. A run that fails is recorded with its error instead of stopping the others. About 3 minutes on an H200.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PY:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
mkdir -p data/gpu
"$PY" - <<'PYEOF'
import json
import subprocess

import torch

import course_utils as cu
from course_utils.bench import gpu_slug
from workers.provenance import record

if not torch.cuda.is_available():
    raise SystemExit("no GPU visible: run this script on a machine with a GPU")
name = torch.cuda.get_device_name(0)
slug = gpu_slug(name)  # "h200" on an H200: the name chapter 11 looks for first
try:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
except OSError:
    commit = ""
header = {"provenance": record("bash tools/gpu/ch11_memory.sh"), "gpu_count": torch.cuda.device_count(),
          "git_commit": commit}

runs = []
for world, zero in ((1, 0), (1, 1), (2, 0), (2, 1)):
    for grad_sync in ("reduce_scatter", "all_reduce"):
        try:
            res = cu.run("workers.ch11_memory", world_size=world, zero=zero, grad_sync=grad_sync, timeout=900)
            runs.append({"world_size": world, "zero": zero, "grad_sync": grad_sync, "backend": res.backend,
                         "ranks": res.ranks})
            print(f"memory: world {world} zero {zero} ({res.backend}, {grad_sync}): ok", flush=True)
            break
        except Exception as exc:  # noqa: BLE001 - record it, try the next setting
            runs.append({"world_size": world, "zero": zero, "grad_sync": grad_sync,
                         "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"})
            print(f"memory: world {world} zero {zero} ({grad_sync}) FAILED: {runs[-1]['error']}", flush=True)
            if zero == 0:
                break  # DDP does not reduce-scatter; nothing else to try
with open(f"data/gpu/ch11_memory_{slug}.json", "w") as f:
    json.dump({**header, "runs": runs}, f, indent=1)

try:
    gemm = cu.run("workers.ch11_fp8_gemm", world_size=1, timeout=600)[0]
except Exception as exc:  # noqa: BLE001
    gemm = {"available": False, "error": f"{type(exc).__name__}: {exc}"}
with open(f"data/gpu/ch11_fp8_gemm_{slug}.json", "w") as f:
    json.dump({**header, **gemm, "provenance": record("bash tools/gpu/ch11_memory.sh (workers/ch11_fp8_gemm.py)")},
              f, indent=1)
print(f"wrote data/gpu/ch11_memory_{slug}.json and data/gpu/ch11_fp8_gemm_{slug}.json", flush=True)
cu.shutdown_pools()
PYEOF
