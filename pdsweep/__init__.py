"""pdsweep: accuracy and transfer-performance sweeps for vLLM prefill/decode (PD)
disaggregation over the NIXL KV connector.

The subpackages are the pipeline, in the order a sweep goes through them:

    sweepfile -> plan -> deploy -> measure -> run (writes results/) -> judge -> report -> history -> cli

``measure`` writes evidence only; every pass/fail rule is ``judge``'s. ``run`` ends by having
``judge`` write each cell's verdict files (:mod:`pdsweep.judge.verdicts`), so ``judge`` ranks
below ``run`` in the layers.

Layers. Each subpackage (and each top-level module) has a rank; a module imports only
from its own subpackage or ones ranked before it, never a later one, and no import
cycle exists between modules. tests/test_layers.py reads this list and fails on any
import going up it (lazy and type-only imports included), on a cycle, and on a
subpackage or top-level module missing from it.

    layers: core results engine builds sweepfile tiny plan deploy measure xfer judge run report history
            commands cli __main__

``core`` and ``results`` are leaves every stage uses (errors, paths; the on-disk results
layout); ``engine`` runs inside vLLM's processes (the ``vllm.general_plugins`` entry point);
``builds`` makes and inspects vLLM installs (the unfixed baseline); ``tiny`` makes pdsweep's
own checkpoints and task; ``xfer`` is the standalone NIXL transfer micro-benchmark; ``history`` keeps every run's
judged figures (trends, dashboard).
"""

__version__ = "0.1.0"
