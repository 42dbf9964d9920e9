"""Facts: the view of one cell of a run, read once from its files (see
results/README.md), that the gate judges and that compare, report and the summary tables
show.

:func:`load_files` reads a cell's JSON files (never raising for a bad one: the problem is
recorded, and the gate fails the cell naming the file); :func:`cell_facts` distils them
into a :class:`CellFacts` tolerant of anything missing. :func:`read_index` reads the run's
run.json and plan.json.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from pydantic import ConfigDict, Field, ValidationError, create_model

from pdsweep.core.errors import UserError
from pdsweep.core.stats import num, obj
from pdsweep.plan.cell import Cell
from pdsweep.results import layout
from pdsweep.results.schema import type_problem
from pdsweep.sweepfile.axes import MAX_ROLE_INSTANCES, Block, Dp, Instances, Pp, Tp
from pdsweep.sweepfile.gatespec import GateSpec

CELL_FILES = (
    layout.CELL_FILE,
    layout.STATUS_FILE,
    layout.ACCURACY_FILE,
    layout.CONSISTENCY_FILE,
    layout.TRANSFER_FILE,
    layout.LOAD_FILE,
    layout.LOAD_CHECK_FILE,
)


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
    try:
        cdir = layout.CellDir.of(run_dir, cell_id)
    except layout.UnresolvablePath as e:  # a symlink loop: the cell fails naming why (an unsafe id: exit 2)
        files.problems = dict.fromkeys(CELL_FILES, f"unreadable: {e}")
        return files
    for name in CELL_FILES:
        path = cdir.file(name)
        try:
            data = layout.read_json(path)
        except FileNotFoundError:
            files.problems[name] = "missing" if cdir.path.is_dir() else "missing (no cell directory: never ran?)"
            continue
        except UserError as e:
            files.problems[name] = "unreadable: " + str(e).removeprefix(f"{path}: ").removeprefix(
                "unreadable results file: "
            )
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


# ---------------------------------------------------------------- facts
@dataclass(frozen=True)
class TaskScore:
    """One accuracy task. Numbers are None where the file has none (or null/NaN);
    ``stderr`` may be the string ``"N/A"`` (lm-eval could not compute it); ``reasons`` as
    recorded (a failed check each, or ``reference``: a reference task passed without an
    expected score, :func:`pdsweep.judge.accuracy.judge`)."""

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
    reasons: tuple[str, ...] = ()


@dataclass(frozen=True)
class CellFacts:
    """What a cell's files say, tolerant of anything missing (all fields optional).

    ``totals`` is transfer.json ``totals`` (bytes in bytes, times in s, rates in GB/s);
    ``worst_prompt`` describes the consistency prompt with the lowest exact-match rate;
    ``reads_by_rank`` is transfer.json ``reads_by_prefill_rank`` (prefill TP rank ->
    ``{reads, bytes, ...}``; empty when not recorded) and ``transfer_plans`` its
    ``transfer_plans`` (vLLM's ``TransferTopology`` fields per prefill engine). ``fault`` is
    cell.json's ``cell.fault``, ``read_faults`` transfer.json's ``read_faults`` (the
    ``fail-read-1-in-K`` drill's counts) and ``kv_load_failure_policy`` decode's, from its
    ``--kv-transfer-config`` (None: not set or not recorded).
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
    reads_by_rank: dict[str, Any] = field(default_factory=dict)
    transfer_plans: tuple[dict[str, Any], ...] = ()
    load: dict[str, Any] = field(default_factory=dict)  # load.json (repeats, raw figures: pdsweep.measure.repeats)
    load_check: dict[str, Any] | None = None  # load_check.json (None: missing or unusable)
    ucx_transports: tuple[str, ...] | None = None  # transfer.json ucx_transports (None: not found)
    fault: str | None = None
    read_faults: dict[str, Any] = field(default_factory=dict)
    kv_load_failure_policy: str | None = None

    def total(self, key: str) -> float | None:
        return num(self.totals.get(key))


def cell_from_dict(d: Any) -> Cell | None:
    """A :class:`~pdsweep.plan.expand.Cell` from ``Cell.to_dict()`` output, or None if it does not fit."""
    return _cell_or_problem(d)[0]


def cell_problem(d: Any) -> str | None:
    """Why ``d`` (cell.json's ``cell``) is no :class:`Cell` record: the first field and what it
    allows, e.g. ``prefill_tp: Input should be greater than or equal to 1 (got 0)``; None if it is one."""
    return _cell_or_problem(d)[1]


def _cell_or_problem(d: Any) -> tuple[Cell | None, str | None]:
    if not isinstance(d, dict):
        return None, f"not an object (got {show(d)[:40]})"
    try:  # typed as the dataclass says (a corrupt file's true/10**400/"x"/0 TP is no cell)
        kw = {name: d[name] for name in _CELL_FIELDS if name in d}
        if isinstance(kw.get("expect_without"), list):  # JSON has no tuples
            kw["expect_without"] = tuple(kw["expect_without"])
        return Cell(**_CELL.model_validate(kw).model_dump(exclude_unset=True)), None
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "cell"
        return None, f"{where}: {err['msg']} (got {show(err.get('input'))[:40]})"
    except TypeError as e:
        return None, str(e)


_CELL_FIELDS = tuple(f.name for f in dataclasses.fields(Cell))
# the counts a Cell divides by or ranges over (tp_ratio, read plans), bounded as the sweep spec
# bounds them: a 0 or 10**30 TP in a corrupt cell.json is no cell; a reference has num_prefill 0
_BOUNDED: dict[str, Any] = {
    "prefill_tp": Tp,
    "decode_tp": Tp,
    "prefill_block_size": Block,
    "decode_block_size": Block,
    "num_prefill": Annotated[int, Field(ge=0, le=MAX_ROLE_INSTANCES)],
    "num_decode": Instances,
    "decode_dp": Dp,
    "prefill_pp": Pp,
}
_FIELDS: dict[str, Any] = {  # Any: a str-keyed ** could name create_model's own __config__ etc.
    f.name: (
        _BOUNDED.get(f.name, typing.get_type_hints(Cell)[f.name]),
        f.default if f.default is not dataclasses.MISSING else ...,
    )
    for f in dataclasses.fields(Cell)
}
_CELL = create_model("CellFields", __config__=ConfigDict(strict=True), **_FIELDS)


def task_score(name: str, t: dict[str, Any]) -> TaskScore:
    exp, ref = obj(t.get("expected")), obj(t.get("reference"))
    se = t.get("stderr")
    n = t.get("n")
    return TaskScore(
        task=name,
        metric=t.get("metric"),
        value=num(t.get("value")),
        stderr=se if isinstance(se, str) else num(se),
        n=n if isinstance(n, int) and not isinstance(n, bool) else None,
        expected=num(exp.get("value")),
        tolerance=num(exp.get("tolerance_at_n")) or num(exp.get("tolerance")),  # scaled to n when recorded
        reference=num(ref.get("value")),
        reference_cell=ref.get("cell_id"),
        p_value=num(t.get("p_value")),
        verdict=t.get("verdict"),
        reasons=tuple(map(str, t["reasons"])) if isinstance(t.get("reasons"), list) else (),
    )


def worst_prompt(prompts: Any) -> str | None:
    rows = [p for p in prompts if isinstance(p, dict)] if isinstance(prompts, list) else []
    if not rows:
        return None
    worst = min(rows, key=lambda p: (num(p.get("exact_match_rate")) is not None, num(p.get("exact_match_rate")) or 0))
    rate = num(worst.get("exact_match_rate"))
    text = f"{worst.get('name', '?')}: " + (f"{rate:.0%} match" if rate is not None else "match n/a")
    if worst.get("first_divergence") is not None:
        text += f", diverges at token {worst['first_divergence']}"
    return text


def load_failure_policy(cell_json: dict[str, Any]) -> str | None:
    """``kv_load_failure_policy`` of the first decode instance's ``--kv-transfer-config`` in
    cell.json ``instances[].argv``; None when not set or not readable."""
    instances = cell_json.get("instances")
    for inst in instances if isinstance(instances, list) else []:  # a damaged file's 7 or "x": none
        argv = obj(inst).get("argv")
        if obj(inst).get("role") != "decode" or not isinstance(argv, list):
            continue
        for flag, val in zip(argv, argv[1:]):
            if flag == "--kv-transfer-config" and isinstance(val, str):
                try:
                    policy = obj(json.loads(val)).get("kv_load_failure_policy")
                except ValueError:
                    return None
                return policy if isinstance(policy, str) else None
    return None


def cell_facts(files: CellFiles, fallback: Cell | None = None) -> CellFacts:
    """Facts of one cell from its files; ``fallback`` (from plan.json) fills in the cell
    identity when cell.json is unusable."""
    cj = files.get(layout.CELL_FILE) or {}
    cell = cell_from_dict(cj.get("cell")) or fallback
    st = files.get(layout.STATUS_FILE) or {}
    acc = files.get(layout.ACCURACY_FILE) or {}
    con = files.get(layout.CONSISTENCY_FILE) or {}
    tr = files.get(layout.TRANSFER_FILE) or {}
    tasks = obj(acc.get("tasks"))
    return CellFacts(
        model=cell.model if cell else None,
        prefill_tp=cell.prefill_tp if cell else None,
        decode_tp=cell.decode_tp if cell else None,
        build=cell.build if cell else None,
        # the plan's cell lines cells up (compare), never cell.json's own compare_key ("zzz" put it in no pair)
        compare_key=planned.compare_key if (planned := fallback or cell) else cj.get("compare_key"),
        config_hash=cj.get("config_hash"),
        status=st.get("status"),
        phase=st.get("phase"),
        duration_s=num(st.get("duration_s")),
        tasks=tuple(task_score(k, v) for k, v in tasks.items() if isinstance(v, dict)),
        consistency=con.get("verdict"),
        worst_prompt=worst_prompt(con.get("prompts")),
        totals=obj(tr.get("totals")),
        reads_by_rank=obj(tr.get("reads_by_prefill_rank")),
        transfer_plans=tuple(p for p in tr.get("transfer_plans") or () if isinstance(p, dict))
        if isinstance(tr.get("transfer_plans"), list)
        else (),
        load=files.get(layout.LOAD_FILE) or {},
        load_check=files.get(layout.LOAD_CHECK_FILE),
        ucx_transports=tuple(map(str, tr["ucx_transports"])) if isinstance(tr.get("ucx_transports"), list) else None,
        fault=cell.fault if cell else None,
        read_faults=obj(tr.get("read_faults")),
        kv_load_failure_policy=load_failure_policy(cj),
    )


# ---------------------------------------------------------------- the run
def run_gate_spec(index: dict[str, Any]) -> GateSpec:
    """The ``gate:`` settings frozen into run.json when the run started (so gate, compare
    and report agree, whatever happened to the sweep file since); defaults when run.json
    has none. Raises ``UserError`` naming the field when the frozen ``gate`` is invalid
    (never silently replaced by the defaults)."""
    if index.get("gate") is None:
        return GateSpec()
    try:
        return GateSpec.model_validate(index["gate"])
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(map(str, err["loc"]))
        raise UserError(
            f"{layout.RUN_FILE}: gate.{loc}: {err['msg']} (got {err.get('input')!r}): the frozen gate settings "
            "are invalid"
        ) from None


def read_index(run_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """run.json and plan.json of ``run_dir`` (plan.json ``{}`` when absent). Raises
    ``UserError`` when run.json is missing or either is unreadable."""
    try:
        index = layout.read_json(run_dir / layout.RUN_FILE)
    except FileNotFoundError:
        raise layout.not_a_run(run_dir) from None
    plan = layout.read_json_or_none(run_dir / layout.PLAN_FILE) or {}
    for name, data in ((layout.RUN_FILE, index), (layout.PLAN_FILE, plan)):
        if (bad := type_problem(name, data)) is not None:
            raise UserError(f"{run_dir / name}: unreadable: {bad}")
    return index, plan
