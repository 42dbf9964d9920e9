"""Expectations that know the build: an ``expect: fail`` include entry may say for which
builds it holds, with ``vllm: SPECIFIER`` (PEP 440, e.g. ``"<0.27"``) and/or
``without: [FIX, ...]`` (:data:`pdsweep.builds.fixprobes.FIXES`). It applies to a cell when the
build's vLLM version is in the range and at least one listed fix is absent. Otherwise
the cell is expected to pass. Where the build cannot be probed (e.g. ``.venv-unfixed``
not made yet at ``pdsweep plan``) the expectation stays as declared; ``pdsweep run``
resolves it again with the real build before the cell starts.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version


def conditional(cell: Any) -> bool:
    """The cell's expectation names builds (``vllm`` or ``without``)."""
    return bool(cell.expect_vllm or cell.expect_without)


def applies(cell: Any, version: str | None, fixes: dict[str, bool | None]) -> tuple[bool | None, str]:
    """(does the expectation hold for this build, why): None when the build's version or
    a listed fix is unknown."""
    why = []
    if cell.expect_vllm:
        if version is None:
            return None, f"vLLM version of build {cell.build} unknown"
        try:
            v = Version(version.split("+")[0])
        except InvalidVersion:
            return None, f"vLLM version {version!r} of build {cell.build} not PEP 440"
        if v not in SpecifierSet(cell.expect_vllm):
            return False, f"build {cell.build} has vLLM {version}, outside {cell.expect_vllm}"
        why.append(f"vLLM {version} in {cell.expect_vllm}")
    if cell.expect_without:
        state = {f: fixes.get(f) for f in cell.expect_without}
        missing = [f for f, s in state.items() if s is False]
        if missing:
            why.append(f"build {cell.build} lacks {', '.join(missing)}")
        elif any(s is None for s in state.values()):
            return None, f"fixes {', '.join(f for f, s in state.items() if s is None)} not probed in build {cell.build}"
        else:
            return False, f"build {cell.build} contains {', '.join(cell.expect_without)}"
    return True, "; ".join(why)


def resolve(cell: Any, version: str | None, fixes: dict[str, bool | None]) -> Any:
    """``cell`` with ``expect_fail`` set for this build and ``expect_note`` saying why
    (unchanged when the expectation names no builds; kept as declared when unknown)."""
    if not conditional(cell):
        return cell
    ok, why = applies(cell, version, fixes)
    if ok is None:
        return replace(cell, expect_fail=True, expect_note=f"expected to fail as declared: {why}")
    return replace(cell, expect_fail=ok, expect_note=("applies: " if ok else "does not apply: ") + why)
