"""GPU facts vLLM could not answer here, said in the plan (never silent): a cell whose attention
backend or blocks are not vLLM's own verdict for the installed build carries ``unverified`` (plan.json:
``cells[].unverified``, ``rejected[].unverified``; the text plan: one line per reason with its cells).

Where they come from: :func:`pdsweep.plan.blocks.cuda_backend` (a backend ahead in vLLM's priority order
whose class cannot be loaded here or whose checks raised, or a check of the chosen backend that depends
on compiled kernels) and :func:`pdsweep.plan.blocks.effective_blocks` (``blocks_source: unverified: ...``
where vLLM's ``Platform._align_hybrid_block_size`` could not be called and pdsweep's mirror gave the
figures)."""

from __future__ import annotations

from typing import Any


def cell_unverified(blocks: dict[str, Any]) -> list[str]:
    """``["decode: <why>", ...]`` of one cell's blocks (role -> :meth:`EffectiveBlocks.to_dict`, or
    ``{"error": ...}``): each role's unverified backend checks and an unverified ``blocks_source``."""
    out: list[str] = []
    for role, b in blocks.items():
        if not isinstance(b, dict):
            continue
        whys = [*b.get("unverified", ())]
        if str(b.get("blocks_source", "")).startswith("unverified"):
            whys.append(str(b["blocks_source"]).removeprefix("unverified: "))
        out += [f"{role}: {w}" for w in whys if f"{role}: {w}" not in out]
    return out


def unverified_text(cells: list[dict[str, Any]], rejected: list[dict[str, Any]]) -> list[str]:
    """Lines for the text plan: ``UNVERIFIED (N cells): <why>`` then the first cell ids, one group per
    reason (role stripped), placed cells and rejected ones alike."""
    by_why: dict[str, list[str]] = {}
    for c in [*cells, *rejected]:
        cid = c.get("id") or c.get("cell_id") or "?"
        for r in c.get("unverified", ()):
            why = r.split(": ", 1)[-1]
            if cid not in by_why.setdefault(why, []):
                by_why[why].append(cid)
    out = []
    for why, ids in by_why.items():
        more = f" and {len(ids) - 3} more" if len(ids) > 3 else ""
        out.append(f"UNVERIFIED ({len(ids)} cells, not vLLM's verdict here): {why}: {', '.join(ids[:3])}{more}\n")
    return out
