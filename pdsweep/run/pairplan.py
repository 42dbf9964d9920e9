"""The build pairs in ``pdsweep plan`` (plan.json ``pairs``) and what they add to the makespan.

The cell schedule places each cell alone; a pair runs both cells at once, before the others
(:mod:`pdsweep.run.pairs`), which on CPU costs :data:`pdsweep.plan.pairing.PAIR_OVERHEAD_S` a
pair (measured). The planned makespan adds it. On GPUs the pairs that fit the pool run before
the dispatch and the makespan adds their GPU-seconds over the pool (``first_s``, an estimate); their
interleaving cost is not measured there and the plan says so.
"""

from __future__ import annotations

from typing import Any

from pdsweep.plan.pairing import overhead_s, pairing


def pairs_dict(rp: Any) -> dict[str, Any] | None:
    """plan.json ``pairs`` of a :class:`pdsweep.run.runplan.RunPlan`: ``pairs`` (``[{a, b}]``,
    side ``a`` the earlier build in ``builds:``), ``alone`` (cell id -> why it runs unpaired),
    ``how`` (why pairing is on: the default or ``bench.pair_builds: true``), ``overhead_s``
    (seconds the pairs add to the makespan; None where not measured), ``first_s`` (on GPUs: the pairs
    run before the dispatch, their GPU-seconds over the pool's GPUs by the plan's cell seconds
    (:class:`pdsweep.plan.durations.CellClock`: measured, or :func:`pdsweep.plan.startup.estimator`),
    a packing estimate; None on CPU, where the schedule holds them); None without pairs."""
    if not rp.pairs:
        return None
    pairs, alone = rp.pairs
    est, n = rp.seconds.wall, rp.pool.num_gpus
    first = sum(max(est(p.a), est(p.b)) * p.num_gpus for p in pairs) / n if n and pairs else None
    return {
        "pairs": [{"a": p.a.id, "b": p.b.id} for p in pairs],
        "alone": alone,
        "how": pairing(rp.ls.sweep.bench)[1],
        "overhead_s": overhead_s(rp.ls.sweep.platform, len(pairs)),
        "first_s": None if first is None else round(first, 1),
    }


def pairs_off(rp: Any) -> str | None:
    """plan.json ``pairs_off``: why a sweep whose PD cells span two or more builds measures no
    pair paired (the opt-out, or what keeps the default from pairing); None otherwise."""
    on, why = pairing(rp.ls.sweep.bench)
    builds = {c.build for c in rp.cells if c.kind == "pd"}
    return why if not on and len(builds) > 1 else None


def pairs_text(pr: dict[str, Any] | None, off: str | None) -> str:
    """The plan's lines for ``pr`` (:func:`pairs_dict`); ``off``: :func:`pairs_off`, said when
    there is no pair."""
    if not pr:
        return f"\nbuild pairs: none measured paired ({off})\n" if off else ""
    cost = pr["overhead_s"]
    costs = (
        f"+{cost:.0f} s in the makespan (both deployments start at once; measured, docs/performance.md)"
        if cost is not None
        else "their interleaving cost is not in the makespan estimate (not measured on GPUs)"
    )
    if pr.get("first_s") is not None:
        costs += f"; they run before the dispatch: +{pr['first_s']:.0f} s in the makespan (GPU-seconds over the pool)"
    return (
        f"\nbuild pairs: {len(pr['pairs'])} measured paired, load repeats interleaved (ABBA), no extra "
        f"repeats; {pr['how']}; {costs}\n"
        + "".join(f"  pair {p['a']} (a) + {p['b']} (b)\n" for p in pr["pairs"])
        + "".join(f"  alone {cid}: {why}\n" for cid, why in pr["alone"].items())
    )
