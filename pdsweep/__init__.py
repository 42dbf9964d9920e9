"""pdsweep: accuracy and transfer-performance sweeps for vLLM prefill/decode (PD)
disaggregation over the NIXL KV connector.

Pipeline (one module per stage): spec -> plan -> schedule (placement over nodes) -> deploy
(launchers: local | slurm, proxy)
-> measure (accuracy, consistency, metrics, load) -> layout (results) -> gate / compare
/ report.
"""

__version__ = "0.1.0"
