#!/usr/bin/env bash
# The cp312 wheels the device check needs (docs/gpu-preflight.md), where a registry is reachable, into
# build/device/ (carried to the device: run(carry=["build/device"]); 30 MiB, the tracked tree 23 MiB, of
# the 64 MiB the two may take): nixl_cu<DEVICE_CUDA> trimmed by scripts/trim-nixl-wheel.py (13.6 MiB;
# DEVICE_CUDA=12 for a device whose torch is a CUDA 12 build: device-check.sh installs the one for torch's
# CUDA major; one at a time, both do not fit), numpy and PyYAML as PyPI ships them (15.8 + 0.8 MiB): a bare
# python 3.12 + torch machine needs nothing else (tests/test_device_check_py312.py).
# Idempotent: a wheel already there is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
NIXL=$(sed -n 's/^nixl-cu13==\([0-9.]*\).*/\1/p' constraints/gpu.txt)
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
DL=("$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12
    --implementation cp "${PLAT[@]}")
mkdir -p build/device
ls build/device/numpy-2.3.5-cp312-*.whl >/dev/null 2>&1 || "${DL[@]}" -d build/device numpy==2.3.5
ls build/device/pyyaml-6.0.3-cp312-*.whl >/dev/null 2>&1 || "${DL[@]}" -d build/device pyyaml==6.0.3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cu=${DEVICE_CUDA:-13}
rm -f build/device/nixl_cu$((25 - cu))-*.whl  # the other CUDA major's: both would travel
if ! ls "build/device/nixl_cu$cu-$NIXL-cp312-"*.whl >/dev/null 2>&1; then
  "${DL[@]}" -d "$tmp" "nixl-cu$cu==$NIXL"
  "$PY" scripts/trim-nixl-wheel.py "$tmp/nixl_cu$cu-$NIXL-cp312-"*.whl build/device/
fi
rm -rf build/py312  # the numpy and PyYAML wheels lived here (not carried) before they moved to build/device
ls -l build/device
