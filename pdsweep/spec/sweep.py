"""Sweep files: pydantic schema, YAML loading, clear errors (the model catalogue's schema
is :mod:`pdsweep.spec.catalogue`; this module loads both).

A sweep YAML (``sweeps/*.yaml``) names a model catalogue (``sweeps/models.yaml`` by
default), vLLM builds, named serve-arg and env variants, a ``matrix`` with
GitHub-Actions semantics (axes, ``include``, ``exclude``), and the ``eval``, ``bench``
and ``gate`` sections used by later stages.

Every problem is raised as :class:`~pdsweep.core.errors.UserError` with
``FILE:LINE: field.path: message (allowed: ...)``; the line comes from pyyaml's node
marks for the offending field.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, field_validator, model_validator

from pdsweep.core.errors import UserError
from pdsweep.spec import guards
from pdsweep.spec.catalogue import Catalogue, KvBufferDevice, ModelSpec, NixlSupport, Platform, PlatformSupport
from pdsweep.spec.catalogue import Strict as _Strict
from pdsweep.spec.connector import KV_TRANSFER_EXTRA_KEYS, NIXL_EXTRA_KEYS, KvTransferExtra
from pdsweep.spec.yamlfile import fmt_loc, line_of, read_yaml, resolve_model

# Axes a matrix may vary; each is also a field of a cell.
AXES = (
    "model",
    "tp",
    "prefill_tp",
    "decode_tp",
    "block_size",
    "prefill_block_size",
    "decode_block_size",
    "num_prefill",
    "num_decode",
    "decode_dp",
    "kv_buffer_device",
    "build",
    "serve_args",
    "env",
    "router",
    "fault",
)
EXPECT_KEYS = ("expect", "reason", "ref", "match", "vllm", "without")
MATCH_ANY = "any"  # `match: any`: an expected failure of any signature (loud: the gate summary counts it)
# An include entry with ``kind: ref`` adds no cell: it declares the expectation of the
# single-instance reference cells it matches, by these keys (a reference has no prefill side).
REF_ENTRY_KEYS = ("model", "decode_tp", "block_size", "decode_block_size", "build", "serve_args", "env")
_TP_PAIR = re.compile(r"^p([1-9]\d*)d([1-9]\d*)$")
Pos = Annotated[int, Field(ge=1)]
# Upper bounds of the axes, each with where it comes from (shown in the error)
MAX_TP = 64
MAX_BLOCK = 4096
MAX_DP = 8
MAX_ROLE_INSTANCES = 11
Tp = Annotated[int, Field(ge=1, le=MAX_TP)]
Block = Annotated[int, Field(ge=1, le=MAX_BLOCK)]
Dp = Annotated[int, Field(ge=1, le=MAX_DP)]
Instances = Annotated[int, Field(ge=1, le=MAX_ROLE_INSTANCES)]
Router = Literal["pdsweep", "vllm-router"]
# Fault drills (pdsweep.run.drills): what pdsweep does to a running PD cell; the cell then
# declares the failure it must end with (expect: fail + match), so the drill is XFAIL or FAIL
# fail-read-1-in-K: decode reports every K-th NIXL READ that NIXL completed as failed (state
# "ERR"), through pdsweep's vLLM plugin (pdsweep.engine.readfault); vLLM then applies the
# cell's kv_load_failure_policy (recompute: the request recomputes the prompt; fail: it ends in error)
# decode-after-lease-expiry: the PD proxy holds 1 in 4 decode legs longer than prefill's KV lease
# (pdsweep.run.drills.lease_drill_faults), so decode reads blocks prefill already freed (stale reads)
READ_FAULT_PATTERN = r"^fail-read-1-in-([1-9][0-9]{0,5})$"
Fault = (
    Literal["none", "kill-prefill-during-eval", "kill-decode-during-load", "decode-after-lease-expiry"]
    | Annotated[str, StringConstraints(pattern=READ_FAULT_PATTERN)]
)


def read_fault_every(fault: str | None) -> int | None:
    """K of a ``fail-read-1-in-K`` fault (1 <= K <= 999999), else None."""
    m = re.match(READ_FAULT_PATTERN, fault or "")
    return int(m.group(1)) if m else None


BOUND_WHY = {
    "tp": f"a cell runs on one host; pdsweep takes TP up to {MAX_TP} ranks",
    "block": f"tokens per KV block; vLLM's attention backends and hybrid page alignment stay far below {MAX_BLOCK}",
    "dp": f"pdsweep reserves {MAX_DP} NIXL side-channel ports per instance and vLLM adds the DP index to "
    "VLLM_NIXL_SIDE_CHANNEL_PORT (nixl/base_scheduler.py NixlConnectorScheduler.__init__)",
    "instances": "at most 12 instances per cell (pdsweep.plan.expand.MAX_INSTANCES: the per-cell port block)",
    "port_base": "TCP ports end at 65535 and each concurrent cell takes a block of 200",
}
_BOUND_OF = {
    "prefill_tp": "tp",
    "decode_tp": "tp",
    "block_size": "block",
    "prefill_block_size": "block",
    "decode_block_size": "block",
    "decode_dp": "dp",
    "num_prefill": "instances",
    "num_decode": "instances",
    "port_base": "port_base",
}


# ---------------------------------------------------------------- sweep
class BuildSpec(_Strict):
    """A named vLLM build. ``python``/``venv`` unset = the interpreter running pdsweep."""

    python: str | None = None
    venv: str | None = None
    description: str | None = None
    # PR #49297 reverted (``make baseline-env``); None: inferred, see :meth:`is_unfixed`
    unfixed: bool | None = None

    @model_validator(mode="after")
    def _not_both(self) -> BuildSpec:
        if self.python and self.venv:
            raise ValueError("give 'python' or 'venv', not both")
        return self

    def is_unfixed(self, name: str) -> bool:
        """Whether this build is pdsweep's unfixed baseline: ``unfixed`` when given, else
        the build's name or its venv/python path contains "unfixed" (``.venv-unfixed``)."""
        if self.unfixed is not None:
            return self.unfixed
        return any("unfixed" in (x or "").lower() for x in (name, self.venv, self.python))


# KVTransferConfig fields (vllm/config/kv_transfer.py) a sweep may set through
# kv_transfer_extra (kv_connector: NixlConnector or NixlPushConnector only); kv_connector_module_path,
# kv_role and kv_buffer_device define the cell (pdsweep gates on NIXL metrics and its own roles) and are pdsweep's.
# (pdsweep.spec.connector: every key bounded; engine_id is pdsweep's)


class ServeArgsVariant(_Strict):
    """Extra ``vllm serve`` args for both roles, prefill only, decode only; appended
    after pdsweep's own flags, so a repeated flag here wins (argparse keeps the last).
    ``kv_transfer_extra``: keys merged into pdsweep's ``--kv-transfer-config`` JSON
    (``kv_connector_extra_config`` merged key by key), e.g. ``kv_load_failure_policy``."""

    both: list[str] = []
    prefill: list[str] = []
    decode: list[str] = []
    enforce_eager: bool | None = None  # override defaults.enforce_eager (e.g. MTP, CUDA graphs)
    kv_transfer_extra: dict[str, Any] = {}
    # serve_args variant of the single-instance reference of cells with this variant (None:
    # this one), e.g. `base`, so a fault the variant causes outside PD is not on both sides
    reference: str | None = None

    @field_validator("kv_transfer_extra")
    @classmethod
    def _extra_keys(cls, v: dict[str, Any]) -> dict[str, Any]:
        bad = sorted(set(v) - set(KV_TRANSFER_EXTRA_KEYS))
        if bad:
            raise ValueError(
                f"kv_transfer_extra: key(s) {bad} not allowed "
                f"(allowed: {', '.join(KV_TRANSFER_EXTRA_KEYS)}; "
                "the role, kv_buffer_device and engine_id are pdsweep's)"
            )
        if not isinstance(v.get("kv_connector_extra_config", {}), dict):
            raise ValueError("kv_transfer_extra.kv_connector_extra_config must be a mapping")
        unknown = sorted(set(v.get("kv_connector_extra_config") or {}) - set(NIXL_EXTRA_KEYS))
        if unknown:
            raise ValueError(
                f"kv_transfer_extra.kv_connector_extra_config: key(s) {unknown} unknown "
                f"(allowed: {', '.join(NIXL_EXTRA_KEYS)}: the keys vLLM's NIXL connector reads)"
            )
        try:
            KvTransferExtra.model_validate(v)
        except ValidationError as e:
            x = e.errors()[0]
            raise ValueError(
                f"kv_transfer_extra.{'.'.join(map(str, x['loc']))}: {x['msg']} (got {x.get('input')!r})"
            ) from None
        return v


class Defaults(_Strict):
    prefill_tp: Tp = 1
    decode_tp: Tp = 1
    prefill_block_size: Block = 16
    decode_block_size: Block = 16
    num_prefill: Instances = 1
    num_decode: Instances = 1
    decode_dp: Dp = 1  # decode as data parallel (+ expert parallel), upstream DP_EP
    kv_buffer_device: KvBufferDevice | None = None  # None: cuda on GPU, cpu on CPU
    build: str = "fixed"
    serve_args: str = "base"
    env: str = "base"
    router: Router = "pdsweep"  # the PD router: pdsweep's proxy, or vllm-router (pdsweep.deploy.router)
    fault: Fault = "none"  # a fault drill (pdsweep.run.drills)
    gpu_memory_utilization: float = Field(default=0.8, gt=0, le=1)
    enforce_eager: bool = True
    max_model_len: int | None = Field(default=None, gt=0)
    max_num_seqs: int | None = Field(default=None, gt=0)
    startup_timeout_s: float = Field(default=1200, gt=0)
    request_timeout_s: float = Field(default=300, gt=0)
    # redeploy a cell whose first request timed out (a hang, never a crash or a wrong answer)
    # up to this many times; every attempt's reason stays in status.json ``retries``
    ready_retries: int = Field(default=0, ge=0, le=3)
    kv_lease_duration_s: int | None = Field(default=None, gt=0)
    # kv_producer/kv_consumer per role ("split"), or kv_both on both (older vLLM, upstream scripts)
    kv_role: Literal["split", "both"] = "split"
    cpu_kvcache_space_gib: int = Field(default=1, ge=1)
    # --num-gpu-blocks-override; None: 256 on CPU (see pdsweep.plan.expand.CPU_NUM_BLOCKS), vLLM's own on GPU
    num_blocks: int | None = Field(default=None, ge=1, le=10_000_000)
    port_base: int = Field(default=20000, ge=1024, le=60000)


class ConsistencySpec(_Strict):
    enabled: bool = True
    max_tokens: int = Field(default=8, gt=0)
    # prompt lengths in tokens; "block" = one block minus one, "long" = near max_model_len
    lengths: list[Pos | Literal["short", "blocks", "long"]] = Field(default=["short", "blocks", "long"], min_length=1)
    # the reference also answers each position along its plain prefill path, so a
    # divergence is triaged as transfer / engine / both (pdsweep.measure.consistency.path_check)
    triage: bool = True
    # probe text (pdsweep.measure.prompts.probe_text): auto = the eval task's own Q/A format for
    # checkpoints trained on it (tiny.train), English-like prose otherwise
    text: Literal["auto", "prose", "task"] = "auto"


class EvalSpec(_Strict):
    tasks: list[str] = ["pdsweep_arith"]
    limit: int | None = Field(default=None, gt=0)
    num_fewshot: int | None = Field(default=None, ge=0)
    num_concurrent: int = Field(default=8, gt=0)
    max_retries: int = Field(default=3, ge=0)
    timeout_s: float = Field(default=300, gt=0)
    seed: int = 1234
    max_gen_toks: int = Field(default=256, gt=0)
    reference: bool = True  # single-instance reference per model at the decode TP
    budget_s: float | None = Field(default=None, gt=0)  # eval wall clock; None: derived (pdsweep.plan.budgets)
    consistency: ConsistencySpec = ConsistencySpec()


class WorkloadSpec(_Strict):
    """One load workload (:mod:`pdsweep.measure.workloads`); unset sizes come from ``bench``."""

    name: Literal["random", "shared-prefix", "multi-turn", "partial-blocks", "chunk-boundary", "long-context", "trace"]
    num_prompts: int | None = Field(default=None, gt=0)  # conversations for multi-turn; trace: first N rows
    input_len: int | None = Field(default=None, gt=0)  # tokens; capped at max_model_len - output_len - 1
    output_len: int | None = Field(default=None, gt=0)
    prefix_len: int | None = Field(default=None, gt=0)  # shared-prefix: shared tokens (default 3/4 input_len)
    turns: int = Field(default=3, ge=2, le=32)  # multi-turn: turns per conversation
    passes: int = Field(default=1, ge=1, le=4)  # shared-prefix: 2 = the prefix-reuse KV byte check
    trace: str | None = None  # trace: Mooncake JSONL path (default: the shipped one)
    trace_block_tokens: int = Field(default=16, gt=0)  # trace: tokens per hash_id (Mooncake: 512)
    time_scale: float = Field(default=0.0, ge=0)  # trace: 1 = replay at the trace's timestamps, 0 = ASAP
    # chunk-boundary: the prefill's chunk in tokens (its --max-num-batched-tokens); prompts straddle its multiples
    chunk_tokens: int | None = Field(default=None, ge=2)

    @model_validator(mode="after")
    def _chunk(self) -> WorkloadSpec:
        if self.name == "chunk-boundary" and self.chunk_tokens is None:
            raise ValueError(
                "workload chunk-boundary needs chunk_tokens: the prefill's --max-num-batched-tokens "
                "(set it in serve_args.<variant>.prefill)"
            )
        if self.name != "chunk-boundary" and self.chunk_tokens is not None:
            raise ValueError(f"chunk_tokens applies to workload chunk-boundary only, not {self.name}")
        return self


class BenchSpec(_Strict):
    enabled: bool = False
    # named workloads (random: ``vllm bench serve`` figures plus a checked pass by pdsweep's client)
    workloads: list[WorkloadSpec] = Field(default=[WorkloadSpec(name="random")], min_length=1)
    check: bool = True  # every greedy answer under load compared with the reference cell's
    concurrencies: list[Annotated[int, Field(ge=1, le=65536)]] = Field(default=[1], min_length=1)
    input_len: int = Field(default=128, gt=0)
    output_len: int = Field(default=16, gt=0)
    num_prompts: int = Field(default=16, gt=0)
    budget_s: float | None = Field(default=None, gt=0)  # per concurrency run; None: derived (pdsweep.plan.budgets)
    # repeats of the whole load phase, raw figures of each kept (pdsweep.measure.repeats);
    # None: 3 on GPU, on CPU as many of 3 as fit repeats_budget_s (at least 2: an interval)
    repeats: int | None = Field(default=None, ge=1, le=99)
    max_repeats: int = Field(default=5, ge=1, le=99)  # the bound when target_ci asks for more
    # stop once every headline metric's CI half-width / mean is below this (AIPerf's convergence)
    target_ci: float | None = Field(default=None, gt=0, lt=1)
    confidence: float = Field(default=0.95, gt=0.5, lt=1)
    repeats_budget_s: float = Field(default=240, gt=0)  # CPU: wall clock of all repeats of one cell

    @field_validator("workloads", mode="before")
    @classmethod
    def _named(cls, v: Any) -> Any:  # ``[random, multi-turn]`` is short for ``[{name: random}, ...]``
        return [{"name": w} if isinstance(w, str) else w for w in v] if isinstance(v, list) else v

    @model_validator(mode="after")
    def _unique(self) -> BenchSpec:
        keys = [w.model_dump_json() for w in self.workloads]
        if len(set(keys)) != len(keys):
            raise ValueError("bench.workloads: the same workload is listed twice")
        return self


# gate.perf keys: metric families of pdsweep.judge.perf (ratio thresholds, 0.05 = 5 %);
# engine_cpu_ms (CPU ms of the engine processes per request) is judged only when named
PERF_METRICS = (
    "ttft_ms",
    "tpot_ms",
    "itl_ms",
    "e2el_ms",
    "output_tok_s",
    "req_s",
    "kv_gbps",
    "kv_xfer_ms",
    "engine_cpu_ms",
)


class GateSpec(_Strict):
    require_accuracy: bool = True
    require_consistency: bool = True
    max_failed_transfers: int = Field(default=0, ge=0)
    alpha: float = Field(default=0.05, gt=0, lt=1)  # two-proportion test vs the reference
    require_all_cells: bool = False  # cells needing more GPUs than the host/allocation FAIL (cluster nightlies)
    # compare: per-metric ratio thresholds of the noise-aware verdict (pdsweep.judge.perf); a
    # metric not named gets perf_default
    perf: dict[str, Annotated[float, Field(gt=0, lt=10)]] = {}
    perf_default: float = Field(default=0.10, gt=0, lt=10)
    perf_noisy_fails: bool = False  # compare: a `noisy` metric fails it (default: shown, counted, passes)
    # UCX transports a PD cell must READ over (e.g. [cma]; transfer.json ucx_transports); None: any
    transports: list[str] | None = Field(default=None, min_length=1)
    # ... when the cell's prefill and decode run on different hosts (Slurm nodes with different
    # addresses, pdsweep.plan.crossnode.cross_host), e.g. [tcp] or [rc]; None: such a cell fails
    # the transport check when `transports` is set (one host's cma cannot cross hosts)
    transports_cross_host: list[str] | None = Field(default=None, min_length=1)
    # FLAKY (passed only after a ready_retries redeploy) fails `pdsweep gate --nightly` / a plain gate
    flaky_fails_nightly: bool = True
    flaky_fails_sweep: bool = False

    @field_validator("perf")
    @classmethod
    def _perf_keys(cls, v: dict[str, float]) -> dict[str, float]:
        bad = sorted(set(v) - set(PERF_METRICS))
        if bad:
            raise ValueError(f"gate.perf: unknown metric(s) {bad} (allowed: {', '.join(PERF_METRICS)})")
        return v


class MatrixEntry(_Strict):
    """One ``include``/``exclude`` entry: scalar axis values (typed like the axes) plus,
    for include, ``expect: fail`` with ``reason`` and ``ref``, and ``kind: ref`` for an
    entry that sets the expectation of matching reference cells (:data:`REF_ENTRY_KEYS`)."""

    kind: Literal["ref"] | None = None

    model: str | None = None
    tp: str | None = Field(default=None, pattern=_TP_PAIR.pattern)
    prefill_tp: Tp | None = None
    decode_tp: Tp | None = None
    block_size: Block | None = None
    prefill_block_size: Block | None = None
    decode_block_size: Block | None = None
    num_prefill: Instances | None = None
    num_decode: Instances | None = None
    decode_dp: Dp | None = None
    kv_buffer_device: KvBufferDevice | None = None
    build: str | None = None
    serve_args: str | None = None
    env: str | None = None
    router: Router | None = None
    fault: Fault | None = None
    expect: Literal["fail"] | None = None
    reason: str | None = None
    ref: str | None = None
    # regex over the failure's signature (gate reasons + the failing instance's log tail);
    # an expected failure whose signature does not match is FAIL, not XFAIL
    match: str | None = Field(default=None, min_length=1)
    # for which builds the expectation holds (pdsweep.spec.expectations): a PEP 440 range of the
    # build's vLLM version, and fixes (pdsweep.builds.fixprobes.FIXES) of which one must be absent
    vllm: str | None = Field(default=None, min_length=1)
    without: list[str] | None = Field(default=None, min_length=1)

    @field_validator("vllm")
    @classmethod
    def _specifier(cls, v: str | None) -> str | None:
        if v is not None:
            from packaging.specifiers import InvalidSpecifier, SpecifierSet

            try:
                SpecifierSet(v)
            except InvalidSpecifier:
                raise ValueError(f"not a PEP 440 version range (e.g. '>=0.26,<0.33'): {v!r}") from None
        return v

    @field_validator("without")
    @classmethod
    def _known_fixes(cls, v: list[str] | None) -> list[str] | None:
        from pdsweep.builds.fixprobes import FIXES

        bad = [f for f in v or [] if f not in FIXES]
        if bad:
            raise ValueError(f"unknown fix probe(s) {bad} (allowed: {', '.join(FIXES)})")
        return v

    @field_validator("tp")
    @classmethod
    def _tp_bounds(cls, v: str | None) -> str | None:
        return v if v is None else _tp_pair_in_bounds(v)

    @field_validator("match")
    @classmethod
    def _regex(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"not a regular expression: {e}") from None
        return v


def _tp_pair_in_bounds(pair: str) -> str:
    p, d = map(int, _TP_PAIR.fullmatch(pair).groups())  # type: ignore[union-attr]
    if max(p, d) > MAX_TP:
        raise ValueError(f"'{pair}': TP {max(p, d)} is more than {MAX_TP} ({BOUND_WHY['tp']})")
    return pair


class Matrix(_Strict):
    model: list[str] = Field(min_length=1)
    tp: list[str] | None = Field(default=None, min_length=1)
    prefill_tp: list[Tp] | None = Field(default=None, min_length=1)
    decode_tp: list[Tp] | None = Field(default=None, min_length=1)
    block_size: list[Block] | None = Field(default=None, min_length=1)
    prefill_block_size: list[Block] | None = Field(default=None, min_length=1)
    decode_block_size: list[Block] | None = Field(default=None, min_length=1)
    num_prefill: list[Instances] | None = Field(default=None, min_length=1)
    num_decode: list[Instances] | None = Field(default=None, min_length=1)
    decode_dp: list[Dp] | None = Field(default=None, min_length=1)
    kv_buffer_device: list[KvBufferDevice] | None = Field(default=None, min_length=1)
    build: list[str] | None = Field(default=None, min_length=1)
    serve_args: list[str] | None = Field(default=None, min_length=1)
    env: list[str] | None = Field(default=None, min_length=1)
    router: list[Router] | None = Field(default=None, min_length=1)
    fault: list[Fault] | None = Field(default=None, min_length=1)
    include: list[dict[str, Any]] = []
    exclude: list[dict[str, Any]] = []

    @field_validator("tp")
    @classmethod
    def _tp_pairs(cls, v: list[str] | None) -> list[str] | None:
        for item in v or []:
            if not _TP_PAIR.fullmatch(str(item)):
                raise ValueError(
                    f"'{item}' is not a TP pair; write pPdD with P, D >= 1, e.g. p2d1 (prefill TP 2, decode TP 1)"
                )
            _tp_pair_in_bounds(item)
        return v

    @model_validator(mode="after")
    def _no_double_axes(self) -> Matrix:
        if self.tp and (self.prefill_tp or self.decode_tp):
            raise ValueError("give 'tp' pairs or 'prefill_tp'/'decode_tp' axes, not both")
        if self.block_size and (self.prefill_block_size or self.decode_block_size):
            raise ValueError("give 'block_size' or 'prefill_block_size'/'decode_block_size', not both")
        for kind, entries in (("include", self.include), ("exclude", self.exclude)):
            allowed = AXES + (EXPECT_KEYS + ("kind",) if kind == "include" else ())
            for i, e in enumerate(entries):
                if kind == "include" and e.get("kind") == "ref":
                    allowed_here: tuple[str, ...] = ("kind", *REF_ENTRY_KEYS, *EXPECT_KEYS)
                    if e.get("expect") != "fail":
                        raise ValueError(
                            f"include[{i}]: 'kind: ref' declares the expected failure of reference "
                            "cells: it needs 'expect: fail' (it adds no cell)"
                        )
                else:
                    allowed_here = allowed
                bad = sorted(set(e) - set(allowed_here))
                if bad:
                    what = (
                        " (a 'kind: ref' entry matches reference cells, which have no prefill side)"
                        if e.get("kind") == "ref"
                        else ""
                    )
                    raise ValueError(f"{kind}[{i}]: unknown key(s) {bad}{what}; allowed: {', '.join(allowed_here)}")
                try:
                    MatrixEntry.model_validate(e)
                except ValidationError as err:
                    x = err.errors()[0]
                    raise ValueError(
                        f"{kind}[{i}].{'.'.join(map(str, x['loc']))}: {x['msg']} (got {x.get('input')!r})"
                    ) from None
                if "tp" in e and ("prefill_tp" in e or "decode_tp" in e):
                    raise ValueError(f"{kind}[{i}]: give 'tp' or 'prefill_tp'/'decode_tp', not both")
                if "block_size" in e and ("prefill_block_size" in e or "decode_block_size" in e):
                    raise ValueError(
                        f"{kind}[{i}]: give 'block_size' or 'prefill_block_size'/'decode_block_size', not both"
                    )
                stray = [k for k in ("reason", "ref") if k in e and "expect" not in e]
                if kind == "include" and stray:
                    raise ValueError(
                        f"include[{i}]: '{stray[0]}' explains an expected failure: it needs 'expect: fail'"
                    )
                if kind == "include" and "expect" in e and not e.get("reason"):
                    raise ValueError(f"include[{i}]: 'expect: fail' needs a 'reason' (and ideally a 'ref')")
                if kind == "include" and "expect" in e and not e.get("match"):
                    raise ValueError(
                        f"include[{i}]: 'expect: fail' needs 'match:', a regex of the failure's signature (gate "
                        f"reasons, status reason, log tail), or 'match: {MATCH_ANY}' to accept any failure "
                        "(counted in the gate summary): an expected failure must not hide a lost result"
                    )
                if kind == "include" and e.get("match") is not None and e.get("expect") != "fail":
                    raise ValueError(
                        f"include[{i}]: 'match' is the signature of an expected failure: it needs 'expect: fail'"
                    )
                for key in ("vllm", "without"):
                    if kind == "include" and e.get(key) is not None and e.get("expect") != "fail":
                        raise ValueError(
                            f"include[{i}]: '{key}' says for which builds a failure is expected: "
                            "it needs 'expect: fail'"
                        )
        return self


class Sweep(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # results/<name>-<time>/
    description: str | None = None
    platform: Platform = "cuda"
    models_file: str = "models.yaml"
    # a maintainer's own models: catalogue files (same schema as models_file, relative to the
    # sweep) merged over it in order: an entry adds a model or replaces one of the same name,
    # platform_limits add up (load_sweep)
    models_overlay: list[str] = []
    builds: dict[str, BuildSpec] = {"fixed": BuildSpec()}
    defaults: Defaults = Defaults()
    serve_args: dict[str, ServeArgsVariant | list[str]] = {"base": []}
    env: dict[str, dict[str, str]] = {"base": {}}
    ucx: dict[str, str] = {}
    matrix: Matrix
    eval: EvalSpec = EvalSpec()
    bench: BenchSpec = BenchSpec()
    gate: GateSpec = GateSpec()

    def serve_variant(self, name: str) -> ServeArgsVariant:
        v = self.serve_args[name]
        return ServeArgsVariant(both=v) if isinstance(v, list) else v


_MODELS: dict[str, type[BaseModel]] = {}  # filled below: union-member tags in error locs


class LoadedSweep(BaseModel):
    """A validated sweep with its catalogue and where both came from."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)
    sweep: Sweep
    catalogue: Catalogue
    path: Path
    catalogue_path: Path


_MODELS.update({c.__name__: c for c in (ServeArgsVariant, BuildSpec, ModelSpec, PlatformSupport, NixlSupport)})


# ---------------------------------------------------------------- loading
def _validate(model: type[BaseModel], data: Any, path: Path, node: yaml.Node | None) -> Any:
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        lines = []
        errors = e.errors()
        # a union member (e.g. ServeArgsVariant | list[str]) shows up as a loc tag; when the
        # value was a mapping, the list branch's error is noise: keep the model branch's
        tagged = {tuple(x["loc"][:i]) for x in errors for i, k in enumerate(x["loc"]) if k in _MODELS}
        for err in errors:
            raw = tuple(err["loc"])
            if any(isinstance(k, str) and "[" in k and raw[:i] in tagged for i, k in enumerate(raw)):
                continue
            tag = next((_MODELS[k] for k in raw if k in _MODELS), None)
            loc = tuple(x for x in raw if not (isinstance(x, str) and x.startswith("function-")))
            # pydantic reports union members as extra loc parts ("list[str]", ...): drop them
            member = ("str", "int", "constrained-int")
            loc = tuple(x for x in loc if not (isinstance(x, str) and ("[" in x or x in member or x in _MODELS)))
            line = line_of(node, loc)
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                parent = tag or resolve_model(model, loc[:-1])
                allowed = ", ".join(parent.model_fields) if parent else "?"
                msg = f"unknown key '{loc[-1]}' (allowed: {allowed})"
            elif err["type"] == "literal_error":
                msg = f"{msg} (got {err.get('input')!r})"
            elif err["type"] in ("less_than_equal", "greater_than_equal", "greater_than", "less_than"):
                field = next((k for k in reversed(loc) if isinstance(k, str)), "")
                why = BOUND_WHY.get(_BOUND_OF.get(field, ""))
                msg = f"{msg} (got {err.get('input')!r}{'; ' + why if why else ''})"
            lines.append(f"{path}:{line}: {fmt_loc(loc)}: {msg}")
        raise UserError("\n".join(dict.fromkeys(lines))) from None


def load_catalogue(path: str | Path) -> Catalogue:
    """Load and validate a model catalogue. Raises ``UserError``."""
    path = Path(path)
    data, node = read_yaml(path)
    cat = _validate(Catalogue, data, path, node)
    _raise_all(_guard_catalogue(cat, path, node))
    return cat


def load_sweep(path: str | Path) -> LoadedSweep:
    """Load a sweep YAML and its catalogue; check every name it refers to.

    Raises ``UserError`` naming file, line, field path and the allowed values.
    """
    path = Path(path)
    data, node = read_yaml(path)
    sweep: Sweep = _validate(Sweep, data, path, node)
    try:
        cat_path = (path.parent / sweep.models_file).resolve()
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop (pathlib before 3.13)
        raise UserError(f"{path}: models_file {sweep.models_file!r}: cannot resolve: {e}") from None
    catalogue = load_catalogue(cat_path)
    for extra in sweep.models_overlay:
        catalogue = merge_catalogue(catalogue, load_catalogue(_overlay_path(path, extra)), path)
    # every error of the file past its schema at once: names, guards, references, lengths
    _raise_all(
        _guard_sweep(sweep, path, node)
        + _name_errors(sweep, catalogue, path, node)
        + _reference_variant_errors(sweep, path, node)
        + _model_len_errors(sweep, catalogue, path, node)
    )
    return LoadedSweep(sweep=sweep, catalogue=catalogue, path=path, catalogue_path=cat_path)


def _overlay_path(sweep_path: Path, name: str) -> Path:
    p = (sweep_path.parent / name).resolve()
    if not p.is_file():
        raise UserError(f"{sweep_path}: models_overlay: {name!r}: no such file ({p})")
    return p


def merge_catalogue(base: Catalogue, overlay: Catalogue, sweep_path: Path) -> Catalogue:
    """``overlay``'s models over ``base``'s (a name in both: the overlay's entry, whole), their
    platform limits together; validated again (``tiny.weights_from`` across the two). Raises
    ``UserError`` naming the sweep when the merged catalogue is invalid."""
    try:
        return Catalogue(
            models={**base.models, **overlay.models}, platform_limits=[*base.platform_limits, *overlay.platform_limits]
        )
    except ValidationError as e:
        raise UserError(f"{sweep_path}: models_overlay: {e.errors()[0]['msg']}") from None


def _model_len_errors(sweep: Sweep, cat: Catalogue, path: Path, node: yaml.Node | None) -> list[str]:
    """``defaults.max_model_len`` above a tiny model's own length (its checkpoint's
    ``max_position_embeddings`` is the catalogue's ``max_model_len``, pdsweep.tiny.checkpoints):
    vLLM would refuse it at startup (``ValueError: User-specified max_model_len ... is greater
    than the derived max_model_len``, vllm/config/model.py)."""
    want = sweep.defaults.max_model_len
    if want is None:
        return []
    used = list(sweep.matrix.model) + [e["model"] for e in sweep.matrix.include if isinstance(e.get("model"), str)]
    out = []
    for name in dict.fromkeys(used):
        m = cat.models.get(name)
        if m is not None and m.tiny is not None and want > m.max_model_len:
            loc = ("defaults", "max_model_len")
            out.append(
                f"{path}:{line_of(node, loc)}: {fmt_loc(loc)}: {want} is above model '{name}''s "
                f"{m.max_model_len} tokens (its checkpoint's max_position_embeddings; allowed: 1..{m.max_model_len})"
            )
    return out


def _check_names(sweep: Sweep, cat: Catalogue, path: Path, node: yaml.Node | None) -> None:
    """Raises ``UserError`` with :func:`_name_errors`."""
    _raise_all(_name_errors(sweep, cat, path, node))


def _name_errors(sweep: Sweep, cat: Catalogue, path: Path, node: yaml.Node | None) -> list[str]:
    """Every model/build/serve_args/env name used in the matrix must exist."""
    known = {
        "model": list(cat.models),
        "build": list(sweep.builds),
        "serve_args": list(sweep.serve_args),
        "env": list(sweep.env),
    }
    errors = []

    def check(field: str, value: Any, loc: tuple[Any, ...]) -> None:
        if field in known and value not in known[field]:
            errors.append(
                f"{path}:{line_of(node, loc)}: {fmt_loc(loc)}: unknown {field} '{value}' "
                f"(allowed: {', '.join(known[field])})"
            )

    m = sweep.matrix
    for field in known:
        for i, v in enumerate(getattr(m, field) or []):
            check(field, v, ("matrix", field, i))
    for kind in ("include", "exclude"):
        for i, entry in enumerate(getattr(m, kind)):
            for field, v in entry.items():
                check(field, v, ("matrix", kind, i, field))
    d = sweep.defaults
    for field in ("build", "serve_args", "env"):
        check(field, getattr(d, field), ("defaults", field))
    return errors


# ---------------------------------------------------------------- safe names, derived flags (pdsweep.spec.guards)
def _raise_all(errors: list[str]) -> None:
    if errors:
        raise UserError("\n".join(dict.fromkeys(errors)))


def _guard_catalogue(cat: Catalogue, path: Path, node: yaml.Node | None) -> list[str]:
    """Model names are safe; catalogue serve_args/env set no flag pdsweep derives."""
    out = []
    for name, m in cat.models.items():
        if why := guards.unsafe_name(name, model=True):
            out.append(f"{path}:{line_of(node, ('models', name))}: models: {why}")
        out += _flag_errors(m.serve_args, ("models", name, "serve_args"), path, node)
        for arch, args in m.serve_args_by_arch.items():
            out += _flag_errors(args, ("models", name, "serve_args_by_arch", arch), path, node)
        out += _env_errors(m.env, ("models", name, "env"), path, node)
    return out


def _guard_sweep(sweep: Sweep, path: Path, node: yaml.Node | None) -> list[str]:
    """Build/variant names are safe; serve_args/env/ucx variants set no flag or variable
    pdsweep derives from the cell's axes (:mod:`pdsweep.spec.guards`)."""
    out = []
    for field in ("builds", "serve_args", "env"):
        for name in getattr(sweep, field):
            if why := guards.unsafe_name(name):
                out.append(f"{path}:{line_of(node, (field, name))}: {field}: {why}")
    for name, v in sweep.serve_args.items():
        if isinstance(v, list):
            out += _flag_errors(v, ("serve_args", name), path, node)
        else:
            for role in ("both", "prefill", "decode"):
                out += _flag_errors(getattr(v, role), ("serve_args", name, role), path, node)
    for name, env in sweep.env.items():
        out += _env_errors(env, ("env", name), path, node)
    out += _env_errors(sweep.ucx, ("ucx",), path, node)
    return out


def _flag_errors(args: list[str], loc: tuple[Any, ...], path: Path, node: yaml.Node | None) -> list[str]:
    return [
        f"{path}:{line_of(node, (*loc, i))}: {fmt_loc((*loc, i))}: {why}"
        for i, a in enumerate(args)
        if (why := guards.reserved_flag(a))
    ]


def _env_errors(env: dict[str, str], loc: tuple[Any, ...], path: Path, node: yaml.Node | None) -> list[str]:
    return [
        f"{path}:{line_of(node, (*loc, k))}: {fmt_loc((*loc, k))}: {why}"
        for k in env
        if (why := guards.reserved_env(k))
    ]


def check_reference_variants(sweep: Sweep, path: Path, node: yaml.Node | None) -> None:
    """``serve_args.<variant>.reference`` must name a serve_args variant; raises ``UserError``."""
    _raise_all(_reference_variant_errors(sweep, path, node))


def _reference_variant_errors(sweep: Sweep, path: Path, node: yaml.Node | None) -> list[str]:
    errors = []
    for name in sweep.serve_args:
        ref = sweep.serve_variant(name).reference
        if ref is not None and ref not in sweep.serve_args:
            loc = ("serve_args", name, "reference")
            errors.append(
                f"{path}:{line_of(node, loc)}: {fmt_loc(loc)}: unknown serve_args '{ref}' "
                f"(allowed: {', '.join(sweep.serve_args)})"
            )
    return errors
