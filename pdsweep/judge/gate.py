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
check passes); :func:`checks_for` builds them from a :class:`~pdsweep.spec.sweep.GateSpec`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pdsweep.core.errors import GateFailed, UserError
from pdsweep.core.logscan import READ_FAULT_TAG
from pdsweep.core.stats import num, obj
from pdsweep.judge.facts import (
    CellFacts,
    CellFiles,
    cell_facts,
    cell_from_dict,
    cell_problem,
    load_files,
    read_index,
    run_gate_spec,
    show,
    task_score,
    worst_prompt,
)
from pdsweep.judge.flaky import FLAKY, flaky_reasons, retried
from pdsweep.judge.loadgate import LoadAnswersCheck
from pdsweep.judge.recompute import (
    AccuracyRecompute,
    ConsistencyRecompute,
    ReadPatternCheck,
    disagreements,
    strictest_kind,
    unlisted_cells,
)
from pdsweep.plan.cell import Cell
from pdsweep.results import layout
from pdsweep.spec.sweep import MATCH_ANY, GateSpec, read_fault_every

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


class AccuracyCheck:
    """accuracy.json: verdict pass, every task pass with a value and a sample count;
    a stated expectation or reference must come with its numbers (and the p-value)."""

    name = "accuracy"

    def applies(self, kind: str) -> bool:
        return True

    def fails(self, files: CellFiles) -> list[str]:
        acc = files.get(layout.ACCURACY_FILE)
        if acc is None:
            return [files.problem(layout.ACCURACY_FILE)]
        w = files.where(layout.ACCURACY_FILE)
        tasks = acc.get("tasks")
        if not isinstance(tasks, dict) or not tasks:
            return [f"{w}: no tasks"]
        out: list[str] = []
        for name, t in tasks.items():
            if not isinstance(t, dict):
                out.append(f"{w}: task {name}: not an object")
                continue
            s = task_score(name, t)
            if s.verdict != "pass":
                why = [str(r) for r in t.get("reasons") or []] or [f"verdict {show(s.verdict)}"]
                out += [f"{w}: {r}" if r.startswith(f"{name}:") else f"{w}: {name}: {r}" for r in why]
                continue
            # the file says pass: the numbers behind that must be there (fail closed)
            if s.value is None:
                out.append(f"{w}: {name}: value is {show(t.get('value'))} (metric missing)")
            if s.n is None or s.n <= 0:
                out.append(f"{w}: {name}: sample count n is {show(t.get('n'))}")
            if t.get("expected") is not None and (s.expected is None or s.tolerance is None):
                out.append(f"{w}: {name}: expected value or tolerance missing")
            if t.get("reference") is not None and (s.reference is None or s.p_value is None):
                out.append(f"{w}: {name}: reference value or p_value missing")
        if acc.get("verdict") != "pass" and not out:
            out.append(f"{w}: verdict {show(acc.get('verdict'))}")
        return out


class ConsistencyCheck:
    """consistency.json (PD cells): verdict pass over at least one prompt."""

    name = "consistency"

    def applies(self, kind: str) -> bool:
        return kind != "ref"

    def fails(self, files: CellFiles) -> list[str]:
        con = files.get(layout.CONSISTENCY_FILE)
        if con is None:
            return [files.problem(layout.CONSISTENCY_FILE)]
        w = files.where(layout.CONSISTENCY_FILE)
        if con.get("verdict") == "pass":
            return [] if con.get("prompts") else [f"{w}: no prompts compared"]
        why = [str(r) for r in con.get("reasons") or []] or [
            f"verdict {show(con.get('verdict'))} (worst prompt: {worst_prompt(con.get('prompts')) or 'none'})"
        ]
        tri = obj(con.get("triage"))
        if tri.get("verdict") not in (None, "none"):
            why.append(f"triage {tri['verdict']}: {tri.get('explanation')}")
        return [f"{w}: {r}" for r in why]


@dataclass(frozen=True)
class TransferCheck:
    """transfer.json totals (PD cells): KV was transferred (``num_transfers`` and
    ``bytes`` > 0), ``failed_transfers <= max_failed``, ``failed_notifications == 0``,
    no prefill request's KV lease expired (``expired_reqs == 0``: vLLM counts
    ``vllm:nixl_num_kv_expired_reqs`` on prefill when decode never read the blocks, and
    decode then silently recomputed: vLLM issue 52234), and decode did at least one
    transfer per PD request whose prompt spans >= 1 block (``num_transfers >=
    kv_requests``, counted by the PD proxy; a failed transfer counts, it is not silent). A null
    (unexposed) counter fails: "metric missing".

    READ failures the ``fail-read-1-in-K`` drill injected (transfer.json ``read_faults``,
    :mod:`pdsweep.engine.readfault`) are allowed on top of ``max_failed``, and vLLM must count
    each (``failed_transfers >= injected``); a drill cell that injected none fails (the drill
    did not run). Any request vLLM failed after a KV load failure (``read_faults.failed_reqs``:
    ``kv_load_failure_policy: fail``, vLLM ``v1/core/sched/scheduler.py``
    ``_handle_invalid_blocks``) fails the cell naming it."""

    max_failed: int = 0
    name: str = "transfer"

    def applies(self, kind: str) -> bool:
        return kind != "ref"

    def fails(self, files: CellFiles) -> list[str]:
        tr = files.get(layout.TRANSFER_FILE)
        if tr is None:
            return [files.problem(layout.TRANSFER_FILE)]
        w = files.where(layout.TRANSFER_FILE)
        totals = tr.get("totals")
        if not isinstance(totals, dict):
            return [f"{w}: no totals"]
        out = impossible_totals(totals, w)
        faults, injected, fault_why = read_faults(files)
        out += fault_why
        for key, limit in (
            ("failed_transfers", self.max_failed + injected),
            ("failed_notifications", 0),
            ("expired_reqs", 0),
        ):
            v = num(totals.get(key))
            if v is None:
                out.append(f"{w}: totals.{key} is {show(totals.get(key))} (metric missing)")
            elif v > limit:
                out.append(f"{w}: totals.{key} = {v:g} (allowed: {limit})")
            elif key == "failed_transfers" and v < injected:
                out.append(
                    f"{w}: vLLM counted {v:g} failed transfers for {injected} injected READ failures "
                    "(vllm:nixl_num_failed_transfers): a failed READ went unseen"
                )
        if failed_reqs := num(faults.get("failed_reqs")):
            out.append(
                f"{w}: decode failed {failed_reqs:g} request(s) after a KV load failure "
                "(kv_load_failure_policy: fail; vLLM v1/core/sched/scheduler.py _handle_invalid_blocks)"
            )
        moved = {k: num(totals.get(k)) for k in ("num_transfers", "bytes")}
        missing = [k for k, v in moved.items() if v is None]
        if missing:
            out += [f"{w}: totals.{k} is {show(totals.get(k))} (metric missing)" for k in missing]
        elif any(v is not None and v <= 0 for v in moved.values()):  # no None left: `missing` is empty
            out.append(
                f"{w}: no KV transferred (num_transfers {moved['num_transfers']:g}, "
                f"bytes {moved['bytes']:g}): decode did not receive KV from prefill"
            )
            return out
        kv_requests = num(totals.get("kv_requests"))
        if kv_requests is None:
            out.append(
                f"{w}: totals.kv_requests is {show(totals.get('kv_requests'))} (metric missing: the PD "
                "proxy's count of requests spanning >= 1 block)"
            )
        elif (
            moved["num_transfers"] is not None
            and moved["num_transfers"] + (num(totals.get("failed_transfers")) or 0) < kv_requests
        ):
            out.append(
                f"{w}: decode did {moved['num_transfers']:g} KV transfers for {kv_requests:g} PD requests "
                "whose prompt spans >= 1 block: the others were recomputed on decode (silent recompute)"
            )
        return out


def read_faults(files: CellFiles) -> tuple[dict[str, Any], int, list[str]]:
    """transfer.json ``read_faults`` (absent in runs before it: none), READ failures injected,
    and why it cannot be used: an impossible count, or a ``fail-read-1-in-K`` drill cell
    (cell.json ``cell.fault``) that injected none."""
    w = files.where(layout.TRANSFER_FILE)
    faults = obj((files.get(layout.TRANSFER_FILE) or {}).get("read_faults"))
    why = [
        f"{w}: read_faults.{k} is {show(v)} (allowed: an integer >= 0)"
        for k, v in faults.items()
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0)
    ]
    raw = faults.get("injected")
    injected = raw if not why and isinstance(raw, int) else 0
    fault = obj(obj(files.get(layout.CELL_FILE)).get("cell")).get("fault")
    if read_fault_every(fault if isinstance(fault, str) else None) and not injected:
        why.append(
            f"{w}: fault drill {fault} injected no READ failure (no {READ_FAULT_TAG} line in the decode "
            "log): the drill did not run"
        )
    return faults, injected, why


# transfer.json totals that count things (non-negative integers) and that measure
# things (non-negative finite numbers); pdsweep.measure.metrics._summary writes them
COUNT_TOTALS = (
    "num_transfers",
    "bytes",
    "failed_transfers",
    "failed_notifications",
    "expired_reqs",
    "num_requests",
    "kv_requests",
)
MEASURE_TOTALS = (
    "xfer_time_s",
    "post_time_s",
    "gbps_xfer",
    "gbps_wall",
    "xfer_time_p50_s",
    "xfer_time_p90_s",
    "xfer_time_p99_s",
    "descriptors_per_transfer",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_mean_s",
    "itl_mean_s",
    "e2e_mean_s",
)


def impossible_totals(totals: dict[str, Any], where: str) -> list[str]:
    """Why values of transfer.json ``totals`` cannot be real: a count that is not a
    non-negative integer (Prometheus counters and histogram counts never are), a
    measure that is not a non-negative finite number, or a string/bool where a number
    belongs. ``null`` is allowed here (an unexposed metric; the checks that need one
    fail on it). Returns one reason per field, naming ``where`` (``cell/transfer.json``)."""
    out = []
    for key in COUNT_TOTALS + MEASURE_TOTALS:
        v = totals.get(key)
        if v is None:
            continue
        x = num(v)
        if x is None:
            out.append(f"{where}: totals.{key} is {show(v)}: not a finite number")
        elif x < 0:
            out.append(f"{where}: totals.{key} = {x:g}: negative (allowed: >= 0)")
        elif key in COUNT_TOTALS and x != int(x):
            out.append(f"{where}: totals.{key} = {x:g}: a count must be a whole number")
    return out


@dataclass(frozen=True)
class LoadCheck:
    """load.json (the bench phase, ``vllm bench serve``): every run completed all its
    prompts with no failed request. ``vllm bench serve`` exits 0 even when every request
    failed (it only warns), so its own exit code proves nothing. ``required``: the sweep's
    ``bench.enabled`` (frozen in run.json); a load.json present is checked either way."""

    required: bool = False
    name: str = "load"

    def applies(self, kind: str) -> bool:
        return True

    def fails(self, files: CellFiles) -> list[str]:
        body = files.get(layout.LOAD_FILE)
        if body is None:
            missing = files.problems.get(layout.LOAD_FILE, "missing") == "missing"
            return [files.problem(layout.LOAD_FILE)] if self.required or not missing else []
        w = files.where(layout.LOAD_FILE)
        runs = body.get("runs")
        if runs == [] and body.get("workloads"):  # no `random` workload: no vllm bench serve run
            return []
        if not isinstance(runs, list) or not runs:
            return [f"{w}: no load runs"]
        out = []
        for r in runs:
            r = r if isinstance(r, dict) else {}
            conc, want = r.get("concurrency"), num(r.get("num_prompts"))
            done, errors = num(r.get("completed")), num(r.get("errors"))
            if want is None or done is None or errors is None:
                out.append(
                    f"{w}: concurrency {show(conc)}: num_prompts/completed/errors is "
                    f"{show(r.get('num_prompts'))}/{show(r.get('completed'))}/{show(r.get('errors'))} "
                    "(missing)"
                )
            elif errors > 0 or done < want:
                out.append(
                    f"{w}: concurrency {show(conc)}: {errors:g} load requests failed, completed {done:g} "
                    f"of num_prompts {want:g} (vllm bench serve exits 0 regardless)"
                )
        return out


def checks_for(gate: GateSpec, bench: bool = False, load_answers: bool = False) -> list[Check]:
    """The checks a cell must pass under ``gate`` (status always; accuracy and consistency
    unless disabled; transfer with ``gate.max_failed_transfers``; load, required when
    ``bench`` (the run's ``bench.enabled``); load answers (:mod:`pdsweep.judge.loadgate`),
    required when ``load_answers`` (``bench.enabled`` and ``bench.check``))."""
    checks: list[Check] = [StatusCheck(), CellFileCheck()]
    if gate.require_accuracy:
        checks += [AccuracyCheck(), AccuracyRecompute(gate.alpha)]
    if gate.require_consistency:
        checks += [ConsistencyCheck(), ConsistencyRecompute()]
    checks += [TransferCheck(gate.max_failed_transfers), ReadPatternCheck()]
    checks.append(LoadCheck(required=bench))
    checks.append(LoadAnswersCheck(required=load_answers))
    if gate.transports or gate.transports_cross_host:  # the UCX transport expected (pdsweep.judge.transports)
        from pdsweep.judge.transports import TransportCheck

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
    elif expect and reasons and pattern != MATCH_ANY and not _signature_matches(pattern, reasons, st):
        verdict = FAIL
        reasons = [
            *reasons,
            f"expected to fail with a signature matching /{pattern}/ ({expect_reason}), but "
            "it failed otherwise: a different fault, not the expected one",
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


def _signature_matches(pattern: str, reasons: list[str], status: dict[str, Any]) -> bool:
    """``pattern`` (a ``match:`` regex) searched in the gate's reasons, the status reason and
    the failing instance's log tail; an unusable pattern never matches (fail closed)."""
    text = "\n".join([*reasons, str(status.get("reason") or ""), *map(str, status.get("log_tail") or [])])
    try:
        return re.search(pattern, text) is not None
    except re.error:
        return False


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
    order = list(dict.fromkeys([*entries, *(c for c in planned if c not in rejected), *rejected]))
    bench = obj(index.get("bench"))
    on = bench.get("enabled") is True
    checks = checks_for(gate, bench=on, load_answers=on and bench.get("check", True) is True and "workloads" in bench)
    results = []
    for cid in order:
        entry = obj(entries.get(cid))
        fallback = planned.get(cid)
        if cid in rejected:
            rule, reason = rejected[cid]
            ran = disagreements(cid, entry, fallback, load_files(run_dir, cid), rule)
            if ran:  # rejected in the plan, yet it ran: the run is not what was planned
                results.append(CellResult(cid, entry.get("kind") or "pd", FAIL, tuple(ran), rule=rule))
                continue
            # invalid cells are SKIPPED; valid cells this host could not place: NOT-RUNNABLE,
            # FAIL when every cell must run (cluster nightlies)
            verdict = SKIPPED
            if rule == layout.NEEDS_GPUS:
                verdict = FAIL if gate.require_all_cells else NOT_RUNNABLE
            if verdict == FAIL:
                reason = f"{cid}: not run: {reason} (gate.require_all_cells)"
            results.append(
                CellResult(
                    cid,
                    entry.get("kind") or (fallback.kind if fallback else "pd"),
                    verdict,
                    (reason,),
                    cell_facts(CellFiles(cid), fallback),
                    rule=rule,
                )
            )
            continue
        files = load_files(run_dir, cid)
        cj = (files.get(layout.CELL_FILE) or {}).get("cell") or {}
        # kind unknown: "pd", the strictest (transfer and consistency checks apply)
        st = files.get(layout.STATUS_FILE) or {}
        kind = strictest_kind(entry.get("kind"), cj.get("kind"), fallback.kind if fallback else None, st.get("kind"))
        res = judge_cell(files, kind, checks, entry, fallback)
        if extra := disagreements(cid, entry, fallback, files, None):  # fails whatever was expected
            res = dataclasses.replace(res, verdict=FAIL, reasons=(*res.reasons, *extra))
        results.append(res)
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
