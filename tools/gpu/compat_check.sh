#!/usr/bin/env bash
# Rehearse the GPU runner on this CPU machine, under the device image's versions, before spending device time.
#
#   bash tools/gpu/compat_check.sh          # about 3 GB of wheels the first time, then 2-3 minutes
#
# The lent H200 runs our tree under its own python3 (Python 3.12, torch 2.11.0+cu130, Triton 3.6.0, no
# Jupyter; /work/.library/device/KINDS.md), not under .venv's torch 2.13. A call there costs minutes of a
# 15-minute budget, so an API that torch 2.11 lacks, or a course_utils import that needs IPython, must fail
# here first. This builds a venv with those versions (build/compat-venv) and runs every stage of
# tools/gpu/run_all.sh at CPU sizes: the spine check at world 1 and 2 (expecting gloo on the CPU), the
# Megatron-vs-plain block bench and chapter 06 profile, the chapter 11 memory worker (DDP and ZeRO-1, world
# 1 and 2) and the FP8 worker's no-GPU answer, and the attention kernels under the Triton 3.6 interpreter plus
# their sm_90 compile. Exits non-zero if any of them fails.
#
# numpy is held below 2.5 here only because Triton 3.6's *interpreter* converts 1-element arrays with int(),
# which NumPy 2.5 refuses; compiled kernels on the GPU never take that path.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${COMPAT_VENV:-build/compat-venv}"
OUT="${OUT:-build/compat}"
PY312="$(command -v python3.12 || ls -d "$HOME"/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | tail -1)"
[ -n "$PY312" ] || { echo "compat_check: needs Python 3.12 (the device image's); none found" >&2; exit 2; }
if [ ! -x "$VENV/bin/python" ]; then
    "$PY312" -m venv "$VENV"
    "$VENV/bin/pip" install -q --no-cache-dir torch==2.11.0 triton==3.6.0 "numpy<2.5" psutil matplotlib pandas \
        pytest hypothesis
fi
PY="$VENV/bin/python"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
"$PY" -c "import torch, triton, sys; print('compat: python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
if "$PY" -c "import IPython" 2>/dev/null; then echo "compat: IPython is installed in $VENV, the device has none" >&2; exit 2; fi
fail=0
step() { echo "== $1"; shift; if ! "$@"; then echo "== FAILED"; fail=1; fi; }

step "spine: chapters 01-06 at world 1 and 2" \
    "$PY" tools/gpu/spine_check.py --expect cpu --chapters 01,02,03,04,05,06 --out "$OUT/spine_cpu.json"
step "tp: block bench and chapter 06 profile at CPU size" \
    "$PY" tools/gpu/tp_block_bench.py --profile --hidden 256 --heads 4 --shapes 64x2 --matmul 256 --iters 2 \
    --warmup 1 --dtype float32 --out "$OUT/tp_block_cpu.json"
step "ch11: memory worker (DDP, ZeRO-1; world 1, 2) and FP8 worker" "$PY" - <<'EOF'
import course_utils as cu
for world in (1, 2):
    for zero in (0, 1):
        res = cu.run("workers.ch11_memory", world_size=world, zero=zero, layers=2, hidden=128, heads=4,
                     vocab=512, seq=64, timeout=300)
        print(f"memory world {world} zero {zero}: {len(res[0]['moments'])} moments on {res.backend}")
gemm = cu.run("workers.ch11_fp8_gemm", world_size=1, timeout=120)[0]
assert gemm["available"] is False and "no GPU" in gemm["reason"], gemm
cu.shutdown_pools()
EOF
step "attention: kernels under the Triton 3.6 interpreter, sm_90 compile, FP8 helpers" \
    "$PY" -m pytest -q -p no:cacheprovider tests/test_attention.py tests/test_attention_triton.py \
    tests/test_attention_triton_compile.py tests/test_attention_bench.py tests/test_fp8.py
exit $fail
