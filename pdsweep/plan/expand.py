"""Expand a sweep matrix into named cells and reject invalid ones with the rule and reason
(each instance's argv, env and ports: :mod:`pdsweep.plan.instance`).

Matrix semantics follow GitHub Actions ``strategy.matrix``: the product of the axes,
minus ``exclude`` entries (partial match), then each ``include`` entry is merged into
every combination whose *original* axis values it does not overwrite, or appended as a
new combination when it fits none.
"""

from __future__ import annotations

import fnmatch
import itertools
from dataclasses import dataclass, field, replace
from typing import Any

from pdsweep.builds import fixprobes
from pdsweep.core.errors import UserError
from pdsweep.plan import rules
from pdsweep.plan.budgets import ceiling_errors
from pdsweep.plan.builds import build_python
from pdsweep.plan.cell import Cell, Rejected
from pdsweep.plan.derived import derive, is_derived, note
from pdsweep.plan.instance import MAX_INSTANCES
from pdsweep.plan.ports import overlap
from pdsweep.sweepfile.axes import AXES, DEFAULTS, EXPECT_KEYS, REF_ENTRY_KEYS
from pdsweep.sweepfile.catalogue import ModelSpec
from pdsweep.sweepfile.expectations import conditional, resolve
from pdsweep.sweepfile.sweep import LoadedSweep


@dataclass
class Plan:
    """Result of :func:`expand`. ``cells`` are valid and include reference cells."""

    loaded: LoadedSweep
    cells: list[Cell] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)

    @property
    def pd_cells(self) -> list[Cell]:
        return [c for c in self.cells if c.kind == "pd"]

    def model(self, cell: Cell) -> ModelSpec:
        return self.loaded.catalogue.models[cell.model]


def _matches(combo: dict[str, Any], entry: dict[str, Any]) -> bool:
    return all(k in combo and str(combo[k]) == str(v) for k, v in entry.items())


def matrix_combinations(matrix: Any) -> list[dict[str, Any]]:
    """GitHub-Actions matrix expansion: product, exclude, include (see module doc)."""
    axes = [(k, getattr(matrix, k)) for k in AXES if getattr(matrix, k)]
    keys = [k for k, _ in axes]
    combos = [dict(zip(keys, vals)) for vals in itertools.product(*(v for _, v in axes))]
    combos = [c for c in combos if not any(_matches(c, e) for e in matrix.exclude)]
    originals = [dict(c) for c in combos]
    extra: list[dict[str, Any]] = []
    for entry in matrix.include:
        if entry.get("kind") == "ref":
            continue  # an expectation of reference cells (apply_ref_expectations), not a cell
        merged = False
        for combo, orig in zip(combos, originals):
            if all(str(orig[k]) == str(v) for k, v in entry.items() if k in orig):
                combo.update(entry)
                merged = True
        if not merged:
            extra.append(dict(entry))
    return combos + extra


def _to_cell(combo: dict[str, Any], ls: LoadedSweep) -> Cell:
    d = ls.sweep.defaults
    v = {k: getattr(d, k) for k in DEFAULTS}  # every axis but the model and the shorthands (tp, block_size)
    v["kv_buffer_device"] = v["kv_buffer_device"] or ("cpu" if ls.sweep.platform == "cpu" else "cuda")
    for k, val in combo.items():
        if k == "tp":
            p, dd = str(val)[1:].split("d")
            v["prefill_tp"], v["decode_tp"] = int(p), int(dd)
        elif k == "block_size":
            v["prefill_block_size"] = v["decode_block_size"] = int(val)
        elif k in EXPECT_KEYS:
            continue
        else:
            v[k] = val
    if "model" not in combo:
        raise UserError(f"{ls.path}: matrix.include entry {combo} has no 'model' and matches no combination")
    cell = Cell(
        model=combo["model"],
        **{k: val for k, val in v.items() if k != "model"},
        platform=ls.sweep.platform,
        expect_fail=combo.get("expect") == "fail",
        expect_reason=combo.get("reason"),
        expect_ref=combo.get("ref"),
        expect_match=combo.get("match"),
        expect_vllm=combo.get("vllm"),
        expect_without=tuple(combo.get("without") or ()),
    )
    if model := ls.catalogue.models.get(cell.model):  # in a fix's scope: its expectation (pdsweep.plan.derived)
        cell = derive(cell, model, ls, declared=any(k in combo for k in EXPECT_KEYS))
    return resolve_for_plan(cell, ls)


def resolve_for_plan(cell: Cell, ls: LoadedSweep) -> Cell:
    """``cell`` with a build-conditional expectation resolved against its build's vLLM
    (:mod:`pdsweep.sweepfile.expectations`), or kept as declared when that build is not there yet
    (a derived one, :mod:`pdsweep.plan.derived`, is then not applied yet: ``run`` resolves it)."""
    if not conditional(cell):
        return cell

    try:
        python = build_python(ls, cell.build)
    except UserError:
        out = replace(cell, expect_note=f"expected to fail as declared: build {cell.build} not made yet")
    else:
        out = resolve(cell, *fixprobes.probe_python(python))
    return note(out) if is_derived(cell) else out


def expand(ls: LoadedSweep) -> Plan:
    """Expand ``ls`` into valid cells (PD cells, then one reference per distinct
    (model, decode TP, decode block, build, variants) when ``eval.reference``) and
    rejected cells with rule id and reason. Raises ``UserError`` on duplicate ids and on a
    budget above its ceiling (:func:`pdsweep.plan.budgets.ceiling_errors`)."""
    if over := ceiling_errors(ls.sweep, ls.path):
        raise UserError("\n".join(over))
    plan = Plan(loaded=ls)
    seen: dict[str, Cell] = {}
    for combo in matrix_combinations(ls.sweep.matrix):
        cell = _to_cell(combo, ls)
        if cell.id in seen:
            raise UserError(
                f"{ls.path}: matrix: two combinations give the same cell id '{cell.id}' "
                "(an include entry duplicates a product combination?)"
            )
        seen[cell.id] = cell
        model = ls.catalogue.models[cell.model]
        if cell.num_prefill + cell.num_decode > MAX_INSTANCES:
            plan.rejected.append(Rejected(cell, "instances", f"more than {MAX_INSTANCES} instances per cell"))
            continue
        bad = rules.check(cell, model, ls)
        if not bad and cell.kind == "pd":
            why = overlap(cell, ls)
            bad = ("side-channel-ports", why) if why else None
        if bad:
            plan.rejected.append(Rejected(cell, *bad))
        else:
            plan.cells.append(cell)
    if ls.sweep.eval.reference:
        refs: dict[str, Cell] = {}
        for c in plan.cells:
            r = reference_of(c, ls)
            refs.setdefault(r.id, r)
        plan.cells.extend(apply_ref_expectations(list(refs.values()), ls))
    elif entries := [i for i, e in enumerate(ls.sweep.matrix.include) if e.get("kind") == "ref"]:
        raise UserError(
            f"{ls.path}: matrix.include[{entries[0]}] (kind: ref) declares an expectation of reference cells, "
            "but eval.reference is false: no reference cell runs; drop the entry or set eval.reference: true"
        )
    return plan


_REF_FIELDS = {"block_size": "decode_block_size"}  # a kind: ref entry's key -> the reference Cell's field


def apply_ref_expectations(refs: list[Cell], ls: LoadedSweep) -> list[Cell]:
    """``refs`` with the expectations of the sweep's ``kind: ref`` include entries applied
    (every key of :data:`pdsweep.sweepfile.sweep.REF_ENTRY_KEYS` an entry gives must equal the
    reference's; a later entry overrides an earlier one). A reference is final for the PD
    cells compared with it, so an engine fault that breaks the single instance itself (e.g.
    the unpatched CPU RoPE kernel) is declared on it. Raises ``UserError`` naming the entry
    when it matches no reference cell."""
    out = list(refs)
    for i, e in enumerate(ls.sweep.matrix.include):
        if e.get("kind") != "ref":
            continue
        keys = {_REF_FIELDS.get(k, k): v for k, v in e.items() if k in REF_ENTRY_KEYS}
        hits = [j for j, r in enumerate(out) if all(str(getattr(r, k)) == str(v) for k, v in keys.items())]
        if not hits:
            raise UserError(
                f"{ls.path}: matrix.include[{i}] (kind: ref) {e} matches no reference cell; the "
                f"references are: {', '.join(r.id for r in refs) or 'none (eval.reference false?)'}"
            )
        for j in hits:
            out[j] = resolve_for_plan(
                replace(
                    out[j],
                    expect_fail=True,
                    expect_reason=e.get("reason"),
                    expect_ref=e.get("ref"),
                    expect_match=e.get("match"),
                    expect_vllm=e.get("vllm"),
                    expect_without=tuple(e.get("without") or ()),
                ),
                ls,
            )
    return out


def select_cells(plan: Plan, pattern: str | None) -> list[Cell]:
    """Cells of ``plan`` matching ``pattern`` (glob on the id; None: all), plus the
    references they need."""
    if not pattern:
        return list(plan.cells)
    chosen = [c for c in plan.cells if fnmatch.fnmatch(c.id, pattern)]
    refs = (
        {reference_of(c, plan.loaded).id for c in chosen if c.kind == "pd"}
        if plan.loaded.sweep.eval.reference
        else set()
    )
    return [c for c in plan.cells if c in chosen or c.id in refs]


def reference_of(cell: Cell, ls: LoadedSweep) -> Cell:
    """The reference cell a PD ``cell`` is compared with: :meth:`Cell.reference` on the
    sweep's default build, with the serve args its variant names in ``reference`` (default:
    its own variant)."""
    v = ls.sweep.serve_variant(cell.serve_args)
    return cell.reference(ls.sweep.defaults.build, v.reference or cell.serve_args)
