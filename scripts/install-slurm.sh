#!/usr/bin/env bash
# Install what the Slurm tests need (tests/_slurm.py starts a private single-node cluster):
# Debian's slurmctld, slurmd, slurm-client and munge (Slurm 22.05 on bookworm; ~10 s).
# Idempotent: does nothing when every program is already on PATH. Needs root and apt-get;
# elsewhere it says so and exits 1 (CI sets PDSWEEP_REQUIRE_SLURM=1, so the tests then fail).
set -euo pipefail
export PATH="$PATH:/usr/sbin:/sbin"
need=(munged slurmctld slurmd srun squeue scancel salloc scontrol sinfo)
missing=()
for p in "${need[@]}"; do command -v "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -eq 0 ]; then echo "install-slurm: already installed ($(slurmd -V))"; exit 0; fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "install-slurm: missing ${missing[*]}; needs root and apt-get (apt-get install slurmctld slurmd slurm-client munge)" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
echo "install-slurm: ok ($(slurmd -V))"
