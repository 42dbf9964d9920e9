#!/usr/bin/env bash
# The cp312 wheels the device check needs (docs/gpu-preflight.md), where a registry is reachable:
# build/device/ (carried to the device): nixl_cu13 trimmed by scripts/trim-nixl-wheel.py;
# build/py312/ (not carried; the device has them): numpy and PyYAML for the CPU dry run
# (tests/test_device_check_py312.py). Idempotent: a wheel already there is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
DL=("$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12
    --implementation cp "${PLAT[@]}")
mkdir -p build/device build/py312
"${DL[@]}" -d build/py312 numpy==2.3.5 pyyaml==6.0.3
if ! ls build/device/nixl_cu13-1.5.1-cp312-*.whl >/dev/null 2>&1; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "${DL[@]}" -d "$tmp" nixl-cu13==1.5.1
  "$PY" scripts/trim-nixl-wheel.py "$tmp"/nixl_cu13-1.5.1-cp312-*.whl build/device/
fi
ls -l build/device build/py312
