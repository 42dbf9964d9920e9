"""What a person reads first in a run's report: the verdict matrix, the build pairs side by
side, then the failures, each with a one-line cause (the full reasons fold, HTML
``<details>``).

* :func:`verdict_matrix`: rows are a model (plus its variant: env, serve args, fault),
  columns a TP pair (``p2d1``, ``ref-tp1``) and build, each entry the cell's verdict.
* :func:`build_pairs`: cells that differ only in their build (the same ``compare_key``,
  e.g. fixed and unfixed), one row per key, baseline builds (``unfixed``) last.
* :func:`failure_rows`: FAIL, XPASS and FLAKY cells: what a nightly reader must act on.

Cell ids are :attr:`pdsweep.plan.cell.Cell.id`: ``model.TP.blocks.build[.variant...]``.
"""

from __future__ import annotations

import re
from collections import Counter

from pdsweep.judge.flaky import FLAKY
from pdsweep.judge.gate import FAIL, PASS, XPASS, CellResult, GateResult
from pdsweep.judge.perf import PERF_VERDICTS, perf_deltas

CAUSE_CHARS = 160  # a one-line cause is cut here; the full reasons fold below it
LONG_TABLE = 30  # rows: a table longer than this goes after the failures (a reader finds them first)
BASELINES = ("unfixed", "baseline")  # sort after every other build in a pair
ACT_ON = (FAIL, XPASS, FLAKY)


# an instance's first exception as pdsweep.deploy.deployment culprits()/ended() append it to a
# request's failure: "decode-0 (still running): AssertionError: ... at vllm/...:12 f" or
# "decode-0 (pid 7) killed by signal 9 (SIGKILL) during eval: RuntimeError: ..."
_INSTANCE_EXC = re.compile(
    r"(?P<inst>\b(?:prefill|decode|single|proxy)-\d+)\b[^:;]*: "
    r"(?P<exc>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failure)\b[^;]*)"
)


def first_instance_error(text: str) -> str | None:
    """``<instance>: <Exception>: <message> at <file:line> ...`` of the first instance that logged
    an exception in a failure reason, or None. A request's reason starts with the HTTP wrapper
    (``streaming request: HTTP 500: {"error": ...}``); the instance's own error is the cause."""
    m = _INSTANCE_EXC.search(text)
    return f"{m.group('inst')}: {m.group('exc').strip()}" if m else None


def failures_first(sections: list[tuple[int, list[str]]], failures: list[str]) -> list[str]:
    """The overview's parts in reading order: the ``(rows, parts)`` sections whose table has at
    most :data:`LONG_TABLE` rows in their order, then ``failures``, then the longer ones (a
    768-cell run's 385-row build-pairs table no longer hides the failures below it)."""
    short = [x for n, ps in sections if n <= LONG_TABLE for x in ps]
    long = [x for n, ps in sections if n > LONG_TABLE for x in ps]
    return short + failures + long


def natural_key(text: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key reading digit runs as numbers: ``b16`` before ``b128``, ``p2d1`` before ``p16d1``."""
    return tuple((0, int(x)) if x.isdigit() else (1, x) for x in re.split(r"(\d+)", text) if x)


def one_line(c: CellResult) -> str:
    """The cell's cause in one line, without its own id's ``<cell id>/`` prefixes, cut to
    :data:`CAUSE_CHARS` characters ('' for a PASS): the first instance error of its reasons
    (:func:`first_instance_error`) where there is one, else its message's first line."""
    if c.verdict == PASS or not c.reasons:
        return ""
    text = "\n".join((c.message, *c.reasons))
    first = first_instance_error(text) or (c.message.splitlines()[0] if c.message else c.reasons[0].splitlines()[0])
    first = first.replace(c.cell_id + "/", "")
    return first if len(first) <= CAUSE_CHARS else first[: CAUSE_CHARS - 1] + "…"


def id_parts(c: CellResult) -> tuple[str, str, str, str, str]:
    """(model, TP label, blocks, build, variant) of a cell id; variant '' for the base cell."""
    model = c.facts.model or c.cell_id.split(".", 1)[0]
    rest = c.cell_id[len(model) + 1 :].split(".") if c.cell_id.startswith(model + ".") else c.cell_id.split(".")[1:]
    rest += [""] * (3 - len(rest))
    return model, rest[0], rest[1], rest[2], ".".join(rest[3:])


def verdict_matrix(result: GateResult) -> tuple[list[str], list[tuple[str, list[CellResult | None]]]]:
    """(column labels ``"<TP> <build>"``, rows ``(row label, one CellResult or None per column)``).

    Row labels are ``model`` or ``model variant``; where two cells would share one entry
    (two block sizes of one model), the block part joins the row label."""
    parts = {c.cell_id: id_parts(c) for c in result.cells}
    short = {cid: (" ".join(x for x in (m, v) if x), f"{tp} {b}") for cid, (m, tp, _, b, v) in parts.items()}
    shared = Counter(short.values())
    cols = sorted(
        set(col for _, col in short.values()),
        key=lambda k: (k.startswith("ref"), natural_key(k.split(" ")[0]), k.split(" ")[1] in BASELINES, k),
    )
    rows: dict[str, list[CellResult | None]] = {}
    for c in result.cells:
        label, col = short[c.cell_id]
        if shared[(label, col)] > 1:
            m, _, blocks, _, v = parts[c.cell_id]
            label = " ".join(x for x in (m, blocks, v) if x)
        rows.setdefault(label, [None] * len(cols))[cols.index(col)] = c
    return cols, sorted(rows.items(), key=lambda kv: natural_key(kv[0]))


def build_pairs(result: GateResult) -> tuple[list[str], list[tuple[str, dict[str, CellResult]]]]:
    """(builds in column order, rows ``(compare key, build -> CellResult)``) for every
    compare key that ran on two or more builds; baseline builds come last."""
    by_key: dict[str, dict[str, CellResult]] = {}
    for c in result.cells:
        by_key.setdefault(c.facts.compare_key or c.cell_id, {})[c.facts.build or id_parts(c)[3]] = c
    rows = sorted(((k, v) for k, v in by_key.items() if len(v) > 1), key=lambda kv: natural_key(kv[0]))
    builds = list(dict.fromkeys(b for _, v in rows for b in v))
    builds.sort(key=lambda b: (b in BASELINES, b))
    return builds, rows


def failure_rows(result: GateResult) -> list[CellResult]:
    """Cells the reader must act on (:data:`ACT_ON`), in run order."""
    return [c for c in result.cells if c.verdict in ACT_ON]


def matrix_rows(result: GateResult) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """The verdict matrix as plain text (markdown): ('model', columns...), verdict or '—'."""
    cols, rows = verdict_matrix(result)
    return ("model", *cols), [(label, *(c.verdict if c else "—" for c in cells)) for label, cells in rows]


PERF_COL = "load B/A"  # the pair's load repeats judged against each other (pair_perf)


def pair_perf(result: GateResult, by_build: dict[str, CellResult], builds: list[str]) -> str:
    """Two builds' load repeats judged against each other by :func:`pdsweep.judge.perf.perf_deltas`
    (B = the first build in column order, A = the other: a baseline comes last), as
    ``"<B> vs <A>: 3 same, 1 noisy (paired; detects >= 1.25x)"``: the verdict counts, the interval
    method (``paired`` when both load.json carry one ``pairing.id``, ``bench.pair_builds``) and the
    largest smallest-detectable slowdown over the metrics. Both builds are of this one run: unpaired
    repeats claim no regression or improvement (:mod:`pdsweep.judge.perf`). '' unless exactly two
    builds have load figures."""
    have = [b for b in builds if b in by_build and by_build[b].facts.load]
    if len(have) != 2:
        return ""
    b, a = have
    deltas = perf_deltas(by_build[a].facts.load, by_build[b].facts.load, result.gate, same_run=True)
    if not deltas:
        return ""
    n = {v: sum(d.verdict == v for d in deltas) for v in PERF_VERDICTS}
    methods = "/".join(sorted({d.method for d in deltas if d.method})) or "no interval"
    det = [d.detectable for d in deltas if d.detectable is not None]
    teeth = f"; detects >= {max(det):.2f}x" if det else ""
    return f"{b} vs {a}: " + ", ".join(f"{k} {v}" for k, v in n.items() if v) + f" ({methods}{teeth})"


def pair_rows(result: GateResult) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """Build pairs as plain text: ('cell', then per build its verdict and one-line cause, then
    :data:`PERF_COL`, :func:`pair_perf`, when some pair has load figures on two builds)."""
    builds, rows = build_pairs(result)
    cols = ("cell", *(x for b in builds for x in (b, f"{b}: cause")))
    out = []
    for key, by_build in rows:
        vals: list[str] = []
        for b in builds:
            c = by_build.get(b)
            vals += [c.verdict, one_line(c)] if c else ["—", ""]
        out.append((key, *vals, pair_perf(result, by_build, builds)))
    if any(r[-1] for r in out):
        return (*cols, PERF_COL), out
    return cols, [r[:-1] for r in out]
