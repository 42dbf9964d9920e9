"""The cell model: one PD deployment or single-instance reference of a sweep
(:class:`Cell`, with its stable id and compare key) and a cell a rule refused
(:class:`Rejected`). Plain values; :mod:`pdsweep.plan.expand` makes them, everything
downstream reads them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from functools import cached_property
from typing import Any

from pdsweep.plan.topology import tp_ratio

BUILD_PART = 3  # the build's index among a cell id's parts (after the model, TP pair and blocks)


@dataclass(frozen=True)
class Cell:
    """One PD deployment (``kind='pd'``) or a single-instance reference (``kind='ref'``)."""

    model: str
    prefill_tp: int
    decode_tp: int
    prefill_block_size: int
    decode_block_size: int
    num_prefill: int
    num_decode: int
    kv_buffer_device: str
    build: str
    serve_args: str = "base"
    env: str = "base"
    router: str = "pdsweep"  # PD router (pdsweep.deploy.router); a reference has none
    fault: str = "none"  # fault drill (pdsweep.run.drills); a reference has none
    decode_dp: int = 1
    prefill_pp: int = 1  # prefill pipeline stages
    kv_cache_layout: str = "HND"  # decode's VLLM_KV_CACHE_LAYOUT
    kind: str = "pd"
    platform: str = "cuda"
    expect_fail: bool = False
    expect_reason: str | None = None
    expect_ref: str | None = None
    expect_match: str | None = None  # regex the failure's signature must match (gate)
    expect_vllm: str | None = None  # holds for builds in this vLLM range (sweepfile.expectations)
    expect_without: tuple[str, ...] = ()  # ... and lacking one of these fixes (pdsweep.builds.fixprobes)
    expect_note: str | None = None  # whether it applies to this cell's build, and why

    @cached_property
    def id(self) -> str:
        """Stable, readable id, e.g. ``kimi-linear.p2d1.b128-128.fixed`` (computed once per cell:
        a 1000-cell plan asks it millions of times)."""
        return ".".join(self._id_parts)

    @cached_property
    def _id_parts(self) -> list[str]:
        """The id's parts: model, TP pair (or reference TP), blocks, build (:data:`BUILD_PART`),
        then one part per axis off its default."""
        if self.kind == "ref":
            parts = [self.model, f"ref-tp{self.decode_tp}", f"b{self.decode_block_size}", self.build]
        else:
            parts = [
                self.model,
                f"p{self.prefill_tp}d{self.decode_tp}",
                f"b{self.prefill_block_size}-{self.decode_block_size}",
                self.build,
            ]
            if (self.num_prefill, self.num_decode) != (1, 1):
                parts.append(f"{self.num_prefill}x{self.num_decode}")
            if self.decode_dp != 1:
                parts.append(f"ddp{self.decode_dp}")
            if self.prefill_pp != 1:
                parts.append(f"ppp{self.prefill_pp}")
            if self.kv_cache_layout != "HND":
                parts.append(f"layout-{self.kv_cache_layout.lower()}")
        if self.kv_buffer_device != self.platform:  # e.g. host staging on a GPU node
            parts.append(f"kvbuf-{self.kv_buffer_device}")
        if self.serve_args != "base":
            parts.append(self.serve_args)
        if self.env != "base":
            parts.append(f"env-{self.env}")
        if self.kind == "pd" and self.router != "pdsweep":
            parts.append(f"router-{self.router}")
        if self.fault != "none":
            parts.append(f"fault-{self.fault}")
        return parts

    @property
    def compare_key(self) -> str:
        """The id without its build part, to line up fixed and unfixed runs of one cell."""
        return ".".join(p for i, p in enumerate(self._id_parts) if i != BUILD_PART)

    @property
    def tp_ratio(self) -> int:
        return tp_ratio(self.prefill_tp, self.decode_tp)

    @cached_property
    def num_ranks(self) -> int:
        """Model-executing ranks: num_prefill*prefill_tp*prefill_pp + num_decode*decode_tp*decode_dp
        (ref: decode_tp)."""
        if self.kind == "ref":
            return self.decode_tp
        prefill = self.num_prefill * self.prefill_tp * self.prefill_pp
        return prefill + self.num_decode * self.decode_tp * self.decode_dp

    @cached_property
    def num_gpus(self) -> int:
        """GPUs the cell holds: one per rank on cuda, none on cpu."""
        return self.num_ranks if self.platform == "cuda" else 0

    def reference(self, build: str | None = None, serve_args: str | None = None) -> Cell:
        """The single-instance (non-PD) reference of this cell at the decode TP, on
        ``build`` (the sweep's default build: the single-instance path never touches the
        KV connector, so one reference serves the fixed and the unfixed build), with the
        ``serve_args`` variant (default: the cell's; see :func:`reference_of`)."""
        return replace(
            self,
            kind="ref",
            router="pdsweep",
            fault="none",
            build=build or self.build,
            serve_args=serve_args or self.serve_args,
            prefill_tp=self.decode_tp,
            prefill_block_size=self.decode_block_size,
            num_prefill=0,
            num_decode=1,
            decode_dp=1,
            prefill_pp=1,
            kv_cache_layout="HND",
            expect_fail=False,
            expect_reason=None,
            expect_ref=None,
            expect_match=None,
            expect_vllm=None,
            expect_without=(),
            expect_note=None,
        )

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, **asdict(self)}


@dataclass(frozen=True)
class Rejected:
    """A cell a plan rule refused: ``rule`` is the rule id, ``reason`` says why."""

    cell: Cell
    rule: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        """The one shape of a rejected cell in run.json, plan.json and ``pdsweep plan``:
        ``{"cell_id", "cell": Cell.to_dict(), "rule", "reason"}``."""
        return {"cell_id": self.cell.id, "cell": self.cell.to_dict(), "rule": self.rule, "reason": self.reason}
