"""pdsweep: accuracy and transfer-performance sweeps for vLLM prefill/decode (PD)
disaggregation over the NIXL KV connector.

Pipeline: spec -> plan -> schedule (placement over nodes) -> deploy (launchers: local |
slurm, proxy) -> measure (accuracy, consistency, metrics, load) -> run (writes the results
layout) -> facts -> gate / compare -> render / report -> cli.

Module order. Every module of the package, in pipeline order, one stage a line; a module
imports only modules listed before it (its own line included, left to right), never a
later one. tests/test_layers.py reads this list and fails on any import going up it, lazy
and type-only imports included, and on a module missing from it.

    leaves:      pdsweep errors layout stats topology endpoints guards logscan progress expectations
    in-vllm:     vllm_debug readlog cpu_models.mla_mamba2 cpu_models vllm_plugin
    environment: unfix baseline fixprobes argcheck
    spec:        results_schema yamlfile catalogue spec
    inputs:      builds arith evaltasks tinytrain tinymodels ports
    plan:        cell blocks rules plan provenance budgets xfer.geometry xfer.readplan xfer
    schedule:    placement schedule
    deploy:      launchers.base launchers.local launchers.slurm launchers launcher proxy deploy instances
    measure:     metrics accuracy consistency evalproc measure judge
    bench:       xfer.memory xfer.rank xfer.session xfer.bench
    run:         feasible dryrun run
    results:     facts gate compare render report
    cli:         cli __main__

``in-vllm`` runs inside vLLM's engine processes (the ``vllm.general_plugins`` entry
point); ``environment`` builds and inspects vLLM installs (the unfixed baseline);
``inputs`` are what a plan names (interpreters, tiny checkpoints, the arithmetic task).
"""

__version__ = "0.1.0"
