"""pdsweep.judge.facts: an impossible count in cell.json fails the cell naming the field (issue 15)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fixtures.make_runs import case, pd, write_run

from pdsweep.cli import main

CELL = pd("tiny-llama", 1, 1)


@pytest.mark.timeout(60, method="thread")  # without the bound, a 10**30 decode_tp kept the gate busy for minutes
@pytest.mark.parametrize(("field", "value"), [("prefill_tp", 0), ("decode_tp", 10**30), ("decode_block_size", -1)])
def test_an_impossible_count_in_cell_json_fails_the_cell_naming_the_field(
    tmp_path: Path, capsys, field: str, value: int
) -> None:
    """Found by the property test above in CI: a 0 TP reached tp_ratio (ZeroDivisionError) and a
    10**30 one range() (OverflowError, exit 3) or kept it looping. Now the cell fails, naming the field and its bound."""
    run = write_run(tmp_path, "run", [case(CELL), case(CELL.reference())])
    path = run / CELL.id / "cell.json"
    data = json.loads(path.read_text())
    data["cell"][field] = value
    path.write_text(json.dumps(data))
    assert main(["gate", str(run)]) == 1
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    assert f"{CELL.id}/cell.json: cell is not a complete cell record: {field}: Input should be" in out.out
