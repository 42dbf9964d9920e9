"""The tags pdsweep's vLLM plugin writes into instance logs (:mod:`pdsweep.engine.readlog`,
:mod:`pdsweep.engine.readfault`) and :mod:`pdsweep.core.logscan` reads back: the contract between
the two, here so the plugin, loaded in every vLLM process, imports no log parser."""

NIXL_READ_TAG = "PDSWEEP_NIXL_READ"  # one completed READ on a decode worker (PDSWEEP_NIXL_READ_LOG=1)
NIXL_WRITE_TAG = "PDSWEEP_NIXL_WRITE"  # one completed push WRITE on a prefill worker (PDSWEEP_NIXL_WRITE_LOG=1)
READ_FAULT_TAG = "PDSWEEP_INJECTED_READ_FAILURE"  # one READ the fail-read drill reported failed
