"""The JSON types of the per-cell results files (results/README.md), checked when the gate
reads them: a file whose fields have impossible types (``"tasks": true``, a cell that is a
number, an integer past float range) is unusable, so its cell FAILs naming file and field
instead of crashing a later reader. Unknown keys are allowed (newer writers add facts);
values are checked further by the gate's own checks (signs, ranges, verdicts)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pdsweep.results import layout

Num = float | None  # strict: int or float, never bool or str (NaN: the gate reads it as missing)
Count = Annotated[int, Field(ge=0, le=2**53)] | None  # exact in a float (what the gate computes with)


class _File(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class CellJson(_File):
    cell: dict[str, Any] | None = None
    compare_key: str | None = None
    config_hash: str | None = None
    reference_cell: str | None = None


class StatusJson(_File):
    status: str | None = None
    phase: str | None = None
    reason: str | None = None
    log_tail: list[Any] | None = None
    expect_fail: bool | None = None
    expect_reason: str | None = None
    expect_ref: str | None = None
    expect_match: str | None = None
    duration_s: Num = None
    # the failed attempts before a redeploy (pdsweep.judge.flaky): an entry that is no object is a lost
    # attempt, never one fewer (retries [1, "x"] made a twice-redeployed cell PASS, not FLAKY)
    retries: list[dict[str, Any]] | None = None


class TaskJson(_File):
    metric: str | None = None
    value: Num = None
    stderr: float | str | None = None
    n: Count = None
    expected: dict[str, Any] | None = None
    reference: dict[str, Any] | None = None
    p_value: Num = None
    verdict: str | None = None
    reasons: list[Any] | None = None


class AccuracyJson(_File):
    verdict: str | None = None
    tasks: dict[str, TaskJson] | None = None


class PromptJson(_File):
    name: str | None = None
    exact_match_rate: Num = None
    first_divergence: Count = None


class ConsistencyJson(_File):
    verdict: str | None = None
    reasons: list[Any] | None = None
    prompts: list[PromptJson] | None = None
    triage: dict[str, Any] | None = None


class TransferJson(_File):
    totals: dict[str, Any] | None = None
    phases: dict[str, Any] | None = None
    transfer_plans: list[dict[str, Any]] | None = None
    # prefill TP rank ("0", "1", ...) -> {reads, bytes, descriptors, engines} (pdsweep.core.logscan)
    reads_by_prefill_rank: dict[Annotated[str, Field(pattern=r"^[0-9]{1,6}$")], dict[str, Count]] | None = None
    # PD cells: "pull" (decode READs) or "push" (prefill WRITEs: NixlPushConnector); absent before pdsweep had it
    transfer_mode: Literal["pull", "push"] | None = None
    # push mode: prefill TP rank -> {writes, bytes, descriptors, decode_ranks} (pdsweep.core.logscan)
    writes_by_prefill_rank: dict[Annotated[str, Field(pattern=r"^[0-9]{1,6}$")], dict[str, Count]] | None = None
    # READ failures the fail-read-1-in-K drill injected, requests vLLM recovered / failed after
    # a KV load failure (pdsweep.core.logscan.read_fault_counts); absent before pdsweep had it
    read_faults: dict[str, Count] | None = None
    # KV integrity digests, prefill offered vs decode landed (pdsweep.core.kvintegrity); absent before pdsweep had it
    integrity: dict[str, Any] | None = None


# a rate (null: not reported); its value (finite, >= 0, counts / duration) is judged by the gate's load
# rule, pdsweep.judge.loadfigures, which pdsweep best applies too
Rate = float | None


class LoadRun(_File):
    """One ``vllm bench serve`` run of the load phase (``pdsweep.measure.phases``): the counts
    exist and are possible; added fields (newer load phases) are allowed."""

    concurrency: Annotated[int, Field(ge=1)] | None = None
    num_prompts: Annotated[int, Field(ge=1, le=2**53)] | None = None
    completed: Count = None
    errors: Count = None
    output_tokens: Count = None  # vllm bench serve total_output_tokens
    output_tok_s: Rate = None
    req_s: Rate = None
    goodput_req_s: Rate = None  # vllm bench serve request_goodput (bench.goodput set)

    @model_validator(mode="after")
    def _possible(self) -> LoadRun:
        n = self.num_prompts
        if n is not None and self.completed is not None and self.completed > n:
            raise ValueError(f"completed {self.completed} > num_prompts {n}")
        if n is not None and self.errors is not None and self.errors > n:
            raise ValueError(f"errors {self.errors} > num_prompts {n}")
        return self


class LoadJson(_File):
    """load.json (``pdsweep.measure.phases``): the sections its readers walk (report, compare, best) are the
    objects and lists the load phase writes (``repeat_plan: [1]`` made report and compare raise)."""

    runs: list[LoadRun] | None = None
    repeats: list[dict[str, Any]] | None = None  # pdsweep.measure.repeats: one entry per repeat
    repeat_plan: dict[str, Any] | None = None
    summary: dict[str, Any] | None = None  # pdsweep.measure.repeats.summarize_repeats
    pairing: dict[str, Any] | None = None  # pdsweep.measure.paired
    workloads: list[dict[str, Any]] | None = None  # the checked workloads' answers


class LoadCheckJson(_File):
    workloads: list[dict[str, Any]] | None = None  # pdsweep.judge.load.judge_load: one per (workload, concurrency)


class RunCell(_File):
    kind: str | None = None
    status: str | None = None
    expect_fail: bool | None = None


class RejectedRecord(_File):
    cell_id: str | None = None
    cell: dict[str, Any] | None = None
    rule: str | None = None
    reason: str | None = None


class RunJson(_File):
    name: str | None = None
    sweep_name: str | None = None
    cells: dict[str, RunCell] | None = None
    rejected: list[RejectedRecord] | None = None
    gate: dict[str, Any] | None = None


class PlanJson(_File):
    cells: list[dict[str, Any]] | None = None
    rejected: list[RejectedRecord] | None = None


SCHEMAS: dict[str, type[_File]] = {
    layout.RUN_FILE: RunJson,
    layout.PLAN_FILE: PlanJson,
    layout.CELL_FILE: CellJson,
    layout.STATUS_FILE: StatusJson,
    layout.ACCURACY_FILE: AccuracyJson,
    layout.CONSISTENCY_FILE: ConsistencyJson,
    layout.TRANSFER_FILE: TransferJson,
    layout.LOAD_FILE: LoadJson,
    layout.LOAD_CHECK_FILE: LoadCheckJson,
}


def type_problem(name: str, data: dict[str, Any]) -> str | None:
    """``"field.path: message (got ...)"`` for the first field of results file ``name``
    whose JSON type is impossible, or None (also for files without a schema here)."""
    schema = SCHEMAS.get(name)
    if schema is None:
        return None
    try:
        schema.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"] if not (isinstance(x, str) and x in ("float", "str", "int")))
        got = repr(err.get("input"))
        return f"{loc}: {err['msg']} (got {got[:40]})"
    return None
