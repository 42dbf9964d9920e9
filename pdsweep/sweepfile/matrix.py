"""A sweep's ``matrix:`` (GitHub-Actions semantics: axes, ``include``, ``exclude``) and
one include/exclude entry, with ``expect: fail`` and ``kind: ref``."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pdsweep.sweepfile.axes import (
    AXES,
    BOUND_WHY,
    EXPECT_KEYS,
    MATCH_ANY,
    MAX_TP,
    REF_ENTRY_KEYS,
    TP_PAIR,
    Block,
    Dp,
    Fault,
    Instances,
    KvLayout,
    Pp,
    Router,
    Tp,
)
from pdsweep.sweepfile.catalogue import KvBufferDevice, validate_nested
from pdsweep.sweepfile.catalogue import Strict as _Strict


class MatrixEntry(_Strict):
    """One ``include``/``exclude`` entry: scalar axis values (typed like the axes) plus,
    for include, ``expect: fail`` with ``reason`` and ``ref``, and ``kind: ref`` for an
    entry that sets the expectation of matching reference cells (:data:`REF_ENTRY_KEYS`)."""

    kind: Literal["ref"] | None = None

    model: str | None = None
    tp: str | None = Field(default=None, pattern=TP_PAIR.pattern)
    prefill_tp: Tp | None = None
    decode_tp: Tp | None = None
    block_size: Block | None = None
    prefill_block_size: Block | None = None
    decode_block_size: Block | None = None
    num_prefill: Instances | None = None
    num_decode: Instances | None = None
    decode_dp: Dp | None = None
    prefill_pp: Pp | None = None
    kv_cache_layout: KvLayout | None = None
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
    # for which builds the expectation holds (pdsweep.sweepfile.expectations): a PEP 440 range of the
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
                rx = re.compile(v)
            except re.error as e:
                raise ValueError(f"not a regular expression: {e}") from None
            trivial = next((t for t in TRIVIAL_TEXTS if rx.search(t) is not None), None)
            if v != MATCH_ANY and trivial is not None:
                raise ValueError(
                    f"{v!r} matches {trivial!r}, so it explains any failure: name the failure's signature, "
                    f"or write 'match: {MATCH_ANY}' to accept any failure (counted loudly by the gate)"
                )
        return v


# texts no failure signature matches: a `match:` that finds one of them explains every failure (a silent `match: any`)
TRIVIAL_TEXTS = ("", "\x00", " ", "\n")


def _tp_pair_in_bounds(pair: str) -> str:
    p, d = map(int, TP_PAIR.fullmatch(pair).groups())  # type: ignore[union-attr]
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
    prefill_pp: list[Pp] | None = Field(default=None, min_length=1)
    kv_cache_layout: list[KvLayout] | None = Field(default=None, min_length=1)
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
            if not TP_PAIR.fullmatch(str(item)):
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
                validate_nested(MatrixEntry, e, f"{kind}[{i}]")
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
