"""Gate: one verdict per cell of a run, from the files in results/<run>/ (see
results/README.md).

Verdicts: ``PASS``; ``FAIL``; ``XFAIL`` (expected to fail, and failed: ok for the exit
code, the evidence is kept); ``XPASS`` (expected to fail but passed: a failure, the
expectation is stale); ``SKIPPED`` (rejected by a plan rule: not a failure).

Fail closed: a missing or unreadable file, a ``null``/NaN number where a check needs
one, or a cell that did not finish is a FAIL whose reason names the cell and the file,
e.g. ``kimi-linear.p2d1.b16-16.fixed/accuracy.json: missing``.

Each check is a small object whose ``fails(cell)`` returns readable reasons (empty: the
check passes); :func:`checks_for` builds them from a :class:`~pdsweep.spec.GateSpec`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from . import layout
from .errors import GateFailed
from .facts import CellFacts, CellFiles, cell_facts, cell_from_dict, load_files, read_index, run_gate_spec, show, \
    task_score, worst_prompt
from .cell import Cell
from .spec import GateSpec
from .stats import num

PASS, FAIL, XFAIL, XPASS, SKIPPED = "PASS", "FAIL", "XFAIL", "XPASS", "SKIPPED"
VERDICTS = (PASS, FAIL, XFAIL, XPASS, SKIPPED)
XPASS_REASON = "expected to fail but passed; remove the expectation or investigate"


# ---------------------------------------------------------------- checks
class Check(Protocol):
    name: str

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
        text = (f"{files.where(layout.STATUS_FILE)}: {st.get('status')!s} in phase {st.get('phase')!s}: "
                f"{st.get('reason') or 'no reason recorded'}")
        return [text + (f" — last log line: {tail[-1].strip()}" if tail else "")]


class CellFileCheck:
    """cell.json is present, readable and this cell's: without it nothing says what ran
    (build, argv, expectation), so nothing can pass."""

    name = "cell"

    def applies(self, kind: str) -> bool:
        return True

    def fails(self, files: CellFiles) -> list[str]:
        return [] if files.get(layout.CELL_FILE) is not None else [files.problem(layout.CELL_FILE)]


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
            f"verdict {show(con.get('verdict'))} (worst prompt: {worst_prompt(con.get('prompts')) or 'none'})"]
        tri = con.get("triage") if isinstance(con.get("triage"), dict) else {}
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
    kv_requests``, counted by the PD proxy). A null (unexposed) counter fails: "metric missing"."""

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
        for key, limit in (("failed_transfers", self.max_failed), ("failed_notifications", 0), ("expired_reqs", 0)):
            v = num(totals.get(key))
            if v is None:
                out.append(f"{w}: totals.{key} is {show(totals.get(key))} (metric missing)")
            elif v > limit:
                out.append(f"{w}: totals.{key} = {v:g} (allowed: {limit})")
        moved = {k: num(totals.get(k)) for k in ("num_transfers", "bytes")}
        missing = [k for k, v in moved.items() if v is None]
        if missing:
            out += [f"{w}: totals.{k} is {show(totals.get(k))} (metric missing)" for k in missing]
        elif min(moved.values()) <= 0:  # type: ignore[type-var]
            out.append(f"{w}: no KV transferred (num_transfers {moved['num_transfers']:g}, "
                       f"bytes {moved['bytes']:g}): decode did not receive KV from prefill")
            return out
        kv_requests = num(totals.get("kv_requests"))
        if kv_requests is None:
            out.append(f"{w}: totals.kv_requests is {show(totals.get('kv_requests'))} (metric missing: the PD "
                       "proxy's count of requests spanning >= 1 block)")
        elif moved["num_transfers"] is not None and moved["num_transfers"] < kv_requests:
            out.append(f"{w}: decode did {moved['num_transfers']:g} KV transfers for {kv_requests:g} PD requests "
                       "whose prompt spans >= 1 block: the others were recomputed on decode (silent recompute)")
        return out


# transfer.json totals that count things (non-negative integers) and that measure
# things (non-negative finite numbers); pdsweep.metrics._summary writes them
COUNT_TOTALS = ("num_transfers", "bytes", "failed_transfers", "failed_notifications", "expired_reqs",
                "num_requests")
MEASURE_TOTALS = ("xfer_time_s", "post_time_s", "gbps_xfer", "gbps_wall", "xfer_time_p50_s", "xfer_time_p90_s",
                  "xfer_time_p99_s", "descriptors_per_transfer", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s",
                  "tpot_mean_s", "itl_mean_s", "e2e_mean_s")


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
        if not isinstance(runs, list) or not runs:
            return [f"{w}: no load runs"]
        out = []
        for r in runs:
            r = r if isinstance(r, dict) else {}
            conc, want = r.get("concurrency"), num(r.get("num_prompts"))
            done, errors = num(r.get("completed")), num(r.get("errors"))
            if want is None or done is None or errors is None:
                out.append(f"{w}: concurrency {show(conc)}: num_prompts/completed/errors is "
                           f"{show(r.get('num_prompts'))}/{show(r.get('completed'))}/{show(r.get('errors'))} "
                           "(missing)")
            elif errors > 0 or done < want:
                out.append(f"{w}: concurrency {show(conc)}: {errors:g} load requests failed, completed {done:g} "
                           f"of num_prompts {want:g} (vllm bench serve exits 0 regardless)")
        return out


def checks_for(gate: GateSpec, bench: bool = False) -> list[Check]:
    """The checks a cell must pass under ``gate`` (status always; accuracy and consistency
    unless disabled; transfer with ``gate.max_failed_transfers``; load, required when
    ``bench`` (the run's ``bench.enabled``))."""
    checks: list[Check] = [StatusCheck(), CellFileCheck()]
    if gate.require_accuracy:
        checks.append(AccuracyCheck())
    if gate.require_consistency:
        checks.append(ConsistencyCheck())
    checks.append(TransferCheck(gate.max_failed_transfers))
    checks.append(LoadCheck(required=bench))
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

    @property
    def checks_passed(self) -> bool:
        """Every check passed, whatever was expected (PASS or XPASS)."""
        return self.verdict in (PASS, XPASS)

    @property
    def ok(self) -> bool:
        """Counts as success for the exit code (PASS, XFAIL, SKIPPED)."""
        return self.verdict in (PASS, XFAIL, SKIPPED)

    @property
    def expectation(self) -> str:
        ref = f" ({self.expect_ref})" if self.expect_ref else ""
        return f"{self.expect_reason or 'no reason given'}{ref}"

    @property
    def message(self) -> str:
        """One line: what a reader of the summary or CI log needs."""
        if self.verdict == SKIPPED:
            return f"rejected by rule {self.rule}: {'; '.join(self.reasons)}"
        if self.verdict == XFAIL:
            return f"xfail: {'; '.join(self.reasons)} [expected: {self.expectation}]"
        if self.verdict == XPASS:
            return f"xpass: {XPASS_REASON} [expected: {self.expectation}]"
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

    @property
    def counts(self) -> dict[str, int]:
        return {v: sum(c.verdict == v for c in self.cells) for v in VERDICTS}

    @property
    def failures(self) -> list[CellResult]:
        """FAIL and XPASS cells."""
        return [c for c in self.cells if not c.ok]

    @property
    def passed(self) -> bool:
        """True when no cell is FAIL or XPASS and the run has no run-level problem."""
        return not self.failures and not self.problems

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    def headline(self) -> str:
        """``PASSED|FAILED: 5 PASS, 1 XFAIL, ...`` (zero counts left out)."""
        counts = ", ".join(f"{n} {v}" for v, n in self.counts.items() if n)
        return f"{'PASSED' if self.passed else 'FAILED'}: {counts or 'no cells'}"

    def cell(self, cell_id: str) -> CellResult:
        """The result of ``cell_id``; raises ``KeyError``."""
        for c in self.cells:
            if c.cell_id == cell_id:
                return c
        raise KeyError(cell_id)

    def raise_for_verdict(self) -> None:
        """Raise :class:`~pdsweep.errors.GateFailed` (one line per failure) unless ``passed``."""
        if not self.passed:
            lines = list(self.problems) + [f"{c.verdict} {c.cell_id}: {c.message}" for c in self.failures]
            raise GateFailed(f"gate failed for run {self.run_name}:\n" + "\n".join(lines))


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


NOT_UP_PHASES = (None, "prepare", "start")  # status.json phases before the instances were healthy


def judge_cell(files: CellFiles, kind: str, checks: list[Check], index_entry: dict[str, Any],
               fallback: Cell | None = None) -> CellResult:
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
    came_up = st.get("status") == "ok" or (st.get("status") == "failed" and st.get("phase") not in NOT_UP_PHASES)
    if expect and reasons and (not came_up or files.get(layout.CELL_FILE) is None):
        # an expected failure must be seen failing: a cell that never ran, could not be
        # prepared or did not start proves nothing about the expectation
        verdict = FAIL
        reasons = [*reasons, f"expected to fail ({expect_reason or 'no reason'}), but the deployment never came "
                             "up, so the expectation was not tested"]
    elif expect and reasons and (pattern := _first(cell.expect_match if cell else None, st.get("expect_match"))) \
            and not _signature_matches(pattern, reasons, st):
        verdict = FAIL
        reasons = [*reasons, f"expected to fail with a signature matching /{pattern}/ ({expect_reason}), but "
                             "it failed otherwise: a different fault, not the expected one"]
    elif expect:
        verdict = XFAIL if reasons else XPASS
        reasons = reasons or [XPASS_REASON]
    else:
        verdict = FAIL if reasons else PASS
    tail = tuple(str(x) for x in st.get("log_tail") or []) if st.get("status") != "ok" else ()
    return CellResult(files.cell_id, kind, verdict, tuple(reasons), cell_facts(files, fallback),
                      expect_reason, expect_ref, log_tail=tail)


def _signature_matches(pattern: str, reasons: list[str], status: dict[str, Any]) -> bool:
    """``pattern`` (a ``match:`` regex) searched in the gate's reasons, the status reason and
    the failing instance's log tail; an unusable pattern never matches (fail closed)."""
    text = "\n".join([*reasons, str(status.get("reason") or ""), *map(str, status.get("log_tail") or [])])
    try:
        return re.search(pattern, text) is not None
    except re.error:
        return False




def gate_run(run_dir: Path, gate: GateSpec | None = None) -> GateResult:
    """Gate every cell of the run in ``run_dir`` (default ``GateSpec()``).

    Cells: those of run.json ``cells`` plus any of plan.json ``cells`` run.json lacks, in
    that order, then rejected cells that appear in neither. A cell listed in ``rejected``
    (run.json or plan.json) is SKIPPED. Raises ``UserError`` when run.json is missing or
    unreadable; never raises for a bad cell file (that cell fails).
    """
    run_dir = Path(run_dir)
    index, plan = read_index(run_dir)
    gate = gate or run_gate_spec(index)
    entries = index.get("cells") if isinstance(index.get("cells"), dict) else {}
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
    bench = index.get("bench") if isinstance(index.get("bench"), dict) else {}
    checks = checks_for(gate, bench=bench.get("enabled") is True)
    results = []
    for cid in order:
        entry = entries.get(cid) if isinstance(entries.get(cid), dict) else {}
        fallback = planned.get(cid)
        if cid in rejected:
            rule, reason = rejected[cid]
            # invalid cells are SKIPPED; valid cells this host could not place were meant to run: FAIL
            verdict = FAIL if rule == layout.NEEDS_GPUS else SKIPPED
            if verdict == FAIL:
                reason = f"{cid}: not run: {reason}"
            results.append(CellResult(cid, entry.get("kind") or (fallback.kind if fallback else "pd"), verdict,
                                      (reason,), cell_facts(CellFiles(cid), fallback), rule=rule))
            continue
        files = load_files(run_dir, cid)
        cj = (files.get(layout.CELL_FILE) or {}).get("cell") or {}
        # kind unknown: "pd", the strictest (transfer and consistency checks apply)
        kind = _first(entry.get("kind"), cj.get("kind"), fallback.kind if fallback else None, "pd")
        results.append(judge_cell(files, kind, checks, entry, fallback))
    problems = () if any(r.verdict != SKIPPED for r in results) else (
        f"{run_dir / layout.RUN_FILE}: no cell was meant to run",)
    return GateResult(run_dir, str(index.get("name") or run_dir.name), gate, tuple(results), problems)
