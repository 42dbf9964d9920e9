"""Environment variables one pdsweep layer sets for a lower one (or a child process) to read."""

ARCH_ENV = "PDSWEEP_GPU_ARCH"  # --gpu-arch of plan / run / validate (pdsweep.cli.main); pdsweep.plan.blocks reads it
