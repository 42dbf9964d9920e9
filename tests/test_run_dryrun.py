"""pdsweep.run.dryrun: ``plan --nodes 0`` names --nodes (bad input of issue 37); out-of-bounds plan flags
are exit 2 and the port check counts the schedule's lanes (issue 23); the plan shows each cell's
reference cell, with the serve args the sweep names for it (issue 11)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _sweepfiles import sweep

from pdsweep.cli import main
from pdsweep.cli import main as cli_main
from pdsweep.plan.expand import expand
from pdsweep.plan.instance import Slot, instances

REPO = Path(__file__).resolve().parents[1]


def test_plan_nodes_zero_names_nodes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep = str(REPO / "sweeps" / "cpu-smoke.yaml")
    assert cli_main(["plan", sweep, "--nodes", "0", "--gpus-per-node", "8"]) == 2
    err = capsys.readouterr().err
    assert "--nodes 0: allowed 1.." in err and "give --gpus-per-node" not in err
    assert cli_main(["plan", sweep, "--nodes", "2"]) == 2
    assert "--nodes 2: give --gpus-per-node G as well" in capsys.readouterr().err


REPO = Path(__file__).resolve().parent.parent


SMALL = "name: x\nplatform: cpu\nmatrix: {model: [tiny-llama], tp: [p1d1], block_size: [32]}\n"


@pytest.mark.parametrize(
    "flags, why",
    [
        (["--cells", "nonexistent*"], "--cells 'nonexistent*' selects no cell"),
        (
            ["--nodes", "200000", "--gpus-per-node", "8"],
            "--nodes 200000: allowed 1..4096",  # not "give --gpus-per-node": it was given
        ),
        (["--launcher", "slurm", "--gpus-per-node", "-4"], "--gpus-per-node -4: allowed 0..64"),
    ],
)
def test_plan_flags_out_of_bounds_are_exit_2(tmp_path: Path, capsys, flags: list[str], why: str) -> None:
    (tmp_path / "models.yaml").write_text((REPO / "sweeps" / "models.yaml").read_text())
    (tmp_path / "s.yaml").write_text(SMALL)
    assert main(["plan", str(tmp_path / "s.yaml"), "--no-check-argv", *flags]) == 2
    err = capsys.readouterr().err
    assert why in err and "Traceback" not in err


def test_plan_port_check_counts_the_schedules_lanes(tmp_path: Path) -> None:
    from pdsweep.core.errors import UserError
    from pdsweep.plan.instance import Slot
    from pdsweep.run.dryrun import _check_slot_ports

    _check_slot_ports({"a": Slot(0, (0,), 65000)}, 20000)  # one lane of 200 ports from 65000: 65199 fits
    _check_slot_ports({"a": Slot(0, (0,), 65000), "b": Slot(1, (1,), 65336)}, 20000)  # ends at 65535: fits
    with pytest.raises(UserError, match="runs 2 lanes of 200 ports .*reach port 65536, past 65535"):
        _check_slot_ports({"a": Slot(0, (0,), 65000), "b": Slot(1, (1,), 65337)}, 20000)
    with pytest.raises(UserError, match="reach port 102602"):
        _check_slot_ports({"a": Slot(0, (0,), 102403)}, 20000)


REF_SWEEP = """serve_args:
  base: []
  prefix-caching: {both: [--enable-prefix-caching], reference: base}
  eager-off: {enforce_eager: false}
matrix: {model: [tiny-llama], tp: [p1d1], serve_args: [prefix-caching, eager-off]}
"""


def test_sweep_names_the_reference_serve_args_and_plan_shows_it(tmp_path):
    from pdsweep.run.dryrun import plan_dict

    ls = sweep(tmp_path, REF_SWEEP)
    plan = expand(ls)
    assert [c.id for c in plan.cells] == [
        "tiny-llama.p1d1.b32-32.fixed.prefix-caching",
        "tiny-llama.p1d1.b32-32.fixed.eager-off",
        "tiny-llama.ref-tp1.b32.fixed",  # prefix-caching's: base
        "tiny-llama.ref-tp1.b32.fixed.eager-off",
    ]  # default: the cell's own
    (ref,) = instances(plan.cells[2], Slot(0, (), 20000), ls, "/m", "python")
    assert "--enable-prefix-caching" not in ref.argv
    d = plan_dict(str(tmp_path / "s.yaml"), 0)
    assert [c["reference_cell"] for c in d["cells"]] == [
        "tiny-llama.ref-tp1.b32.fixed",
        "tiny-llama.ref-tp1.b32.fixed.eager-off",
        None,
        None,
    ]
