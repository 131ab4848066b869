#!/usr/bin/env bash
# Every GPU measurement that issues 2-5 ask for, prepared for a session that is lent the H200.
#
#   bash tools/gpu/run_all.sh spine,tp          # first device call  (about 5 minutes)
#   bash tools/gpu/run_all.sh attention,ch11    # second device call (about 5 minutes)
#
# Through the device tool: run(command="bash tools/gpu/run_all.sh spine,tp", timeout_s=560), then the second
# call while the machine is still warm, then give_back. One command may run 10 minutes at most and a session
# has 15 minutes of device time, so the four stages are split in two calls and each stage has its own limit:
#
#   spine      tools/gpu/spine_check.py: chapter 01-06 workers at world 1 (NCCL) and 2 (gloo on CUDA)  (issue 2;
#              04-06 also exercise the host-staged all_gather/reduce_scatter of the one-GPU path)
#   tp         tools/gpu/tp_block_bench.py --profile: Megatron block vs plain block, memory       (issue 5)
#   attention  workers.attention.bench --quick --no-autotune: the Triton kernels vs SDPA            (issue 3)
#   ch11       tools/gpu/ch11_memory.sh: ZeRO memory at four moments, FP8 GEMM                      (issue 4)
#
# Rehearse first on the CPU, under the device image's versions: bash tools/gpu/compat_check.sh.
#
# Results go to $OUT (the device tool's folder; build/gpu elsewhere) laid out as in the repository, so that
#   cp -r "$OUT"/data/. data/
# puts each file where its notebook reads it: data/gpu/spine_h200.json, data/gpu/tp_block_h200.json,
# data/gpu/ch11_memory_h200.json, data/gpu/ch11_fp8_gemm_h200.json, data/attention/h200_<date>.json; each JSON
# carries a "provenance" record (workers/provenance.py); run_all_<stages>.log sits beside data/. Then re-execute chapters
# 06, 07 and 11 and commit. A failing stage is logged and the next runs.
set -uo pipefail
cd "$(dirname "$0")/../.."
STAGES="${1:-spine,tp,attention,ch11}"
OUT="${OUT:-build/gpu}"
PY="${PY:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3  # the device image's python3 holds torch; the course package is used from the tree
export PY PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "run_all: no GPU visible to $PY; these files would be named for the H200, so nothing is run." \
         "To rehearse on a CPU, use bash tools/gpu/compat_check.sh" >&2
    exit 2
fi
mkdir -p "$OUT/data/gpu" "$OUT/data/attention"
LOG="$OUT/run_all_${STAGES//,/_}.log"

stage() {  # stage NAME LIMIT_S COMMAND...
    local name=$1 limit=$2; shift 2
    case ",$STAGES," in *",$name,"*) ;; *) return 0 ;; esac
    echo "== $name (limit ${limit} s): $*" | tee -a "$LOG"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$LOG"
}

{ echo "run_all $STAGES at $(date -u +%FT%TZ), git $(git rev-parse --short HEAD 2>/dev/null)";
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null;
  "$PY" -c "import json; from workers.provenance import record; print(json.dumps(record('bash tools/gpu/run_all.sh $STAGES')))"; } | tee "$LOG"

stage spine 240 "$PY" tools/gpu/spine_check.py --chapters 01,02,03,04,05,06 --out "$OUT/data/gpu/spine_h200.json"
stage tp 240 "$PY" tools/gpu/tp_block_bench.py --profile --out "$OUT/data/gpu/tp_block_h200.json"
stage attention 270 "$PY" -m workers.attention.bench --quick --no-autotune --out "$OUT/data/attention/h200_$(date -u +%F).json"
if stage ch11 270 bash tools/gpu/ch11_memory.sh; then
    case ",$STAGES," in *",ch11,"*) cp data/gpu/ch11_memory_*.json data/gpu/ch11_fp8_gemm_*.json "$OUT/data/gpu/" 2>/dev/null ;; esac
fi
ls -lR "$OUT/data" | tee -a "$LOG"
