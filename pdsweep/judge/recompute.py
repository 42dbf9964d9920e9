"""The gate recomputes what it judges (issue 23): a results file's own ``verdict`` is a
claim, not evidence. Each check here re-derives a verdict from the raw values with the
function that wrote it and fails the cell, naming both, when they disagree:

- :class:`AccuracyRecompute`: every task the file calls ``pass`` is judged again by
  :func:`pdsweep.measure.accuracy.judge` from its value, n, expectation and reference (the
  ``gate.alpha`` frozen in run.json); a 0/1 metric outside [0, 1] is impossible.
- :class:`ConsistencyRecompute`: each prompt's figures are recomputed from its token ids and
  logprobs (:func:`pdsweep.measure.consistency.compare`) and the verdict from them
  (:func:`~pdsweep.measure.consistency.judge_consistency`, thresholds of
  :func:`~pdsweep.measure.consistency.thresholds_for`).
- :class:`ReadPatternCheck`: transfer.json ``reads_by_prefill_rank`` against the READs per
  request vLLM's read plan makes (:func:`pdsweep.plan.readplan.expected_read_split`, the
  function ``pdsweep bench transfer`` runs): the split vLLM PR #49297 fixed.
- :func:`disagreements`: run.json, plan.json, cell.json and status.json agree on a cell's
  kind, state and expectation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdsweep.core.stats import num, obj
from pdsweep.judge.facts import CellFiles, cell_from_dict, show
from pdsweep.measure.accuracy import judge as judge_accuracy
from pdsweep.measure.consistency import compare, judge_consistency, thresholds_for
from pdsweep.plan.readplan import expected_read_split
from pdsweep.plan.topology import tp_ratio
from pdsweep.results import layout

RATE_METRICS = ("exact_match", "acc", "acc_norm")  # 0/1 per sample: the score is a rate in [0, 1]


@dataclass(frozen=True)
class AccuracyRecompute:
    """accuracy.json: a task recorded ``pass`` must still pass when judged again."""

    alpha: float = 0.05
    name: str = "accuracy-recompute"

    def applies(self, kind: str) -> bool:
        return True

    def fails(self, files: CellFiles) -> list[str]:
        acc = files.get(layout.ACCURACY_FILE)
        tasks = acc.get("tasks") if acc else None
        if not isinstance(tasks, dict):
            return []  # AccuracyCheck fails the missing file
        w = files.where(layout.ACCURACY_FILE)
        is_ref = _kind(files) == "ref"
        out: list[str] = []
        for name, t in tasks.items():
            if not isinstance(t, dict):
                continue
            value = num(t.get("value"))
            impossible = value is not None and t.get("metric") in RATE_METRICS and not 0 <= value <= 1
            if impossible:
                out.append(f"{w}: {name}: value {value:g} is outside [0, 1] ({t.get('metric')} is a rate)")
            exp = t.get("expected") if isinstance(t.get("expected"), dict) else None
            if exp is not None and not (num(exp.get("tolerance")) or -1) > 0:
                out.append(f"{w}: {name}: expected.tolerance is {show(exp.get('tolerance'))} (allowed: > 0)")
                continue
            if t.get("verdict") != "pass" or value is None:
                continue  # AccuracyCheck already fails it
            ref = t.get("reference") if isinstance(t.get("reference"), dict) else None
            rv = num(ref.get("value")) if ref else None
            if impossible or (rv is not None and not 0 <= rv <= 1):
                ref = None  # no two-proportion test on a rate that cannot be (already reported)
            try:
                again = judge_accuracy(
                    files.cell_id,
                    {name: t},
                    {name: {"source": "recorded", **exp}} if exp and num(exp.get("value")) is not None else None,
                    {"cell_id": ref.get("cell_id"), "tasks": {name: ref}} if ref else None,
                    self.alpha,
                    is_reference=is_ref,
                )["tasks"][name]
            except (OverflowError, ValueError, TypeError) as e:  # e.g. a sample count too large for a float
                out.append(f"{w}: {name}: recorded verdict pass cannot be recomputed from its values: {e}")
                continue
            if again["verdict"] != "pass":
                out.append(
                    f"{w}: {name}: recorded verdict pass, recomputed fail: " + "; ".join(map(str, again["reasons"]))
                )
        return out


@dataclass(frozen=True)
class ConsistencyRecompute:
    """consistency.json (PD cells): recorded per-prompt figures and verdict must be what the
    prompts' tokens and logprobs give."""

    name: str = "consistency-recompute"

    def applies(self, kind: str) -> bool:
        return kind != "ref"

    def fails(self, files: CellFiles) -> list[str]:
        con = files.get(layout.CONSISTENCY_FILE)
        if con is None or con.get("verdict") != "pass" or not con.get("prompts"):
            return []  # ConsistencyCheck fails it
        w = files.where(layout.CONSISTENCY_FILE)
        out: list[str] = []
        rows = []
        for i, p in enumerate(con.get("prompts") or []):
            p = p if isinstance(p, dict) else {}
            name = str(p.get("name") or f"#{i}")
            err = p.get("error")
            # only what the verdict is recomputed from: tokens, logprobs, a request error
            row = {"name": name, "prompt_tokens": p.get("prompt_tokens"), "error": str(err) if err else None}
            row.update(pd_tokens=[], ref_tokens=[])
            pd_t, ref_t = p.get("pd_tokens"), p.get("ref_tokens")
            if isinstance(pd_t, list) and isinstance(ref_t, list):
                row.update(pd_tokens=pd_t, ref_tokens=ref_t)
                pd_lp, ref_lp = _logprobs(p.get("pd_logprobs"), pd_t), _logprobs(p.get("ref_logprobs"), ref_t)
                again = compare(pd_t, pd_lp, ref_t, ref_lp)
                for key in ("exact_match_rate", "first_divergence", "max_abs_dlogprob"):
                    if not _same(p.get(key), again[key]):
                        out.append(
                            f"{w}: prompt '{name}': recorded {key} {show(p.get(key))}, recomputed "
                            f"{show(again[key])} from its tokens and logprobs"
                        )
                row.update(again)
            rows.append(row)
        cell = cell_from_dict((files.get(layout.CELL_FILE) or {}).get("cell"))
        model = (files.get(layout.CELL_FILE) or {}).get("model")
        model = model if isinstance(model, dict) else {}
        th = obj(con.get("thresholds"))
        tp_equal = cell is None or cell.prefill_tp == cell.decode_tp
        thresholds = thresholds_for(str(model.get("attention")), str(model.get("ssm") or "none"), tp_equal)
        max_tokens = th.get("max_tokens")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
            max_tokens = max((len(r.get("ref_tokens") or []) for r in rows), default=0)
        again = judge_consistency(
            files.cell_id, con.get("reference_cell"), {"max_tokens": max_tokens, "prompts": rows}, thresholds
        )
        if again["verdict"] != "pass":
            out.append(f"{w}: recorded verdict pass, recomputed fail: " + "; ".join(again["reasons"]))
        return out


def _logprobs(lp: Any, tokens: list) -> list:
    """The recorded logprobs, or ``None`` per token (recomputed as missing: fail closed)."""
    if isinstance(lp, list) and len(lp) == len(tokens):
        return [num(x) for x in lp]
    return [None] * len(tokens)


def _same(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    x, y = num(a), num(b)
    return x is not None and y is not None and math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12)


def _kind(files: CellFiles) -> str | None:
    cell = cell_from_dict((files.get(layout.CELL_FILE) or {}).get("cell"))
    return cell.kind if cell else None


# ---------------------------------------------------------------- read pattern
@dataclass(frozen=True)
class ReadPatternCheck:
    """transfer.json ``reads_by_prefill_rank`` (PD cells): decode read exactly the prefill
    ranks vLLM's read plan names, in its proportions (READs per request per rank, see
    :func:`~pdsweep.plan.readplan.expected_read_split`). A split that is not recorded fails
    (metric missing); a rank read more or less than the plan says, or not at all, fails
    with the expected and the seen split."""

    name: str = "read-pattern"

    def applies(self, kind: str) -> bool:
        return kind != "ref"

    def fails(self, files: CellFiles) -> list[str]:
        tr = files.get(layout.TRANSFER_FILE)
        cj = files.get(layout.CELL_FILE) or {}
        cell = cell_from_dict(cj.get("cell"))
        if tr is None or cell is None:
            return []  # TransferCheck / CellFileCheck fail it
        w = files.where(layout.TRANSFER_FILE)
        model = obj(cj.get("model"))
        attention, ssm = model.get("attention"), model.get("ssm")
        if attention not in ("mla", "gqa", "mha") or not isinstance(ssm, str):
            return [
                f"{files.where(layout.CELL_FILE)}: model.attention/ssm is {show(attention)}/{show(ssm)}: "
                "cannot check the read pattern (allowed attention: mla, gqa, mha)"
            ]
        p, d = cell.prefill_tp, cell.decode_tp
        try:
            want = expected_read_split(attention, ssm != "none", p, d)
        except ValueError as e:
            return [f"{w}: read pattern of p{p}d{d}: {e}"]
        seen = tr.get("reads_by_prefill_rank")
        label = f"p{p}d{d} {attention}{'+' + ssm if ssm != 'none' else ''} (tp_ratio {tp_ratio(p, d)})"
        if not isinstance(seen, dict) or not seen:
            return [
                f"{w}: reads_by_prefill_rank is {show(seen)} (metric missing: pdsweep's NIXL read log); "
                f"cannot check the read pattern of {label}, which must read prefill ranks {_split(want)} per request"
            ]
        got = {int(r): v.get("reads") for r, v in seen.items() if str(r).isdigit() and isinstance(v, dict)}
        counts = {r: x for r, x in got.items() if isinstance(x, int) and not isinstance(x, bool) and x >= 0}
        if len(counts) != len(got) or len(got) != len(seen):
            return [f"{w}: reads_by_prefill_rank: impossible READ counts {show(seen)} (allowed: rank -> reads >= 0)"]
        read = {r: x for r, x in counts.items() if x > 0}
        if not read:
            return [f"{w}: read pattern: no READ recorded from any prefill rank ({label} needs {_split(want)})"]
        requests = {r: read.get(r, 0) / k for r, k in want.items()}
        if set(read) != set(want) or len(set(requests.values())) != 1:
            return [
                f"{w}: read pattern of {label}: vLLM's read plan reads prefill ranks {_split(want)} READs per "
                f"request, seen {_split(dict(sorted(got.items())))} READs (reads_by_prefill_rank): "
                "decode did not read every rank it must (the split vLLM PR #49297 fixed)"
            ]
        return []


def _split(split: dict[int, Any]) -> str:
    return "{" + ", ".join(f"{r}: {n}" for r, n in split.items()) + "}"


# ---------------------------------------------------------------- agreement between files
def disagreements(
    cell_id: str, run_entry: dict[str, Any], planned: Any, files: CellFiles, rejected: str | None
) -> list[str]:
    """Where run.json (``run_entry``), plan.json (``planned``: a Cell or None), cell.json and
    status.json of ``cell_id`` disagree on its kind, expectation or state; ``rejected``: the
    rule that rejected it (run.json/plan.json ``rejected``), or None."""
    cell = cell_from_dict((files.get(layout.CELL_FILE) or {}).get("cell"))
    st = files.get(layout.STATUS_FILE) or {}
    out: list[str] = []
    sources = {
        layout.RUN_FILE: run_entry,
        layout.PLAN_FILE: {"kind": planned.kind, "expect_fail": planned.expect_fail} if planned else {},
        layout.CELL_FILE: {"kind": cell.kind, "expect_fail": cell.expect_fail} if cell else {},
        layout.STATUS_FILE: st,
    }
    for key in ("kind", "expect_fail"):
        said = {f: d.get(key) for f, d in sources.items() if d.get(key) is not None}
        if key == "expect_fail":  # false and absent mean the same
            said = {f: bool(v) for f, v in said.items()}
        if len(set(map(str, said.values()))) > 1:
            out.append(f"{cell_id}: files disagree on {key}: " + ", ".join(f"{f} {show(v)}" for f, v in said.items()))
    terminal = ("ok", "failed")
    if run_entry.get("status") in terminal and st.get("status") in terminal and run_entry["status"] != st["status"]:
        out.append(
            f"{cell_id}: files disagree on state: {layout.RUN_FILE} {show(run_entry['status'])}, "
            f"{layout.STATUS_FILE} {show(st['status'])}"
        )
    problem = files.problems.get(layout.STATUS_FILE, "missing")
    ran = layout.STATUS_FILE in files.data or not problem.startswith("missing")
    if rejected is not None and ran:
        out.append(
            f"{cell_id}: listed as rejected (rule {rejected}) but {layout.STATUS_FILE} says it ran "
            f"(status {show(st.get('status'))}, phase {show(st.get('phase'))}): the run is not what was planned"
        )
    return out


def strictest_kind(*kinds: Any) -> str:
    """``pd`` when any source says pd (transfer and consistency checks apply) or none says
    anything; ``ref`` only when every source that names a kind says ref."""
    named = [k for k in kinds if k is not None]
    return "ref" if named and all(k == "ref" for k in named) else "pd"


def unlisted_cells(run_dir: Path, listed: set[str]) -> list[str]:
    """Cell directories of ``run_dir`` (holding a cell.json or status.json) that neither
    run.json nor plan.json lists: results the gate would otherwise never judge."""
    out = []
    try:
        entries = sorted(Path(run_dir).iterdir())
    except OSError:
        return []
    for d in entries:
        try:
            is_cell = d.is_dir() and any((d / n).exists() for n in (layout.CELL_FILE, layout.STATUS_FILE))
        except OSError:  # a symlink loop, permissions: not a cell directory this gate can read
            continue
        if is_cell and d.name not in listed:
            out.append(d.name)
    return out
