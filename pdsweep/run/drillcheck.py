"""Can each drill and workload act in its cell? Checked at validate/plan (issue 59), with the
message ``run`` would give, so a drill that cannot fire (its phase never comes), cannot run (a
lease ``run`` refuses) or cannot hit its target (push mode, a chunk size that is not prefill's)
is refused before the sweep starts instead of passing or failing for another reason:

- a kill drill (:data:`pdsweep.core.faults.SWEEP_FAULTS` ``where: drill``) whose phase is off
  (``kill-decode-during-load`` with ``bench.enabled: false``: the kill waits for a phase that
  never comes);
- ``decode-after-lease-expiry``: the lease :func:`pdsweep.run.drills.lease_drill_faults` accepts
  (1..10 s; vLLM's default 30 s is refused), and load to reuse the reclaimed blocks (``bench``);
- ``fail-read-1-in-K`` and the lease drill act on decode's NIXL READs (pull mode): in push mode
  (``NixlPushConnector``, vLLM ``nixl/push_worker.py``) prefill WRITEs and decode posts no READ;
- a ``chunk-boundary`` workload's ``chunk_tokens`` must be the prefill's
  ``--max-num-batched-tokens`` (vLLM's chunked-prefill step, ``SchedulerConfig``) and below
  ``max_model_len``: otherwise no prompt straddles a real chunk boundary and the drill passes
  without testing anything.
"""

from __future__ import annotations

from pdsweep.core.errors import UserError
from pdsweep.core.faults import (
    ProxyFaults,
    lease_drill_every,
    read_fault_every,
    scramble_kv_every,
    sweep_fault,
)
from pdsweep.plan.cell import Cell
from pdsweep.plan.expand import Plan
from pdsweep.plan.pushrules import uses_push
from pdsweep.run.drills import lease_drill_faults
from pdsweep.sweepfile.sweep import LoadedSweep

CHUNK_FLAG = "--max-num-batched-tokens"


def drill_problems(plan: Plan) -> tuple[list[str], list[str]]:
    """(errors, warnings): every drill of ``plan`` that cannot act in its cell, one line each
    naming the sweep file, the cell and the field. A ``chunk-boundary`` workload (sweep-wide) is
    an error when no PD cell's prefill chunks at ``chunk_tokens``, a warning for each PD cell
    whose prefill does not (its prompts are checked, but straddle no known boundary there)."""
    ls, errors, warnings = plan.loaded, [], []
    for c in plan.cells:
        if c.fault and c.fault != "none":
            errors += [f"{ls.path}: cell {c.id}: {why}" for why in _fault_problems(c, ls)]
    for w in ls.sweep.bench.workloads if ls.sweep.bench.enabled else []:
        if w.name == "chunk-boundary" and w.chunk_tokens is not None:
            pd = [c for c in plan.cells if c.kind == "pd"]
            why = {c.id: _chunk_problem(c, ls, w.chunk_tokens) for c in pd}
            lines = [f"{ls.path}: bench.workloads chunk-boundary: cell {k}: {v}" for k, v in why.items() if v]
            if pd and all(why.values()):
                errors += [
                    *lines,
                    f"{ls.path}: bench.workloads chunk-boundary: no PD cell chunks its prefill at "
                    f"chunk_tokens {w.chunk_tokens}: the workload would hit no chunk boundary",
                ]
            else:
                warnings += lines
    return errors, warnings


def _fault_problems(c: Cell, ls: LoadedSweep) -> list[str]:
    kind, bench = sweep_fault(c.fault), ls.sweep.bench.enabled
    out = []
    if kind is not None and kind.where == "drill" and kind.phase == "bench" and not bench:
        out.append(
            f"fault {c.fault} kills {kind.target} as the bench phase starts, but bench.enabled is false: "
            "the kill would wait for a phase that never comes"
        )
    if lease_drill_every(c.fault) is not None:
        try:
            lease_drill_faults(c, ls, ProxyFaults())
        except UserError as e:
            out.append(str(e).removeprefix(f"cell {c.id}: "))
        if not bench:
            out.append(
                f"fault {c.fault} needs load (bench.enabled): the requests it does not hold reuse the "
                "blocks whose lease ran out"
            )
    if scramble_kv_every(c.fault) and (not bench or max(ls.sweep.bench.concurrencies, default=1) < 2):
        out.append(
            f"fault {c.fault} scrambles only decode legs that arrive while another request is in flight: "
            "it needs load (bench.enabled) at a bench.concurrencies point of 2 or more"
        )
    m = ls.catalogue.models[c.model]
    if (read_fault_every(c.fault) or lease_drill_every(c.fault)) and uses_push(c, m, ls):
        out.append(
            f"fault {c.fault} acts on decode's NIXL READs (pull mode), but serve_args {c.serve_args} runs "
            "NixlPushConnector: in push mode prefill WRITEs and decode posts no READ"
        )
    return out


def _chunk_problem(c: Cell, ls: LoadedSweep, chunk: int) -> str | None:
    m = ls.catalogue.models[c.model]
    v = ls.sweep.serve_variant(c.serve_args)
    args = [*m.serve_args, *v.both, *v.prefill]
    values = [args[i + 1] for i, a in enumerate(args[:-1]) if a == CHUNK_FLAG]
    values += [a.split("=", 1)[1] for a in args if a.startswith(CHUNK_FLAG + "=")]
    max_len = ls.sweep.defaults.max_model_len or m.max_model_len
    if chunk >= max_len:
        return f"chunk_tokens {chunk} is not below max_model_len {max_len}: no prompt reaches a chunk boundary"
    if not values:
        return (
            f"chunk_tokens {chunk}, but prefill's serve args (serve_args {c.serve_args}) set no {CHUNK_FLAG}: "
            "vLLM picks its own chunk size, so the prompts straddle no known boundary"
        )
    if values[-1] != str(chunk):
        return f"chunk_tokens {chunk}, but prefill's {CHUNK_FLAG} is {values[-1]} (serve_args {c.serve_args})"
    return None
