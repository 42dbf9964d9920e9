#!/usr/bin/env bash
# The GPU check for the day a GPU is at hand (docs/gpu-preflight.md): nvidia-smi facts,
# detect_gpus / busy-GPU detection against a torch process it starts, and `pdsweep bench
# transfer` with Kimi-Linear and GLM-5.3-Flash-4L geometry in GPU memory (p2d1, p4d1, p4d2 byte-verified; the
# unfixed plan refused) with the UCX transports used, and the torch KV digest's GB/s and estimated TTFT
# share (pdsweep.xfer.digestcheck); saved as JSON (OUT/device-check.json).
#
#   scripts/device-check.sh                 # on a GPU machine (one H200 is enough, < 8 min)
#   scripts/device-check.sh --device cpu    # the dry run: fake nvidia-smi, host memory (CI)
#
# No registry needed: a bare python >= 3.11 (+ torch on a GPU machine) is enough; NIXL (nixl_cu<torch's
# CUDA major>), numpy and PyYAML come from build/device (scripts/device-wheels.sh) when not importable.
# Env: PYTHON (default .venv/bin/python, else python3), OUT, NIXL_WHEEL, NIXL_WHEEL_DIR, CHECK_TIMEOUT_S.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
DEVICE=cuda
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --device=*) DEVICE="${1#*=}"; shift ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
case "$DEVICE" in cuda|cpu) ;; *) echo "device-check: --device cuda|cpu, got '$DEVICE'" >&2; exit 2 ;; esac
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$here/.venv/bin/python" ]; then PYTHON="$here/.venv/bin/python"; else PYTHON=python3; fi
fi
OUT=${OUT:-$here/results/device-check-$DEVICE}
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
# What the check imports beyond the standard library: NIXL built for torch's CUDA major (no torch or a
# CPU torch, as in the dry run: 13), numpy, PyYAML. Each one not importable is installed from its wheel
# for this interpreter (cpXY) in build/device (scripts/device-wheels.sh; carried to the device) into a
# temporary directory, pip --no-index --no-deps: no registry needed. One still missing fails here, named.
CUDA_MAJOR=$("$PYTHON" -c 'import torch; print((torch.version.cuda or "13").split(".")[0])' 2>/dev/null || echo 13)
export PDSWEEP_NIXL_MODULE=nixl_cu$CUDA_MAJOR
wdir=${NIXL_WHEEL_DIR:-$here/build/device}
tag=$("$PYTHON" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
missing=() wheels=() nowheel=()
for mod in "$PDSWEEP_NIXL_MODULE" numpy yaml; do
  "$PYTHON" -c "import $mod" 2>/dev/null && continue
  missing+=("$mod")
  dist=$mod; [ "$mod" = yaml ] && dist=pyyaml
  whl=$(ls "$wdir/$dist"-*-"$tag"-"$tag"-*.whl 2>/dev/null | head -1 || true)
  [ "$dist" = "$PDSWEEP_NIXL_MODULE" ] && whl=${NIXL_WHEEL:-$whl}
  if [ -n "$whl" ]; then wheels+=("$whl"); else nowheel+=("$mod"); fi
done
if [ ${#nowheel[@]} -gt 0 ]; then
  others=$(cd "$wdir" 2>/dev/null && ls ./*.whl 2>/dev/null | sed 's#^\./##' | tr '\n' ' ' || true)
  echo "device-check: FAILED: missing module(s) ${nowheel[*]} for $PYTHON ($tag, torch CUDA $CUDA_MAJOR) and no $tag" \
    "wheel for them in $wdir (found: ${others:-none}); where a registry is reachable: bash scripts/device-wheels.sh" >&2
  exit 2
fi
if [ ${#wheels[@]} -gt 0 ]; then
  site=$(mktemp -d /tmp/pdsweep-device-XXXXXX)
  "$PYTHON" -m pip install --quiet --no-index --no-deps --target "$site" "${wheels[@]}"
  export PYTHONPATH="$here:$site${PYTHONPATH#"$here"}"
  echo "device-check: ${missing[*]} from ${wheels[*]}"
fi
# the dry run: small sizes, pdsweep's copy of the TP mapping (no vLLM import per rank: seconds)
if [ "$DEVICE" = cpu ]; then set -- --blocks 2 --iters 1 --mapping builtin "${ARGS[@]+"${ARGS[@]}"}"; else set -- "${ARGS[@]+"${ARGS[@]}"}"; fi
exec timeout "${CHECK_TIMEOUT_S:-470}" "$PYTHON" "$here/scripts/device_check.py" --device "$DEVICE" --out "$OUT" "$@"
