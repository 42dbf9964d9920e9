"""Does a torch Inductor cache written by an AVX-512 process give an AVX2 process wrong answers?

Runs vLLM's ``get_masked_input_and_mask`` (vllm/model_executor/layers/vocab_parallel_embedding.py,
copied: torch only) compiled by Inductor (``dynamic=True``, int32 token ids, as TP > 1 workers call it)
on token ids of a 512-token vocabulary split over 2 TP ranks, and prints ``isa=<Inductor's vec ISA>
bad=<shards whose masked ids leave [0, 256)>``. ``--child`` runs one process; without it: an AVX-512
process, then a forced-AVX2 one (scripts/isa/avx2) in the same ``TMPDIR`` (Inductor's default cache
``$TMPDIR/torchinductor_$USER``), and exits 1 when the AVX2 process got wrong ids. torch's FX graph
cache key (torch/_inductor/codecache.py ``FxGraphHashDetails``) holds no CPU vector ISA, so without
a cache directory of its own the AVX2 process reuses C++ generated for 16 int32 lanes and compiles it
with ``-mavx2`` (8 lanes).

  .venv/bin/python scripts/isa/inductor_cache_isa.py [--isa-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
AVX2_ENV = {"PDSWEEP_FORCE_AVX2": "1", "ATEN_CPU_CAPABILITY": "avx2"}


def child() -> int:
    import torch
    from torch._inductor import cpu_vec_isa

    @torch.compile(dynamic=True, backend="inductor")
    def masked(ids, start, end, pad, added_start, added_end):  # vLLM's get_masked_input_and_mask
        org = (ids >= start) & (ids < end)
        added = (ids >= added_start) & (ids < added_end)
        valid = start * org + (added_start - (end - start) - pad) * added
        keep = org | added
        return keep * (ids - valid), ~keep

    torch.set_num_threads(1)
    bad = 0
    with torch.inference_mode():
        for vals in ([19, 281, 285, 260], list(range(0, 512, 7)), [261]):
            ids = torch.tensor(vals, dtype=torch.int32)
            for start, end in ((0, 256), (256, 512)):
                out, _ = masked(ids, start, end, 0, 512, 512)
                bad += not bool(((out >= 0) & (out < 256)).all())
    print(f"isa={cpu_vec_isa.pick_vec_isa()} bad={bad}", flush=True)
    return 0


def run(isa_dir: Path) -> tuple[str, str]:
    """(AVX-512 process's line, forced-AVX2 process's line), both in one fresh TMPDIR."""
    with tempfile.TemporaryDirectory() as tmp:
        base = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"} | {"TMPDIR": tmp}
        cmd = [sys.executable, __file__, "--child"]
        one = subprocess.run(cmd, env=base, capture_output=True, text=True, check=True)
        two_env = base | AVX2_ENV | {"PYTHONPATH": str(isa_dir)}
        two = subprocess.run(cmd, env=two_env, capture_output=True, text=True, check=True)
    last = lambda p: [x for x in p.stdout.splitlines() if x.startswith("isa=")][-1]  # noqa: E731
    return last(one), last(two)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--isa-dir", type=Path, default=HERE / "avx2", help="the sitecustomize directory to test")
    a = ap.parse_args()
    if a.child:
        return child()
    first, second = run(a.isa_dir)
    print(f"AVX-512 process: {first}\nforced-AVX2 process: {second}")
    return 1 if "bad=0" not in second else 0


if __name__ == "__main__":
    sys.exit(main())
