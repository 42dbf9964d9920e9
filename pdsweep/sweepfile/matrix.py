"""A sweep's ``matrix:`` (GitHub-Actions semantics: axes, ``include``, ``exclude``) and
one include/exclude entry, with ``expect: fail`` and ``kind: ref``."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, create_model, field_validator, model_validator

from pdsweep.builds.fixprobes import FIXES
from pdsweep.sweepfile.axes import AXES, AXIS_TYPES, DEFAULTS, EXPECT_KEYS, MATCH_ANY, REF_ENTRY_KEYS, SHORTHANDS
from pdsweep.sweepfile.catalogue import Strict as _Strict
from pdsweep.sweepfile.catalogue import validate_nested


class _EntryKeys(_Strict):
    """An ``include``/``exclude`` entry besides its axis values (one of each, :data:`AXIS_TYPES`):
    for include, ``expect: fail`` with ``reason`` and ``ref``, and ``kind: ref`` for an entry that
    sets the expectation of matching reference cells (:data:`REF_ENTRY_KEYS`)."""

    kind: Literal["ref"] | None = None
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
        bad = [f for f in v or [] if f not in FIXES]
        if bad:
            raise ValueError(f"unknown fix probe(s) {bad} (allowed: {', '.join(FIXES)})")
        return v

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

_one_each: dict[str, Any] = {k: (t | None, None) for k, (t, _) in AXIS_TYPES.items()}
MatrixEntry = create_model("MatrixEntry", __base__=_EntryKeys, **_one_each)


class _MatrixLists(_Strict):
    """The matrix besides its axes (a non-empty list of each, :data:`AXIS_TYPES`): ``include`` and ``exclude``."""

    include: list[dict[str, Any]] = []
    exclude: list[dict[str, Any]] = []

    @model_validator(mode="after")
    def _no_double_axes(self) -> _MatrixLists:
        for short, (a, b) in SHORTHANDS.items():
            if getattr(self, short) and (getattr(self, a) or getattr(self, b)):
                raise ValueError(f"give '{short}' or '{a}'/'{b}' axes, not both")
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
                for short, (a, b) in SHORTHANDS.items():
                    if short in e and (a in e or b in e):
                        raise ValueError(f"{kind}[{i}]: give '{short}' or '{a}'/'{b}', not both")
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


if TYPE_CHECKING:

    class Matrix(_MatrixLists):
        """The matrix as mypy sees it: its axes are :data:`AXIS_TYPES`'s."""

        def __getattr__(self, name: str) -> Any: ...

else:
    # an axis without a default that is no shorthand (the model) is required
    Matrix = create_model(
        "Matrix",
        __base__=_MatrixLists,
        **{
            k: (list[t], Field(min_length=1))
            if k not in DEFAULTS and k not in SHORTHANDS
            else (list[t] | None, Field(default=None, min_length=1))
            for k, (t, _) in AXIS_TYPES.items()
        },  # fmt: skip
    )
