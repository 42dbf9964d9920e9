"""A sweep's ``eval:`` (lm-eval and the consistency probe) and ``bench:`` (the load phase
and its workloads) sections: the settings of a cell's measured phases."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from pdsweep.core.errors import UserError
from pdsweep.results.layout import probe_prompt_name
from pdsweep.sweepfile.axes import Pos
from pdsweep.sweepfile.catalogue import Strict as _Strict
from pdsweep.sweepfile.slo import parse_slo


class ConsistencySpec(_Strict):
    enabled: bool = True
    max_tokens: int = Field(default=8, gt=0)
    # prompt lengths in tokens; "block" = one block minus one, "long" = near max_model_len
    lengths: list[Pos | Literal["short", "blocks", "long"]] = Field(default=["short", "blocks", "long"], min_length=1)
    # the reference also answers each position along its plain prefill path, so a
    # divergence is triaged as transfer / engine / both (pdsweep.measure.probe.path_check)
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
    # run the two cells that differ only by build (fixed/unfixed, candidate/baseline) as a pair: both
    # deployed at once, their load repeats interleaved in ABBA order, judged by the paired interval
    # (pdsweep.measure.paired; docs/performance.md). Unset (the default): on wherever the sweep has such
    # cells and the load phase can pair (pdsweep.plan.pairing); false: the opt-out, each cell alone, one
    # after the other; true: required (a load phase that cannot pair is refused)
    pair_builds: bool | None = None
    # per-request SLOs in ms passed to `vllm bench serve --goodput ttft:<ms> tpot:<ms> e2el:<ms>`
    # (vllm/benchmarks/serve.py check_goodput_args): load.json records vLLM's request_goodput
    goodput: dict[Literal["ttft", "tpot", "e2el"], Annotated[float, Field(gt=0)]] | None = None
    # latency SLOs the report recommends a configuration for (pdsweep best --slo; sweepfile.slo)
    slos: list[str] = []

    @field_validator("slos")
    @classmethod
    def _slos(cls, v: list[str]) -> list[str]:
        for text in v:
            try:
                parse_slo(text)
            except UserError as e:
                raise ValueError(str(e).replace("--slo", "bench.slos", 1)) from None
        return v

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

    @model_validator(mode="after")
    def _paired(self) -> BenchSpec:
        """``pair_builds: true`` interleaves a fixed count of load repeats (pdsweep.measure.paired);
        unset, a load phase that cannot pair runs unpaired, the plan saying why (pdsweep.plan.pairing)."""
        if self.pair_builds is not True:
            return self
        if not self.enabled:
            raise ValueError("bench.pair_builds pairs the load phase's repeats: it needs bench.enabled: true")
        if self.target_ci is not None:
            raise ValueError(
                "bench.pair_builds runs both sides the same fixed number of repeats: drop bench.target_ci "
                "(allowed with pair_builds: unset) and set bench.repeats"
            )
        if self.repeats == 1:
            raise ValueError("bench.pair_builds needs bench.repeats >= 2 (allowed: 2..99): one pair has no interval")
        return self


BLOCKS_FACTOR = 3.5  # "blocks" prompt: several full blocks plus a partial one


def resolve_lengths(
    block_size: int, max_model_len: int, lengths: Sequence[int | str], max_tokens: int = 8
) -> list[tuple[str, int]]:
    """``(name, prompt tokens)`` per entry of ``lengths`` (``ConsistencySpec.lengths``; names:
    :func:`pdsweep.results.layout.probe_prompt_name`): ``short`` = one block minus one, ``blocks`` =
    ``int(3.5 * block_size)``, ``long`` = ``max_model_len - max_tokens - 1`` (the cap: the prompt plus
    ``max_tokens`` generated tokens must fit), an int = that many tokens. ``short``/``blocks`` are
    clamped to the cap; duplicate names dropped. Raises ``UserError`` if the cap is below 1 or an int
    is outside ``1..cap``."""
    cap = max_model_len - max_tokens - 1
    if cap < 1:
        raise UserError(
            f"consistency: max_model_len {max_model_len} leaves no room for a prompt and max_tokens {max_tokens}"
        )
    out: dict[str, int] = {}
    for item in lengths:
        name = probe_prompt_name(item)  # consistency.json's name of it; an unknown entry raises
        if name == "short":
            n = min(max(1, block_size - 1), cap)
        elif name == "blocks":
            n = min(int(BLOCKS_FACTOR * block_size), cap)
        elif name == "long":
            n = cap
        elif not 1 <= (n := int(item)) <= cap:  # len<N>: an int
            raise UserError(
                f"consistency.lengths: {item} tokens is outside 1..{cap} "
                f"(max_model_len {max_model_len} - max_tokens {max_tokens} - 1)"
            )
        out.setdefault(name, n)
    return list(out.items())
