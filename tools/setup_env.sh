#!/usr/bin/env bash
# Create .venv at the repository root and install the course into it.
# A machine without an NVIDIA GPU gets the CPU build of torch (a few hundred MB instead of several GB).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "${pip[@]}" install "torch==${TORCH_VERSION}"            # CUDA build from the default index
  elif ls /opt/wheels/torch-"${TORCH_VERSION}"+cpu-*.whl >/dev/null 2>&1; then
    "${pip[@]}" install "torch==${TORCH_VERSION}"            # this machine keeps the CPU wheel on disk
  else
    "${pip[@]}" install "torch==${TORCH_VERSION}" --index-url "${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
  fi
fi
"${pip[@]}" install -e ".[test]" --config-settings editable_mode=compat
.venv/bin/python -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (course)" >/dev/null
touch .venv/.installed
echo "environment ready: $(.venv/bin/python -c 'import torch,sys; print("python", sys.version.split()[0], "torch", torch.__version__)')"
