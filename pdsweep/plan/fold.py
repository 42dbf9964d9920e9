"""Fold PD cells whose deployments are identical after vLLM's block arithmetic.

vLLM raises a hybrid model's configured block size to one page shared by its attention and
SSM layers (``HybridAttentionMambaModelConfig.verify_and_update_config``,
``vllm/model_executor/models/config.py``), so Kimi-Linear at ``--block-size 64`` and ``128``
both run ``P FLASHMLA 1024/64 D FLASHMLA 1920/64`` at P TP 2 -> D TP 1: the same deployment
twice. Two PD cells fold when every field but the configured block sizes is equal and each
role's effective blocks (:func:`pdsweep.plan.blocks.for_cell`: backend, logical and kernel
block, page bytes, prefix caching) are equal and fully known. The first in plan order runs;
the others are reported with its verdict under their own ids (:func:`pdsweep.judge.planned.fold_in`).
A cell whose blocks are unknown or refused never folds; a single-instance reference folds only
when no PD cell that runs is compared with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from pdsweep.plan.cell import Cell

# the fields of a cell that are not the deployment, or that the block arithmetic erases
_NOT_DEPLOYMENT = ("prefill_block_size", "decode_block_size", "expect_note")
_BLOCK_FIELDS = ("backend", "logical", "kernel", "prefix_caching", "attn_page_bytes", "mamba_page_bytes")


@dataclass
class Folded:
    """``cells``: what runs; ``into``: folded cell id -> the id that runs for it; ``why``:
    folded cell id -> the shared blocks, e.g. ``P FLASHMLA 1024/64 D FLASHMLA 1920/64``."""

    cells: list[Cell]
    into: dict[str, str] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)


def blocks_text(blocks: dict[str, dict[str, Any]]) -> str:
    """``P FLASHMLA 1024/64 D FLASHMLA 1920/64`` of ``{role: EffectiveBlocks.to_dict()}``."""
    return " ".join(f"{r[0].upper()} {b['backend']} {b['logical']}/{b['kernel']}" for r, b in blocks.items())


def deployment_key(cell: Cell, blocks: dict[str, dict[str, Any]] | None) -> tuple | None:
    """What ``cell`` deploys once vLLM has done its block arithmetic, or None (blocks unknown
    or refused: never folded)."""
    if not blocks:
        return None
    if any(b.get("unknown") or b.get("logical") is None or b.get("kernel") is None for b in blocks.values()):
        return None
    fields = tuple(sorted((k, str(v)) for k, v in asdict(cell).items() if k not in _NOT_DEPLOYMENT))
    return fields, tuple((role, tuple(b.get(k) for k in _BLOCK_FIELDS)) for role, b in sorted(blocks.items()))


def fold(
    cells: list[Cell],
    blocks_of: Callable[[Cell], dict[str, dict[str, Any]] | None],
    references: Callable[[Cell], str | None] = lambda c: None,
) -> Folded:
    """``cells`` with every cell whose :func:`deployment_key` an earlier cell has left out
    (``blocks_of``: a cell's effective blocks per role as dicts, None when unknown). PD cells
    fold first; then single-instance references that no PD cell left running compares with
    (``references``: a PD cell's reference id, None without references)."""
    pd = _fold([c for c in cells if c.kind == "pd"], blocks_of)
    needed = {references(c) for c in pd.cells}
    refs = _fold([c for c in cells if c.kind != "pd"], blocks_of, pinned=needed)
    kept = {c.id for c in pd.cells + refs.cells}
    return Folded([c for c in cells if c.id in kept], {**pd.into, **refs.into}, {**pd.why, **refs.why})


def _fold(
    cells: list[Cell],
    blocks_of: Callable[[Cell], dict[str, dict[str, Any]] | None],
    pinned: set | frozenset = frozenset(),
) -> Folded:
    """:func:`fold` of one kind of cell; a ``pinned`` id never folds into another (it may run for others)."""
    first: dict[tuple, Cell] = {}
    out = Folded([])
    for c in sorted(cells, key=lambda c: c.id not in pinned):  # pinned ones run: they go first
        blocks = blocks_of(c)
        key = deployment_key(c, blocks)
        if key is not None and key in first and c.id not in pinned:
            out.into[c.id] = first[key].id
            out.why[c.id] = blocks_text(blocks or {})
            continue
        if key is not None:
            first[key] = c
        out.cells.append(c)
    return out
