"""`make sweep` / `make nightly` after `make baseline-env` failed: stop (exit 2, a clear
message) when the sweep has cells of a build whose venv does not exist (the unfixed
baseline, e.g. because pdsweep/builds/unfix.py does not know the installed vLLM), instead
of running a sweep where every such cell fails. No such cell: say so and go on (exit 0).

    python scripts/require-baseline.py SWEEP
"""

from __future__ import annotations

import sys

from pdsweep.core.errors import UserError, run_main
from pdsweep.plan.builds import venv_python
from pdsweep.plan.expand import expand
from pdsweep.sweepfile.sweep import load_sweep


def main() -> int:
    if len(sys.argv) != 2:
        raise UserError("usage: require-baseline.py SWEEP")
    ls = load_sweep(sys.argv[1])
    missing = {
        n: b.venv for n, b in ls.sweep.builds.items() if b.venv and not venv_python(b.venv, ls.path.parent).exists()
    }
    planned = expand(ls).cells
    cells = [c for c in planned if c.build in missing]
    if cells:
        builds = ", ".join(f"{n} ({v}/bin/python)" for n, v in missing.items())
        raise UserError(
            f"make: STOP: the unfixed baseline could not be built for the installed vLLM (see the "
            f"baseline-env error above), and {ls.path} has {len(cells)} cell(s) of build(s) {builds} "
            "that would all fail. Install a vLLM that pdsweep/builds/unfix.py knows (constraints/gpu.txt: "
            "`make install`), or drop those cells from the sweep."
        )
    print(f"make: no unfixed baseline, and none of the {len(planned)} cells of {ls.path} needs one: going on")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
