"""pdsweep.sweepfile.axes: numbers outside an axis's bounds are refused with the bound's reason (issue 15)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _sweepfiles import SMALL, bad
from hypothesis import given, settings
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "patch, field, why",
    [
        ("defaults: {decode_dp: 9}", "defaults.decode_dp", "NIXL side-channel ports"),
        ("defaults: {port_base: 70000}", "defaults.port_base", "TCP ports end at 65535"),
        ("defaults: {prefill_tp: true}", "defaults.prefill_tp", "valid integer"),
        ("defaults: {prefill_block_size: 100000}", "defaults.prefill_block_size", "tokens per KV block"),
        ("bench: {concurrencies: [0]}", "bench.concurrencies[0]", "greater than or equal to 1"),
        ("eval: {consistency: {lengths: [-5]}}", "eval.consistency.lengths[0]", "greater than or equal to 1"),
        ("defaults: {num_decode: 12}", "defaults.num_decode", "at most 12 instances"),
    ],
)
def test_nonsense_numbers_are_refused(tmp_path: Path, capsys, patch: str, field: str, why: str) -> None:
    msg = bad(tmp_path, SMALL + patch + "\n", capsys)
    assert f"s.yaml:{SMALL.count(chr(10)) + 1}: {field}: " in msg and why in msg


def test_tp_pair_beyond_the_bound_is_refused(tmp_path: Path, capsys) -> None:
    assert "'p100d1': TP 100 is more than 64" in bad(tmp_path, SMALL.replace("p1d1", "p100d1"), capsys)


@given(st.integers(-(10**6), 10**6))
@settings(max_examples=100, deadline=None)
def test_property_decode_dp_bounds(n: int) -> None:
    from pydantic import ValidationError

    from pdsweep.sweepfile.serve import Defaults

    if 1 <= n <= 8:
        assert Defaults(decode_dp=n).decode_dp == n
    else:
        with pytest.raises(ValidationError):
            Defaults(decode_dp=n)


def test_an_axis_is_declared_once_and_every_cell_has_it() -> None:
    """pdsweep.sweepfile.axes.AXIS_TYPES: the matrix, an include/exclude entry and ``defaults:``
    take their axis fields from it, and every axis but the shorthands is a field of Cell with
    the default ``defaults:`` gives (where Cell has one)."""
    import dataclasses

    from pdsweep.plan.cell import Cell
    from pdsweep.sweepfile.axes import AXES, AXIS_TYPES, DEFAULTS, SHORTHANDS
    from pdsweep.sweepfile.matrix import Matrix, MatrixEntry
    from pdsweep.sweepfile.serve import Defaults

    cell = {f.name: f.default for f in dataclasses.fields(Cell)}
    assert AXES == tuple(AXIS_TYPES) and set(SHORTHANDS) < set(AXES)
    missing = [a for a in AXES if a not in SHORTHANDS and a not in cell]
    assert not missing, f"axes that are no field of Cell: {missing}"
    assert (
        {a for a in Matrix.model_fields if a in AXES} == set(AXES) == {a for a in MatrixEntry.model_fields if a in AXES}
    )
    assert {a for a in Defaults.model_fields if a in AXES} == set(DEFAULTS) == set(AXES) - set(SHORTHANDS) - {"model"}
    assert [a for a in Matrix.model_fields if Matrix.model_fields[a].is_required()] == ["model"]
    differ = {a: (d, cell[a]) for a, d in DEFAULTS.items() if cell[a] is not dataclasses.MISSING and cell[a] != d}
    assert not differ, f"Cell's default differs from defaults:'s (axis: (defaults, Cell)): {differ}"
    assert Defaults().model_dump(include=set(DEFAULTS)) == DEFAULTS
