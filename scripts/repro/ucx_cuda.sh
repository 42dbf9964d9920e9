#!/usr/bin/env bash
# Why does a VRAM -> VRAM NIXL READ on one GPU node go over UCX tcp/lo? (device check of
# 2026-12-04 on one H200: kimi-linear p2d1 0.52 GB/s, "UCX transport: tcp/lo").
# Collects, into $OUT/ucx-cuda.tgz: whether UCX's CUDA modules load (dlopen, before and after
# torch has initialised CUDA), which libcudart the process maps, UCX's module-load and
# protocol-selection log of one bench run per UCX_TLS / library-path variant, and each run's GB/s.
#   run(carry=["build/device"], command="bash scripts/repro/ucx_cuda.sh")
set -uo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
PY=${PYTHON:-python3}
DEV=${DEV:-cuda}
W=$(mktemp -d /tmp/ucx-cuda-XXXXXX)
S=${OUT:-$W/out}
mkdir -p "$S"
if ! "$PY" -c "import nixl_cu13" 2>/dev/null; then
  tag=$("$PY" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
  "$PY" -m pip install -q --no-index --no-deps --target "$W/site" "$here"/build/device/nixl_cu13-*-"$tag"-*.whl
  export PYTHONPATH="$here:$W/site"
else
  export PYTHONPATH="$here"
fi
UCXD=$("$PY" -c 'import nixl_cu13, os; d=os.path.dirname(nixl_cu13.__file__); print(os.path.join(d + ".libs", "ucx"))')
TORCH_LIB=$("$PY" -c 'import os, nvidia; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))' 2>/dev/null || true)
{
  echo "== ucx modules: $UCXD"; ls "$UCXD"
  echo "== torch's nvidia lib dir: ${TORCH_LIB:-none}"; ls "${TORCH_LIB:-/nonexistent}" 2>&1 | head -30
  echo "== ldconfig"; ldconfig -p | grep -E "libcudart|libcuda\.so|libnvidia-ml" || echo "none in ldconfig"
  echo "== dlopen"
  "$PY" - "$UCXD" "$DEV" <<'EOF'
import ctypes, glob, os, sys
ucxd, dev = sys.argv[1], sys.argv[2]
mods = sorted(glob.glob(os.path.join(ucxd, "lib*cuda*.so.0.0.0")))
def try_all(tag):
    for m in mods:
        try:
            ctypes.CDLL(m)
            print(tag, os.path.basename(m), "loads")
        except OSError as e:
            print(tag, os.path.basename(m), "FAILS:", e)
try_all("before torch:")
if dev == "cuda":
    import torch
    torch.cuda.init(); torch.empty(1, device="cuda")
    maps = {l.split()[-1] for l in open("/proc/self/maps") if "cudart" in l or "libcuda.so" in l}
    print("mapped after torch:", sorted(maps))
    try_all("after torch:")
EOF
} > "$S/facts.txt" 2>&1

bench() {  # name, then env assignments
  local name=$1; shift
  mkdir -p "$W/$name"
  env "$@" UCX_PROTO_INFO=y UCX_LOG_FILE="$W/$name/ucx.%p.log" \
    timeout 120 "$PY" -m pdsweep.xfer.bench --model kimi-linear --prefill-tp 2 --decode-tp 1 \
    --block-size 128 --blocks 64 --iters 3 --device "$DEV" --plan fixed --mapping builtin \
    --models "$here/sweeps/models.yaml" --json "$W/$name/bench.json" > "$W/$name/stdout.txt" 2>&1
  echo "$name rc=$? $(grep -E '^transfer:' "$W/$name/stdout.txt" || tail -2 "$W/$name/stdout.txt")" | tee -a "$S/summary.txt"
  grep -h -iE "cuda|module|failed to load" "$W/$name"/ucx.*.log 2>/dev/null | sort | uniq -c | sort -rn | head -40 > "$W/$name/modules.txt"
}
bench default UCX_LOG_LEVEL=debug
bench no-tcp UCX_TLS=^tcp
bench cuda-tls UCX_TLS=cuda_ipc,cuda_copy,sm,self
[ -n "$TORCH_LIB" ] && bench ld-path LD_LIBRARY_PATH="$TORCH_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" UCX_LOG_LEVEL=debug
find "$W" -name 'ucx.*.log' -size +20M -exec sh -c 'gzip -9 "$1"' _ {} \;
tar czf "$S/ucx-cuda.tgz" -C "$W" --exclude=site --exclude=out .
cat "$S/facts.txt" "$S/summary.txt"
