"""The Triton kernels compile for a Hopper GPU (sm_90) on a machine without one.

The interpreter tests check the arithmetic; they cannot see what only the compiler sees: a loop-carried value
that changes type, a mask of the wrong shape in compiled control flow, a config that overflows shared
memory. Triton ships ptxas, so we compile here, in a subprocess (the test process may have turned on the
interpreter, which is decided at import time), with the smallest config of each kernel to keep this quick.
The paths compiled cover every masking mode: forward non-causal (unmasked + ragged tail), dK/dV causal
(diagonal + unmasked + tail), dQ causal (unmasked + diagonal); and the backward's preprocess kernel.
"""
import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton", reason="triton is not installed: the Triton path is optional")

from course_utils.paths import ROOT  # noqa: E402

HOPPER_SHARED_MEMORY = 227 * 1024  # the most one thread block may use on an H100/H200

SCRIPT = """
import json
from workers.attention import triton_kernels as tk
report = {}
for name, cfg, causal in (("fwd", tk._cfg(64, 64, 4, 2), False), ("dkdv", tk._cfg(32, 64, 4, 2), True),
                          ("dq", tk._cfg(64, 32, 4, 2), True)):
    ck = tk.compile_for_gpu(name, cfg, head_dim=64, causal=causal, arch=90)
    ttgir = ck.asm["ttgir"]
    report[name] = {"shared": ck.metadata.shared, "wgmma": ttgir.count("warp_group_dot "),
                    "async_copies": ttgir.count("async_copy_global_to_local")}
ck = tk.compile_for_gpu("preprocess", {"BLOCK_M": tk.PREPROCESS_BLOCK_M, "num_warps": 4, "num_stages": 1},
                        head_dim=64, arch=90)
report["preprocess_compiled"] = "ttgir" in ck.asm
import torch
if not torch.cuda.is_available():  # compiled kernels and CPU tensors: one sentence saying what to do
    try:
        tk.triton_flash_attention(*(torch.zeros(1, 1, 8, 16) for _ in range(3)))
    except RuntimeError as exc:
        report["cpu_error"] = str(exc)
print(json.dumps(report))
"""


def test_kernels_compile_for_hopper():
    from triton.backends import backends
    if "nvidia" not in backends:
        pytest.skip("this triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset; 1 is its current default
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report.pop("preprocess_compiled") is True
    cpu_error = report.pop("cpu_error", None)
    if cpu_error is not None:
        assert "TRITON_INTERPRET=1" in cpu_error and "impl='torch'" in cpu_error
    for name, r in report.items():
        assert 0 < r["shared"] <= HOPPER_SHARED_MEMORY, (name, r)
        # Hopper's warpgroup MMA (wgmma), not the older mma.sync path, for every matmul of the kernel
        assert r["wgmma"] >= 4, (name, r)
        # loads pipelined through shared memory (cp.async), which needs the 16-byte alignment hints
        assert r["async_copies"] > 0, (name, r)


DEFAULTS_SCRIPT = """
import json
from workers.attention import triton_kernels as tk
rows = []
for name, configs in tk.GPU_CONFIGS.items():
    for head_dim in (64, 128):
        for causal in (False, True):
            ck = tk.compile_for_gpu(name, configs[0], head_dim=head_dim, causal=causal, arch=90)
            rows.append({"kernel": name, "head_dim": head_dim, "causal": causal, **tk.resource_usage(ck)})
bad = tk.compile_for_gpu("dkdv", tk._cfg(32, 128, 4, 5), head_dim=128, causal=True, arch=90)
print(json.dumps({"defaults": rows, "tutorial_dkdv_d128": tk.resource_usage(bad)}))
"""


def test_default_configs_do_not_spill_registers():
    """``--no-autotune`` (the short GPU lease's first run) uses each kernel's first config: none may spill.

    The check is the cubin's stack frame (``resource_usage``); the 4-warp 32x128 dK/dV tile, which spills about
    3 KB a thread at d = 128, is compiled too, so a reader that always says zero would fail here.
    """
    from triton.backends import backends
    if "nvidia" not in backends:
        pytest.skip("this triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", DEFAULTS_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(report["defaults"]) == 12
    for row in report["defaults"]:
        assert row["spill_stack_bytes"] == 0 and row["registers"] <= 255, row
        assert 0 < row["shared_bytes"] <= HOPPER_SHARED_MEMORY, row
    assert report["tutorial_dkdv_d128"]["spill_stack_bytes"] > 500, report["tutorial_dkdv_d128"]
