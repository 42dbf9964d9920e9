"""NIXL KV-transfer micro-benchmark with byte-exact verification, laid out with a
model's real per-rank KV geometry (:mod:`pdsweep.plan.geometry`) and executing vLLM's
decode-side read plan for fixed and pre-fix builds (:mod:`pdsweep.plan.readplan`): what
both sides share (``memory``: pattern, buffer layout, request page ids), the rank
processes (``rank``), the parent that drives them (``session``) and the entry point with
its typed :class:`~pdsweep.xfer.bench.BenchConfig` and statistics (``bench``).

Reproduces vLLM PR #49297: with prefill TP > decode TP on a hybrid MLA+SSM model the
MLA latent is read once while the TP-sharded SSM state must be read from every
prefill rank of the group.
"""
