"""Gate: one verdict per cell of a run, from the files in results/<run>/ (see
results/README.md).

Verdicts: ``PASS``; ``FAIL``; ``XFAIL`` (expected to fail, and failed: ok for the exit
code, the evidence is kept); ``XPASS`` (expected to fail but passed: a failure, the
expectation is stale); ``SKIPPED`` (rejected by a plan rule: not a failure);
``NOT-RUNNABLE`` (valid, but needs more GPUs than this host or allocation: listed loudly,
not a failure unless ``gate.require_all_cells`` / ``gate --require-all-cells``, which makes
it FAIL; never a pass). ``FLAKY``
(passed only after a redeploy, :mod:`pdsweep.judge.flaky`: a failure when the gate's
``flaky_fails_nightly``/``flaky_fails_sweep`` says so).

Fail closed: a missing or unreadable file, a ``null``/NaN number where a check needs
one, or a cell that did not finish is a FAIL whose reason names the cell and the file,
e.g. ``kimi-linear.p2d1.b16-16.fixed/accuracy.json: missing``.

Each check is a small object whose ``fails(cell)`` returns readable reasons (empty: the
check passes); :func:`checks_for` builds them from a :class:`~pdsweep.sweepfile.gatespec.GateSpec`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pdsweep.core.errors import GateFailed, UserError
from pdsweep.core.stats import obj
from pdsweep.judge.accuracy import AccuracyCheck, AccuracyRecompute
from pdsweep.judge.agreement import disagreements, record_disagreements, strictest_kind, unlisted_cells
from pdsweep.judge.buildrecord import BuildRecordCheck
from pdsweep.judge.consistency import ConsistencyCheck, ConsistencyRecompute
from pdsweep.judge.facts import (
    CellFacts,
    CellFiles,
    cell_facts,
    cell_from_dict,
    cell_problem,
    load_files,
    read_index,
    run_gate_spec,
)
from pdsweep.judge.flaky import FLAKY, flaky_reasons, retried
from pdsweep.judge.integrity import IntegrityCheck
from pdsweep.judge.load import LoadAnswersCheck, LoadCheck
from pdsweep.judge.planned import (
    PlannedEval,
    PlannedPromptsCheck,
    PlannedReferenceCheck,
    PlannedTasksCheck,
    fold_in,
    frozen_problems,
    load_plan,
    planned_answers,
    planned_eval,
    signature_matches,
    unexplained_losses,
)
from pdsweep.judge.transfer import ReadPatternCheck, TransferCheck, TransportCheck
from pdsweep.plan.cell import Cell
from pdsweep.results import layout
from pdsweep.sweepfile.axes import MATCH_ANY
from pdsweep.sweepfile.gatespec import GateSpec

PASS, FAIL, XFAIL, XPASS, SKIPPED = "PASS", "FAIL", "XFAIL", "XPASS", "SKIPPED"
NOT_RUNNABLE = "NOT-RUNNABLE"  # needs more GPUs than the host/allocation (layout.NEEDS_GPUS)
VERDICTS = (PASS, FAIL, XFAIL, XPASS, SKIPPED, NOT_RUNNABLE, FLAKY)
XPASS_REASON = "expected to fail but passed; remove the expectation or investigate"


# ---------------------------------------------------------------- checks
class Check(Protocol):
    @property
    def name(self) -> str: ...

    def applies(self, kind: str) -> bool: ...

    def fails(self, files: CellFiles) -> list[str]: ...


class StatusCheck:
    """status.json says ``ok`` (every phase ran)."""

    name = "status"

    def applies(self, kind: str) -> bool:
        return True

    def fails(self, files: CellFiles) -> list[str]:
        st = files.get(layout.STATUS_FILE)
        if st is None:
            return [files.problem(layout.STATUS_FILE)]
        if st.get("status") == "ok":
            return []
        tail = [str(line) for line in st.get("log_tail") or [] if str(line).strip()]
        text = (
            f"{files.where(layout.STATUS_FILE)}: {st.get('status')!s} in phase {st.get('phase')!s}: "
            f"{st.get('reason') or 'no reason recorded'}"
        )
        return [text + (f" — last log line: {tail[-1].strip()}" if tail else "")]


class CellFileCheck:
    """cell.json is present, readable and this cell's: without it nothing says what ran
    (build, argv, expectation), so nothing can pass."""

    name = "cell"

    def applies(self, kind: str) -> bool:
        return True

    def fails(self, files: CellFiles) -> list[str]:
        cj = files.get(layout.CELL_FILE)
        if cj is None:
            return [files.problem(layout.CELL_FILE)]
        problem = cell_problem(cj.get("cell"))  # the checks below read the cell's TP, kind, build
        if problem is not None:
            return [f"{files.where(layout.CELL_FILE)}: cell is not a complete cell record: {problem}"]
        return []


def checks_for(
    gate: GateSpec,
    bench: bool = False,
    load_answers: bool = False,
    load_plan: dict[str, Any] | None = None,
    planned: PlannedEval | None = None,
    answers_plan: tuple[tuple[str, int], ...] = (),
) -> list[Check]:
    """The checks a cell must pass under ``gate`` (status always; accuracy and consistency
    unless disabled; transfer with ``gate.max_failed_transfers``; load, required when
    ``bench`` (the run's ``bench.enabled``); load answers (:mod:`pdsweep.judge.load`),
    required when ``load_answers`` (``bench.enabled`` and ``bench.check``)); ``load_plan``: the load
    runs the plan asked for (:func:`pdsweep.judge.planned.load_plan`); ``planned``: the eval tasks and
    probe prompts (:mod:`pdsweep.judge.planned`; default: the sweep defaults); ``answers_plan``: the
    (workload, concurrency) pairs load_check.json must hold (:func:`pdsweep.judge.planned.planned_answers`)."""
    checks: list[Check] = [StatusCheck(), CellFileCheck(), BuildRecordCheck()]
    planned = planned or planned_eval({})
    if gate.require_accuracy:
        checks += [AccuracyCheck(), AccuracyRecompute(gate.alpha), PlannedTasksCheck(planned)]
    if gate.require_consistency:
        checks += [ConsistencyCheck(), ConsistencyRecompute(), PlannedPromptsCheck(planned)]
    checks += [TransferCheck(gate.max_failed_transfers), ReadPatternCheck(), IntegrityCheck()]
    checks.append(LoadCheck(required=bench, **(load_plan or {})))
    checks.append(LoadAnswersCheck(required=load_answers, planned=answers_plan))
    checks.append(PlannedReferenceCheck(planned))
    if gate.transports or gate.transports_cross_host:  # the UCX transport expected (pdsweep.judge.transfer)
        checks.append(TransportCheck(tuple(gate.transports or ()), tuple(gate.transports_cross_host or ())))
    return checks


# ---------------------------------------------------------------- verdicts
@dataclass(frozen=True)
class CellResult:
    """Gate outcome of one cell.

    ``reasons``: why it failed (FAIL, XFAIL), the stale-expectation note (XPASS), or the
    rejection (SKIPPED); empty for PASS.
    """

    cell_id: str
    kind: str
    verdict: str
    reasons: tuple[str, ...] = ()
    facts: CellFacts = field(default_factory=CellFacts)
    expect_reason: str | None = None
    expect_ref: str | None = None
    rule: str | None = None
    log_tail: tuple[str, ...] = ()
    match_any: bool = False  # expected to fail with `match: any` (any signature accepted)
    attempts: tuple[dict[str, Any], ...] = ()  # status.json ``retries``: the redeployed attempts

    @property
    def checks_passed(self) -> bool:
        """Every check passed, whatever was expected (PASS, XPASS or FLAKY)."""
        return self.verdict in (PASS, XPASS, FLAKY)

    @property
    def ok(self) -> bool:
        """Counts as success for the exit code (PASS, XFAIL, SKIPPED, NOT-RUNNABLE; FLAKY unless
        the gate's flaky policy fails it, :attr:`GateResult.failures`)."""
        return self.verdict in (PASS, XFAIL, SKIPPED, NOT_RUNNABLE, FLAKY)

    @property
    def expectation(self) -> str:
        ref = f" ({self.expect_ref})" if self.expect_ref else ""
        return f"{self.expect_reason or 'no reason given'}{ref}"

    @property
    def message(self) -> str:
        """One line: what a reader of the summary or CI log needs."""
        if self.verdict == SKIPPED:
            return f"rejected by rule {self.rule}: {'; '.join(self.reasons)}"
        if self.verdict == NOT_RUNNABLE:
            return f"not runnable here: {'; '.join(self.reasons)}"
        if self.verdict == XFAIL:
            return f"xfail: {'; '.join(self.reasons)} [expected: {self.expectation}]"
        if self.verdict == XPASS:
            return f"xpass: {XPASS_REASON} [expected: {self.expectation}]"
        if self.verdict == FLAKY:
            return f"flaky: {'; '.join(self.reasons)}"
        return "; ".join(self.reasons)


@dataclass(frozen=True)
class GateResult:
    """Gate outcome of a run: one :class:`CellResult` per cell of run.json (and plan.json),
    rejected cells included as SKIPPED. ``problems``: run-level failures (no cells)."""

    run_dir: Path
    run_name: str
    gate: GateSpec
    cells: tuple[CellResult, ...]
    problems: tuple[str, ...] = ()
    flaky_fails: bool = False  # FLAKY cells fail the run (gate.flaky_fails_nightly / _sweep)

    @property
    def counts(self) -> dict[str, int]:
        return {v: sum(c.verdict == v for c in self.cells) for v in VERDICTS}

    @property
    def failures(self) -> list[CellResult]:
        """FAIL and XPASS cells (and FLAKY ones when ``flaky_fails``)."""
        return [c for c in self.cells if not c.ok or (self.flaky_fails and c.verdict == FLAKY)]

    @property
    def passed(self) -> bool:
        """True when no cell is FAIL or XPASS and the run has no run-level problem."""
        return not self.failures and not self.problems

    def headline(self) -> str:
        """``PASSED|FAILED: 5 PASS, 1 XFAIL, ...`` (zero counts left out)."""
        counts = ", ".join(f"{n} {v}" for v, n in self.counts.items() if n)
        anyn = sum(c.match_any and c.verdict == XFAIL for c in self.cells)
        loud = f" ({anyn} XFAIL with 'match: {MATCH_ANY}': any failure accepted)" if anyn else ""
        return f"{'PASSED' if self.passed else 'FAILED'}: {counts or 'no cells'}{loud}"

    def cell(self, cell_id: str) -> CellResult:
        """The result of ``cell_id``; raises ``KeyError``."""
        for c in self.cells:
            if c.cell_id == cell_id:
                return c
        raise KeyError(cell_id)

    def raise_for_verdict(self) -> None:
        """Raise :class:`~pdsweep.core.errors.GateFailed` (one line per failure) unless ``passed``."""
        if not self.passed:
            lines = list(self.problems) + [f"{c.verdict} {c.cell_id}: {c.message}" for c in self.failures]
            raise GateFailed(f"gate failed for run {self.run_name}:\n" + "\n".join(lines))


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


NOT_UP_PHASES = (None, "prepare", "start")  # status.json phases before the instances were healthy


def judge_cell(
    files: CellFiles, kind: str, checks: list[Check], index_entry: dict[str, Any], fallback: Cell | None = None
) -> CellResult:
    """Apply ``checks`` to one cell and fold in its expectation (XFAIL/XPASS)."""
    reasons: list[str] = []
    for check in checks:
        if check.applies(kind):
            reasons += check.fails(files)
            if check.name == "status" and reasons:
                break  # a cell that did not finish has nothing else worth reading
    cell = cell_from_dict((files.get(layout.CELL_FILE) or {}).get("cell")) or fallback
    st = files.get(layout.STATUS_FILE) or {}
    expect = bool(_first(cell.expect_fail if cell else None, index_entry.get("expect_fail"), st.get("expect_fail")))
    expect_reason = _first(cell.expect_reason if cell else None, st.get("expect_reason"))
    expect_ref = _first(cell.expect_ref if cell else None, st.get("expect_ref"))
    pattern = _first(cell.expect_match if cell else None, st.get("expect_match"))
    came_up = st.get("status") == "ok" or (st.get("status") == "failed" and st.get("phase") not in NOT_UP_PHASES)
    if expect and reasons and (not came_up or files.get(layout.CELL_FILE) is None):
        # an expected failure must be seen failing: a cell that never ran, could not be
        # prepared or did not start proves nothing about the expectation
        verdict = FAIL
        reasons = [
            *reasons,
            f"expected to fail ({expect_reason or 'no reason'}), but the deployment never came "
            "up, so the expectation was not tested",
        ]
    elif expect and reasons and pattern is None:
        verdict = FAIL  # an expected failure without a signature could hide any lost result
        reasons = [
            *reasons,
            f"expected to fail ({expect_reason or 'no reason'}) but no 'match:' signature was recorded: "
            f"'expect: fail' needs 'match:' (or 'match: {MATCH_ANY}')",
        ]
    elif expect and reasons and pattern != MATCH_ANY and not signature_matches(pattern, reasons, st):
        verdict = FAIL
        reasons = [
            *reasons,
            f"expected to fail with a signature matching /{pattern}/ ({expect_reason}), but "
            "it failed otherwise: a different fault, not the expected one",
        ]
    elif expect and pattern != MATCH_ANY and (lost := unexplained_losses(pattern, reasons, files)):
        verdict = FAIL
        reasons = [
            *reasons,
            f"expected to fail with a signature matching /{pattern}/ ({expect_reason}), which does not name "
            f"these lost results: {'; '.join(lost)}",
        ]
    elif expect:
        verdict = XFAIL if reasons else XPASS
        reasons = reasons or [XPASS_REASON]
    else:
        verdict = FAIL if reasons else PASS
    if verdict == PASS and (why := flaky_reasons(st)):
        verdict, reasons = FLAKY, why
    tail = tuple(str(x) for x in st.get("log_tail") or []) if st.get("status") != "ok" else ()
    return CellResult(
        files.cell_id,
        kind,
        verdict,
        tuple(reasons),
        cell_facts(files, fallback),
        expect_reason,
        expect_ref,
        log_tail=tail,
        match_any=expect and pattern == MATCH_ANY,
        attempts=tuple(retried(st)),
    )


def gate_run(
    run_dir: Path, gate: GateSpec | None = None, require_all_cells: bool | None = None, nightly: bool = False
) -> GateResult:
    """Gate every cell of the run in ``run_dir`` (default ``GateSpec()``); ``nightly``
    picks ``gate.flaky_fails_nightly`` over ``gate.flaky_fails_sweep`` for FLAKY cells.

    Cells: those of run.json ``cells`` plus any of plan.json ``cells`` run.json lacks, in
    that order, then rejected cells that appear in neither. A cell listed in ``rejected``
    (run.json or plan.json) is SKIPPED, one the host had too few GPUs for NOT-RUNNABLE (FAIL
    with ``require_all_cells``, which overrides the run's ``gate.require_all_cells``). Raises
    ``UserError`` when run.json is missing or unreadable; never raises for a bad cell file
    (that cell fails).
    """
    run_dir = Path(run_dir)
    index, plan = read_index(run_dir)
    try:
        gate = gate or run_gate_spec(index)
    except UserError as e:
        raise UserError(f"{run_dir}/{e}") from None
    if require_all_cells is not None:
        gate = gate.model_copy(update={"require_all_cells": require_all_cells})
    entries = obj(index.get("cells"))
    planned, rejected = _planned_and_rejected(index, plan)
    order = list(dict.fromkeys([*entries, *(c for c in planned if c not in rejected), *rejected]))
    bench = obj(index.get("bench"))
    on = bench.get("enabled") is True
    answers = on and bench.get("check", True) is True and "workloads" in bench
    try:
        asked = planned_eval(index, plan)
    except UserError as e:
        raise UserError(f"{run_dir}/{e}") from None
    checks = checks_for(
        gate,
        bench=on,
        load_answers=answers,
        load_plan=load_plan(bench, index.get("platform")),
        planned=asked,
        answers_plan=planned_answers(bench) if answers else (),
    )
    results = []
    for cid in order:
        entry = obj(entries.get(cid))
        fallback = planned.get(cid)
        if cid in rejected:
            results.append(_rejected_result(run_dir, cid, entry, fallback, rejected[cid], gate))
            continue
        files = load_files(run_dir, cid)
        cj = (files.get(layout.CELL_FILE) or {}).get("cell") or {}
        # kind unknown: "pd", the strictest (transfer and consistency checks apply)
        st = files.get(layout.STATUS_FILE) or {}
        kind = strictest_kind(entry.get("kind"), cj.get("kind"), fallback.kind if fallback else None, st.get("kind"))
        res = judge_cell(files, kind, checks, entry, fallback)
        extra = disagreements(cid, entry, fallback, files, None) + record_disagreements(fallback, files)
        if extra:  # fails whatever was expected
            res = dataclasses.replace(res, verdict=FAIL, reasons=(*res.reasons, *extra))
        results.append(res)
    results = fold_in(results, index.get("folded"), _runner_missing)  # folded cells: their runner's verdict
    if damaged := frozen_problems(index, plan):  # no default stands in for the plan: every judged cell fails
        results = [_plan_damaged(r, damaged) for r in results]
    problems: tuple[str, ...] = (
        ()
        if any(r.verdict not in (SKIPPED, NOT_RUNNABLE) for r in results)
        else (f"{run_dir / layout.RUN_FILE}: no cell was meant to run",)
    )
    problems += tuple(
        f"{run_dir / cid}: a cell directory neither run.json nor plan.json lists (its results were never judged)"
        for cid in unlisted_cells(run_dir, set(order))
    )
    flaky_fails = gate.flaky_fails_nightly if nightly else gate.flaky_fails_sweep
    return GateResult(run_dir, str(index.get("name") or run_dir.name), gate, tuple(results), problems, flaky_fails)


def _plan_damaged(r: CellResult, damaged: list[str]) -> CellResult:
    """``r`` FAILed for the damaged plan (:func:`pdsweep.judge.planned.frozen_problems`), whatever was expected."""
    if r.verdict in (SKIPPED, NOT_RUNNABLE):
        return r
    why = tuple(f"the plan is damaged: {p}" for p in damaged)
    return dataclasses.replace(r, verdict=FAIL, reasons=(*r.reasons, *why) if r.verdict in (FAIL, XFAIL) else why)


def _runner_missing(alias: str, runner: str) -> CellResult:
    return CellResult(alias, "pd", FAIL, (f"folded into {runner}, which has no result in this run",))


def _planned_and_rejected(
    index: dict[str, Any], plan: dict[str, Any]
) -> tuple[dict[str, Cell], dict[str, tuple[str, str]]]:
    """plan.json's cells by id, and the rejected cells of run.json and plan.json as
    ``{cell_id: (rule, reason)}`` (a rejected cell's record joins the planned ones)."""
    planned = {c.id: c for c in map(cell_from_dict, plan.get("cells") or []) if c}
    rejected: dict[str, tuple[str, str]] = {}
    for r in list(index.get("rejected") or []) + list(plan.get("rejected") or []):
        if not isinstance(r, dict):
            continue
        rc = cell_from_dict(r.get("cell"))
        cid = r.get("cell_id") or (rc.id if rc else None)
        if cid:
            rejected.setdefault(cid, (str(r.get("rule")), str(r.get("reason"))))
            if rc:
                planned.setdefault(cid, rc)
    return planned, rejected


def _rejected_result(
    run_dir: Path,
    cid: str,
    entry: dict[str, Any],
    fallback: Cell | None,
    why: tuple[str, str],
    gate: GateSpec,
) -> CellResult:
    """A rejected cell's verdict: FAIL when it ran anyway (the run is not what was
    planned); SKIPPED when invalid; NOT-RUNNABLE when valid but this host could not place
    it (``layout.NEEDS_GPUS``), FAIL with ``gate.require_all_cells`` (cluster nightlies)."""
    rule, reason = why
    ran = disagreements(cid, entry, fallback, load_files(run_dir, cid), rule)
    if ran:
        return CellResult(cid, entry.get("kind") or "pd", FAIL, tuple(ran), rule=rule)
    verdict = SKIPPED
    if rule == layout.NEEDS_GPUS:
        verdict = FAIL if gate.require_all_cells else NOT_RUNNABLE
    if verdict == FAIL:
        reason = f"{cid}: not run: {reason} (gate.require_all_cells)"
    kind = entry.get("kind") or (fallback.kind if fallback else "pd")
    return CellResult(cid, kind, verdict, (reason,), cell_facts(CellFiles(cid), fallback), rule=rule)
