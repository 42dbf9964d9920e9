"""Checks of a planned sweep that need more than its schema: can each cell pass the gate in
principle, do its lm-eval tasks, builds, tiny-model geometry and probe lengths exist.

``pdsweep validate``, ``plan`` and ``run`` call :func:`preflight` after
:func:`pdsweep.plan.expand.expand`, so nothing that validate passed fails later for a reason
knowable before the first server starts (issue 15, kinds 2 and 3).
"""

from __future__ import annotations

import functools
import itertools
import os
from pathlib import Path

from pdsweep.core.errors import UserError
from pdsweep.judge.accuracy import load_expected
from pdsweep.plan.builds import venv_python
from pdsweep.plan.expand import Plan, _to_cell
from pdsweep.run.drillcheck import drill_problems
from pdsweep.run.samplecheck import sample_problems
from pdsweep.sweepfile.axes import AXES
from pdsweep.sweepfile.phases import resolve_lengths
from pdsweep.tiny import arith
from pdsweep.tiny.config import config_params


def cannot_pass(plan: Plan) -> list[str]:
    """Settings under which a valid, not-expected-to-fail PD cell fails the gate whatever
    vLLM does (the checks of :func:`pdsweep.judge.gate.checks_for`):

    - ``gate.require_consistency`` needs ``eval.consistency.enabled`` and
      ``eval.reference`` (consistency compares P->D with the single-instance reference;
      :func:`pdsweep.judge.verdicts.judge_run` fails a probe without one);
    - ``gate.require_accuracy`` needs ``eval.tasks`` and, per task, an expected score in
      ``accuracy/expected.yaml`` for the model or ``eval.reference`` (otherwise
      :func:`pdsweep.judge.accuracy.judge` says "nothing to gate against");
    - ``bench.check`` (with ``bench.enabled``) needs ``eval.reference`` (the load answers'
      reference, :func:`pdsweep.judge.load.judge_load`).

    Returns one message per contradiction, naming the sweep file and the fields."""
    s, path = plan.loaded.sweep, plan.loaded.path
    out = []
    pd = [c for c in plan.pd_cells if not c.expect_fail]
    if s.gate.require_consistency and pd:
        if not s.eval.consistency.enabled:
            out.append(
                f"{path}: gate.require_consistency is true but eval.consistency.enabled is false: "
                "no PD cell can pass (disable one, or enable the probe)"
            )
        elif not s.eval.reference:
            out.append(
                f"{path}: gate.require_consistency is true but eval.reference is false: the consistency "
                "probe compares P->D with the single-instance reference, so no PD cell can pass "
                "(set eval.reference: true, or gate.require_consistency: false with "
                "eval.consistency.enabled: false)"
            )
    if s.gate.require_accuracy and pd:
        if not s.eval.tasks:
            out.append(f"{path}: gate.require_accuracy is true but eval.tasks is empty: no cell can pass")
        elif not s.eval.reference:
            expected = load_expected()
            for model in dict.fromkeys(c.model for c in pd):
                missing = [t for t in s.eval.tasks if t not in expected.get(model, {})]
                if missing:
                    out.append(
                        f"{path}: model {model}: no expected score for task(s) {', '.join(missing)} in "
                        "accuracy/expected.yaml and eval.reference is false: nothing to gate its "
                        "accuracy against (add a score or set eval.reference: true)"
                    )
    if s.bench.enabled and s.bench.check and pd and not s.eval.reference:
        out.append(
            f"{path}: bench.check is true but eval.reference is false: every load answer is compared with "
            "the single-instance reference's, so no PD cell can pass (set eval.reference: true, or bench.check: false)"
        )
    return out


@functools.lru_cache(maxsize=4)
def _lm_eval_tasks(need_defaults: bool) -> frozenset[str]:
    from lm_eval.tasks import TaskManager

    return frozenset(TaskManager(include_defaults=need_defaults).all_tasks)


def unknown_tasks(plan: Plan) -> list[str]:
    """``eval.tasks`` that neither pdsweep (``pdsweep_arith``) nor lm-eval's
    ``TaskManager().all_tasks`` knows (the check :func:`pdsweep.measure.lmeval.run_lm_eval`
    repeats per cell). The lm-eval index is read only for non-``pdsweep_`` names."""
    s, path = plan.loaded.sweep, plan.loaded.path
    if not plan.cells or not s.eval.tasks:
        return []
    own = [t for t in s.eval.tasks if t.startswith("pdsweep_")]
    bad = [t for t in own if t != arith.TASK_NAME]
    others = [t for t in s.eval.tasks if not t.startswith("pdsweep_")]
    if others:
        try:
            known = _lm_eval_tasks(True)
        except ImportError:
            return [f"{path}: eval.tasks {others} need lm-eval: pip install 'lm-eval[api]'"]
        bad += [t for t in others if t not in known]
    return (
        [
            f"{path}: eval.tasks: unknown lm-eval task(s) {bad} (pdsweep's own: {arith.TASK_NAME}; "
            "lm-eval's: `lm_eval ls tasks`)"
        ]
        if bad
        else []
    )


def build_problems(plan: Plan) -> tuple[list[str], list[str]]:
    """(errors, warnings) for the builds cells use: a ``python`` that is not an executable
    file is an error; a ``venv`` not built yet is a warning (``make baseline-env`` makes
    ``.venv-unfixed`` before ``make sweep`` runs; without it only that build's cells fail)."""
    s, path = plan.loaded.sweep, plan.loaded.path
    errors, warnings = [], []
    for name in dict.fromkeys(c.build for c in plan.cells):
        b = s.builds[name]
        if b.python and not (Path(b.python).is_file() and os.access(b.python, os.X_OK)):
            errors.append(f"{path}: builds.{name}.python: {b.python} is not an executable file")
        elif b.venv:
            if not (py := venv_python(b.venv, Path(path).parent)).exists():
                warnings.append(
                    f"{path}: builds.{name}.venv: {py} does not exist yet (for the "
                    f"unfixed baseline, `make sweep` builds it first, or `make baseline-env`); a `pdsweep run` "
                    f"before then fails the cells of build {name}"
                )
    return errors, warnings


def model_problems(plan: Plan) -> list[str]:
    """Tiny-model geometry (:func:`pdsweep.tiny.config.config_params`, named with the real
    catalogue file) and consistency probe lengths per cell
    (:func:`pdsweep.sweepfile.phases.resolve_lengths`), as the run would compute them."""
    ls = plan.loaded
    out: list[str] = []
    for name in dict.fromkeys(c.model for c in plan.cells):
        m = ls.catalogue.models[name]
        if m.tiny is not None:
            try:
                config_params(name, m)
            except UserError as e:
                out.append(str(e).replace("models.yaml: ", f"{ls.catalogue_path}: models.", 1))
    con = ls.sweep.eval.consistency
    if con.enabled:
        seen: set[tuple[int, int]] = set()
        for c in plan.cells:
            key = (c.decode_block_size, ls.sweep.defaults.max_model_len or ls.catalogue.models[c.model].max_model_len)
            if key not in seen:
                seen.add(key)
                try:
                    resolve_lengths(*key, con.lengths, con.max_tokens)
                except UserError as e:
                    out.append(f"{ls.path}: eval.{e} (cell {c.id})")
    return out


def matrix_problems(plan: Plan) -> tuple[list[str], list[str]]:
    """(errors, warnings) of matrix semantics (:func:`pdsweep.plan.expand.matrix_combinations`):
    an ``include`` that merges into product combinations and sets a cell-defining key
    that is not an axis replaces those cells (their id changes) instead of adding one: an
    error (make the key an axis); an ``exclude`` that matches no combination: a warning."""
    m, path = plan.loaded.sweep.matrix, plan.loaded.path
    axes = [k for k in AXES if getattr(m, k)]
    combos = [dict(zip(axes, vals)) for vals in itertools.product(*(getattr(m, k) for k in axes))]
    errors, warnings = [], []
    for i, e in enumerate(m.exclude):
        if not any(all(k in c and str(c[k]) == str(v) for k, v in e.items()) for c in combos):
            warnings.append(f"{path}: matrix.exclude[{i}] {e} matches no combination of the axes: it does nothing")
    kept = [c for c in combos if not any(all(k in c and str(c[k]) == str(v) for k, v in e.items()) for e in m.exclude)]
    for i, e in enumerate(m.include):
        if e.get("kind") == "ref":
            continue  # sets reference expectations (plan.apply_ref_expectations), never a cell
        merged = [c for c in kept if all(str(c[k]) == str(v) for k, v in e.items() if k in c)]
        replaced = [c for c in merged if _to_cell(c, plan.loaded).id != _to_cell({**c, **e}, plan.loaded).id]
        new_keys = [k for k in e if k in AXES and k not in axes]
        if replaced:
            errors.append(
                f"{path}: matrix.include[{i}] sets {', '.join(new_keys)} (not an axis) on {len(replaced)} "
                f"product combination(s) such as {replaced[0]}: that replaces those cells instead of "
                f"adding one; make {new_keys[0]} an axis (GitHub-Actions include semantics)"
            )
    return errors, warnings


def feasibility_warnings(plan: Plan, tasks: bool = True) -> list[str]:
    """Raise one ``UserError`` listing every problem above; returns the warnings.
    ``tasks=False`` skips the lm-eval task index (seconds to read; ``plan`` skips it)."""
    matrix_errors, matrix_warnings = matrix_problems(plan)
    drill_errors, drill_warnings = drill_problems(plan)
    sample_errors, sample_warnings = sample_problems(plan)
    errors = matrix_errors + cannot_pass(plan) + model_problems(plan) + drill_errors + sample_errors
    if tasks:
        errors += unknown_tasks(plan)
    build_errors, warnings = build_problems(plan)
    errors += build_errors
    if errors:
        raise UserError("\n".join(dict.fromkeys(errors)))
    return matrix_warnings + warnings + drill_warnings + sample_warnings
