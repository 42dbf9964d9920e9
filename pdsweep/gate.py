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

import dataclasses
import json
import math
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import typing

from pydantic import ConfigDict, ValidationError, create_model

from . import layout
from .errors import GateFailed, UserError
from .results_schema import type_problem
from .plan import Cell
from .spec import GateSpec

PASS, FAIL, XFAIL, XPASS, SKIPPED = "PASS", "FAIL", "XFAIL", "XPASS", "SKIPPED"
VERDICTS = (PASS, FAIL, XFAIL, XPASS, SKIPPED)
XPASS_REASON = "expected to fail but passed; remove the expectation or investigate"
CELL_FILES = (layout.CELL_FILE, layout.STATUS_FILE, layout.ACCURACY_FILE, layout.CONSISTENCY_FILE,
              layout.TRANSFER_FILE, layout.LOAD_FILE)


def num(x: Any) -> float | None:
    """``x`` as a finite float, or None (null, NaN, inf, bool, string: not a number)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    try:
        return float(x) if math.isfinite(x) else None
    except OverflowError:  # an int beyond float range (e.g. 10**400 in a corrupt file)
        return None


def show(x: Any) -> str:
    """A value as the JSON file spells it (``null``, ``"N/A"``, ``NaN``)."""
    return json.dumps(x, default=str)


# ---------------------------------------------------------------- reading one cell
@dataclass
class CellFiles:
    """The JSON files of one cell, each read once. ``data[name]`` holds a usable file;
    ``problems[name]`` says why a file is not usable (missing, unreadable, foreign)."""

    cell_id: str
    data: dict[str, dict[str, Any]] = field(default_factory=dict)
    problems: dict[str, str] = field(default_factory=dict)

    def get(self, name: str) -> dict[str, Any] | None:
        return self.data.get(name)

    def where(self, name: str) -> str:
        return f"{self.cell_id}/{name}"

    def problem(self, name: str) -> str:
        return f"{self.where(name)}: {self.problems.get(name, 'missing')}"


def load_files(run_dir: Path, cell_id: str) -> CellFiles:
    """Read every per-cell JSON file of ``cell_id``; never raises for a bad file."""
    files = CellFiles(cell_id)
    cdir = layout.cell_dir(run_dir, cell_id)
    for name in CELL_FILES:
        path = cdir / name
        try:
            data = layout.read_json(path)
        except FileNotFoundError:
            files.problems[name] = "missing" if cdir.is_dir() else "missing (no cell directory: never ran?)"
            continue
        except UserError as e:
            files.problems[name] = "unreadable: " + str(e).removeprefix(f"{path}: ").removeprefix(
                "unreadable results file: ")
            continue
        if (bad := type_problem(name, data)) is not None:
            files.problems[name] = f"unreadable: {bad}"
            continue
        owner = data.get("cell_id", data.get("cell", {}).get("id") if isinstance(data.get("cell"), dict) else None)
        if owner not in (None, cell_id):
            files.problems[name] = f"belongs to cell '{owner}'"
            continue
        files.data[name] = data
    return files


# ---------------------------------------------------------------- facts (for tables, plots, compare)
@dataclass(frozen=True)
class TaskScore:
    """One accuracy task. Numbers are None where the file has none (or null/NaN);
    ``stderr`` may be the string ``"N/A"`` (lm-eval could not compute it)."""

    task: str
    metric: str | None = None
    value: float | None = None
    stderr: float | str | None = None
    n: int | None = None
    expected: float | None = None
    tolerance: float | None = None
    reference: float | None = None
    reference_cell: str | None = None
    p_value: float | None = None
    verdict: str | None = None


@dataclass(frozen=True)
class CellFacts:
    """What a cell's files say, tolerant of anything missing (all fields optional).

    ``totals`` is transfer.json ``totals`` (bytes in bytes, times in s, rates in GB/s);
    ``worst_prompt`` describes the consistency prompt with the lowest exact-match rate.
    """

    model: str | None = None
    prefill_tp: int | None = None
    decode_tp: int | None = None
    build: str | None = None
    compare_key: str | None = None
    config_hash: str | None = None
    status: str | None = None
    phase: str | None = None
    duration_s: float | None = None
    tasks: tuple[TaskScore, ...] = ()
    consistency: str | None = None
    worst_prompt: str | None = None
    totals: dict[str, Any] = field(default_factory=dict)

    def total(self, key: str) -> float | None:
        return num(self.totals.get(key))


def cell_from_dict(d: Any) -> Cell | None:
    """A :class:`~pdsweep.plan.Cell` from ``Cell.to_dict()`` output, or None if it does not fit."""
    if not isinstance(d, dict):
        return None
    try:  # typed as the dataclass says (a corrupt file's true/10**400/"x" is no cell)
        kw = {f.name: d[f.name] for f in dataclasses.fields(Cell) if f.name in d}
        if isinstance(kw.get("expect_without"), list):  # JSON has no tuples
            kw["expect_without"] = tuple(kw["expect_without"])
        return Cell(**_CELL.model_validate(kw).model_dump(exclude_unset=True))
    except (TypeError, ValidationError):
        return None


_CELL = create_model("CellFields", __config__=ConfigDict(strict=True), **{
    f.name: (typing.get_type_hints(Cell)[f.name], f.default if f.default is not dataclasses.MISSING else ...)
    for f in dataclasses.fields(Cell)})


def _task(name: str, t: dict[str, Any]) -> TaskScore:
    exp = t.get("expected") if isinstance(t.get("expected"), dict) else {}
    ref = t.get("reference") if isinstance(t.get("reference"), dict) else {}
    se = t.get("stderr")
    n = t.get("n")
    return TaskScore(task=name, metric=t.get("metric"), value=num(t.get("value")),
                     stderr=se if isinstance(se, str) else num(se),
                     n=n if isinstance(n, int) and not isinstance(n, bool) else None,
                     expected=num(exp.get("value")), tolerance=num(exp.get("tolerance")),
                     reference=num(ref.get("value")), reference_cell=ref.get("cell_id"),
                     p_value=num(t.get("p_value")), verdict=t.get("verdict"))


def _worst_prompt(prompts: Any) -> str | None:
    rows = [p for p in prompts if isinstance(p, dict)] if isinstance(prompts, list) else []
    if not rows:
        return None
    worst = min(rows, key=lambda p: (num(p.get("exact_match_rate")) is not None, num(p.get("exact_match_rate")) or 0))
    rate = num(worst.get("exact_match_rate"))
    text = f"{worst.get('name', '?')}: " + (f"{rate:.0%} match" if rate is not None else "match n/a")
    if worst.get("first_divergence") is not None:
        text += f", diverges at token {worst['first_divergence']}"
    return text


def cell_facts(files: CellFiles, fallback: Cell | None = None) -> CellFacts:
    """Facts of one cell from its files; ``fallback`` (from plan.json) fills in the cell
    identity when cell.json is unusable."""
    cj = files.get(layout.CELL_FILE) or {}
    cell = cell_from_dict(cj.get("cell")) or fallback
    st = files.get(layout.STATUS_FILE) or {}
    acc = files.get(layout.ACCURACY_FILE) or {}
    con = files.get(layout.CONSISTENCY_FILE) or {}
    tr = files.get(layout.TRANSFER_FILE) or {}
    tasks = acc.get("tasks") if isinstance(acc.get("tasks"), dict) else {}
    return CellFacts(
        model=cell.model if cell else None,
        prefill_tp=cell.prefill_tp if cell else None,
        decode_tp=cell.decode_tp if cell else None,
        build=cell.build if cell else None,
        compare_key=cj.get("compare_key") or (cell.compare_key if cell else None),
        config_hash=cj.get("config_hash"),
        status=st.get("status"), phase=st.get("phase"), duration_s=num(st.get("duration_s")),
        tasks=tuple(_task(k, v) for k, v in tasks.items() if isinstance(v, dict)),
        consistency=con.get("verdict"), worst_prompt=_worst_prompt(con.get("prompts")),
        totals=tr.get("totals") if isinstance(tr.get("totals"), dict) else {},
    )


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
            s = _task(name, t)
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
            f"verdict {show(con.get('verdict'))} (worst prompt: {_worst_prompt(con.get('prompts')) or 'none'})"]
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


NEEDS_GPUS = "needs-gpus"  # run.json rule of a valid cell the host had too few GPUs for


def run_gate_spec(index: dict[str, Any]) -> GateSpec:
    """The ``gate:`` settings frozen into run.json when the run started (so gate, compare
    and report agree, whatever happened to the sweep file since); defaults otherwise."""
    try:
        return GateSpec.model_validate(index["gate"])
    except (KeyError, TypeError, ValueError):
        return GateSpec()


def _read_index(run_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    try:
        index = layout.read_json(run_dir / layout.RUN_FILE)
    except FileNotFoundError:
        raise UserError(f"{run_dir}: not a pdsweep run ({layout.RUN_FILE} missing)") from None
    plan = layout.read_json_or_none(run_dir / layout.PLAN_FILE) or {}
    for name, data in ((layout.RUN_FILE, index), (layout.PLAN_FILE, plan)):
        if (bad := type_problem(name, data)) is not None:
            raise UserError(f"{run_dir / name}: unreadable: {bad}")
    return index, plan


def gate_run(run_dir: Path, gate: GateSpec | None = None) -> GateResult:
    """Gate every cell of the run in ``run_dir`` (default ``GateSpec()``).

    Cells: those of run.json ``cells`` plus any of plan.json ``cells`` run.json lacks, in
    that order, then rejected cells that appear in neither. A cell listed in ``rejected``
    (run.json or plan.json) is SKIPPED. Raises ``UserError`` when run.json is missing or
    unreadable; never raises for a bad cell file (that cell fails).
    """
    run_dir = Path(run_dir)
    index, plan = _read_index(run_dir)
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
            verdict = FAIL if rule == NEEDS_GPUS else SKIPPED
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


# ---------------------------------------------------------------- outputs
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_XML_ILLEGAL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def xml_safe(text: str) -> str:
    """``text`` without ANSI colour codes and characters XML 1.0 cannot hold."""
    return _XML_ILLEGAL.sub("?", _ANSI.sub("", text))


def write_junit(result: GateResult, path: Path) -> Path:
    """Write JUnit XML: one ``<testcase classname="pdsweep.<run>" name="<cell id>">`` per
    cell; FAIL/XPASS get ``<failure>``, XFAIL/SKIPPED get ``<skipped>`` (message
    ``xfail: ...`` / ``rejected by rule ...``). Run-level problems add a testcase named
    ``(run)``. Returns ``path``."""
    classname = f"pdsweep.{result.run_name}"
    counts = result.counts
    suite = ET.Element("testsuite", name=xml_safe(classname), tests=str(len(result.cells) + bool(result.problems)),
                       failures=str(counts[FAIL] + counts[XPASS] + bool(result.problems)), errors="0",
                       skipped=str(counts[XFAIL] + counts[SKIPPED]))
    for c in result.cells:
        case = ET.SubElement(suite, "testcase", classname=xml_safe(classname), name=xml_safe(c.cell_id))
        if c.facts.duration_s is not None:
            case.set("time", f"{c.facts.duration_s:.1f}")
        body = "\n".join([*c.reasons, *(["", "log tail:", *c.log_tail] if c.log_tail else [])])
        if c.verdict in (FAIL, XPASS):
            el = ET.SubElement(case, "failure", message=xml_safe(c.message), type=c.verdict)
            el.text = xml_safe(body)
        elif c.verdict in (XFAIL, SKIPPED):
            el = ET.SubElement(case, "skipped", message=xml_safe(c.message))
            el.text = xml_safe(body)
    if result.problems:
        case = ET.SubElement(suite, "testcase", classname=xml_safe(classname), name="(run)")
        ET.SubElement(case, "failure", message=xml_safe("; ".join(result.problems)), type="RUN")
    root = ET.Element("testsuites")
    root.append(suite)
    ET.indent(root)
    return layout.write_text(path, '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode")
                             + "\n")


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "—" if x is None else format(x, fmt)


def fmt_bytes(b: float | None) -> str:
    if b is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(b) < 1024 or unit == "GiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024
    return ""  # unreachable


def fmt_task(s: TaskScore) -> str:
    """``task value ±stderr / expected±tol / ref value / p=…``."""
    se = f" ±{s.stderr}" if isinstance(s.stderr, str) else (f" ±{s.stderr:.3f}" if s.stderr is not None else "")
    exp = f"{s.expected:.3f}±{s.tolerance:.3f}" if s.expected is not None and s.tolerance is not None else "—"
    p = f"p={s.p_value:.2g}" if s.p_value is not None else "p=—"
    return f"{s.task} {_f(s.value)}{se} / {exp} / {_f(s.reference)} / {p}"


SUMMARY_COLUMNS = ("cell", "kind", "verdict", "accuracy (value / expected / reference / p)",
                   "consistency (worst prompt)", "transfers", "bytes", "GB/s", "failed (xfer/notif)", "reason")


def summary_rows(result: GateResult) -> list[tuple[str, ...]]:
    """One tuple of plain-text fields per cell, in :data:`SUMMARY_COLUMNS` order."""
    rows = []
    for c in result.cells:
        f = c.facts
        con = "—" if c.kind == "ref" else " ".join(x for x in (f.consistency or "—", f"({f.worst_prompt})"
                                                                 if f.worst_prompt else "") if x)
        failed = "/".join("—" if f.total(k) is None else f"{f.total(k):g}"
                          for k in ("failed_transfers", "failed_notifications"))
        rows.append((c.cell_id, c.kind, c.verdict, "; ".join(map(fmt_task, f.tasks)) or "—", con,
                     _f(f.total("num_transfers"), "g"), fmt_bytes(f.total("bytes")), _f(f.total("gbps_xfer"), ".2f"),
                     failed if c.kind != "ref" else "—", "" if c.verdict == PASS else c.message))
    return rows


_TAG_LIKE = re.compile(r"<(?=[A-Za-z/!?])|&(?=#?\w+;)")


def md_escape(text: str) -> str:
    """Text safe inside a markdown table cell: no pipes, newlines or HTML-tag look-alikes
    (``<nixl>``); a plain ``p < 0.05`` stays readable in a terminal."""
    text = _TAG_LIKE.sub(lambda m: "&lt;" if m.group() == "<" else "&amp;", text)
    return text.replace("|", "\\|").replace("\n", "<br>")


def md_table(columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(md_escape(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def summary_markdown(result: GateResult) -> str:
    """The gate summary as markdown: headline, counts, one table row per cell."""
    head = [f"# Gate: {result.run_name}", "", f"**{result.headline()}**", ""]
    head += [f"- run problem: {md_escape(p)}" for p in result.problems]
    return "\n".join(head + ([""] if result.problems else []) + [md_table(SUMMARY_COLUMNS, summary_rows(result)), ""])


def write_summary(result: GateResult, path: Path) -> Path:
    """Write :func:`summary_markdown` to ``path``; returns ``path``."""
    return layout.write_text(path, summary_markdown(result))


def run_gate(run_dir: Path, gate: GateSpec | None = None, out_dir: Path | None = None) -> GateResult:
    """CLI helper: :func:`gate_run`, then ``junit.xml`` and ``summary.md`` into ``out_dir``
    (default ``run_dir``). Returns the result; call ``result.raise_for_verdict()`` to
    turn FAIL/XPASS into :class:`~pdsweep.errors.GateFailed` (exit 1)."""
    result = gate_run(run_dir, gate)
    out = Path(out_dir or run_dir)
    write_junit(result, out / "junit.xml")
    write_summary(result, out / "summary.md")
    return result
