#!/usr/bin/env bash
# The GPU check for the day a GPU is at hand (docs/gpu-preflight.md): nvidia-smi facts,
# detect_gpus / busy-GPU detection against a torch process it starts, and `pdsweep bench
# transfer` with Kimi-Linear and GLM-5.3-Flash-4L geometry in GPU memory (p2d1, p4d1, p4d2 byte-verified; the
# unfixed plan refused) with the UCX transports used; saved as JSON (OUT/device-check.json).
#
#   scripts/device-check.sh                 # on a GPU machine (one H200 is enough, < 8 min)
#   scripts/device-check.sh --device cpu    # the dry run: fake nvidia-smi, host memory (CI)
#
# No registry needed: when nixl_cu13 is not importable, the trimmed wheel
# (build/device/nixl_cu13-*.whl, made by scripts/trim-nixl-wheel.py) is installed into a
# temporary directory with pip --no-index --no-deps. Needs python3 with torch and numpy.
# Env: PYTHON (default .venv/bin/python, else python3), OUT, NIXL_WHEEL, CHECK_TIMEOUT_S.
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
if ! "$PYTHON" -c "import nixl_cu13" 2>/dev/null; then
  # the wheel built for this interpreter (cpXY tag): a cp311 wheel does not install on python 3.12
  wdir=${NIXL_WHEEL_DIR:-$here/build/device}
  tag=$("$PYTHON" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
  whl=${NIXL_WHEEL:-$(ls "$wdir"/nixl_cu13-*-"$tag"-"$tag"-*.whl 2>/dev/null | head -1 || true)}
  if [ -z "$whl" ]; then
    others=$(cd "$wdir" 2>/dev/null && ls nixl_cu13-*.whl 2>/dev/null | tr '\n' ' ' || true)
    echo "device-check: nixl_cu13 not importable and no nixl_cu13 wheel for $tag in $wdir (found: ${others:-none});" \
      "pip download --no-deps nixl-cu13==1.5.1 --python-version ${tag#cp} --only-binary=:all: then scripts/trim-nixl-wheel.py" >&2
    exit 2
  fi
  site=$(mktemp -d /tmp/pdsweep-nixl-XXXXXX)
  "$PYTHON" -m pip install --quiet --no-index --no-deps --target "$site" "$whl"
  export PYTHONPATH="$here:$site${PYTHONPATH#"$here"}"
  echo "device-check: nixl_cu13 from $whl"
fi
# the dry run: small sizes, pdsweep's copy of the TP mapping (no vLLM import per rank: seconds)
if [ "$DEVICE" = cpu ]; then set -- --blocks 2 --iters 1 --mapping builtin "${ARGS[@]+"${ARGS[@]}"}"; else set -- "${ARGS[@]+"${ARGS[@]}"}"; fi
exec timeout "${CHECK_TIMEOUT_S:-470}" "$PYTHON" "$here/scripts/device_check.py" --device "$DEVICE" --out "$OUT" "$@"
