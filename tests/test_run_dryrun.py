"""pdsweep.run.dryrun: ``plan --nodes 0`` names --nodes (bad input of issue 37)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdsweep.cli import main as cli_main

REPO = Path(__file__).resolve().parents[1]


def test_plan_nodes_zero_names_nodes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep = str(REPO / "sweeps" / "cpu-smoke.yaml")
    assert cli_main(["plan", sweep, "--nodes", "0", "--gpus-per-node", "8"]) == 2
    err = capsys.readouterr().err
    assert "--nodes 0: allowed 1.." in err and "give --gpus-per-node" not in err
    assert cli_main(["plan", sweep, "--nodes", "2"]) == 2
    assert "--nodes 2: give --gpus-per-node G as well" in capsys.readouterr().err
