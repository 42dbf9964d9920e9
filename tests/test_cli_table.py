"""The subcommand table, the one error-to-exit-code mapping and the cell-directory object."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from pdsweep.cli import SUBCOMMANDS, build_parser, chosen_path
from pdsweep.commands.run import RunArgs
from pdsweep.core.errors import EXIT_GATE_FAILED, EXIT_INTERNAL, EXIT_USER_ERROR, GateFailed, UserError, run_main
from pdsweep.results import layout


def test_command_names_are_unique_and_every_leaf_has_an_entry_point() -> None:
    names = [c.name for c in SUBCOMMANDS]
    assert names == [
        "validate",
        "plan",
        "fetch",
        "run",
        "gate",
        "compare",
        "report",
        "history",
        "dashboard",
        "bisect",
        "best",
        "proxy",
        "baseline-env",
        "builds",
        "bench",
    ]
    leaves = [c for c in SUBCOMMANDS if not c.children] + [k for c in SUBCOMMANDS for k in c.children]
    assert all(c.module is not None for c in leaves)
    assert [k.name for k in SUBCOMMANDS[-1].children] == ["transfer"]


def test_every_command_module_imports_with_its_entry_points() -> None:
    """A row names its module relative to the package; a moved module or Args class breaks its command."""
    leaves = [c for c in SUBCOMMANDS if not c.children] + [k for c in SUBCOMMANDS for k in c.children]
    assert [c.module for c in leaves if c.args is None] == [
        "deploy.proxy",
        "builds.baseline",
        "builds.make",
        "commands.tonight",
        "xfer.bench",
    ]
    for c in leaves:
        entry = c._entry()
        assert callable(entry.add_cli_args), c.module
        assert callable(entry.from_cli_args if c.args else entry.main), c.module
    for argv in (
        ["proxy", "--help"],
        ["baseline-env", "--help"],
        ["builds", "make", "--help"],
        ["builds", "tonight", "--help"],
        ["bench", "transfer", "--help"],
    ):
        with pytest.raises(SystemExit) as e:
            build_parser(argv).parse_args(argv)
        assert e.value.code == 0, argv


def test_start_up_imports_no_subcommand_module() -> None:
    """``pdsweep --help`` (and any command's parse) imports only the chosen command's module: a
    subcommand module imports its pdsweep modules at the top (docs/contributing.md), pydantic and
    the rest come with them."""
    code = (
        "import sys; from pdsweep.cli import build_parser; build_parser([])\n"
        "print(sorted(m for m in sys.modules if m.startswith('pdsweep.commands.') or m in ('pydantic', 'yaml')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize(
    "argv, path",
    [
        (["-v", "bench", "transfer", "--model", "x"], ["bench", "transfer"]),
        (["validate", "proxy"], ["validate"]),  # a sweep file named like a command is not a command
        (["proxy", "--prefill", "http://a"], ["proxy"]),
        (["--help"], []),
        (["nosuch"], []),
    ],
)
def test_chosen_path_is_the_leading_command_words(argv: list[str], path: list[str]) -> None:
    assert chosen_path(argv) == path


def test_run_options_come_from_the_flags_of_the_same_name() -> None:
    from pdsweep.run.context import RunOptions

    ns = build_parser(["run"]).parse_args(["run", "s.yaml", "--quiet", "--gpus", "2", "--cells", "tiny*"])
    args = RunArgs.from_cli_args(ns)
    assert args.sweep == "s.yaml"
    assert args.opts == dataclasses.replace(RunOptions(), quiet=True, gpus=2, cells="tiny*")


def test_run_main_maps_each_error_kind_once(capsys: pytest.CaptureFixture[str]) -> None:
    def boom(exc: BaseException):
        def main() -> int:
            raise exc

        return main

    assert run_main(lambda: None) == 0
    assert run_main(lambda: 7) == 7
    assert run_main(boom(UserError("sweeps/x.yaml:3: bad"))) == EXIT_USER_ERROR
    assert capsys.readouterr().err == "error: sweeps/x.yaml:3: bad\n"
    assert run_main(boom(GateFailed("gate: FAILED: 1 FAIL"))) == EXIT_GATE_FAILED
    assert capsys.readouterr().err == "gate: FAILED: 1 FAIL\n"
    assert run_main(boom(OSError(28, "No space left on device"))) == EXIT_INTERNAL  # not "bad input"
    err = capsys.readouterr().err
    assert "Traceback" in err and "OSError: [Errno 28] No space left on device" in err
    assert "please report it" in err


def test_cell_dir_names_every_path_of_a_cell(tmp_path: Path) -> None:
    cd = layout.CellDir.of(tmp_path, "tiny-llama.p1d1.b16-16.fixed")
    assert cd.path == tmp_path / "tiny-llama.p1d1.b16-16.fixed"
    assert cd.file(layout.STATUS_FILE) == cd.path / "status.json"
    assert (cd.logs, cd.metrics, cd.lm_eval) == (cd.path / "logs", cd.path / "metrics", cd.path / "lm_eval")
    assert cd.where(layout.ACCURACY_FILE) == "tiny-llama.p1d1.b16-16.fixed/accuracy.json"
    assert cd.read(layout.STATUS_FILE) is None and cd.status is None
    layout.write_json(cd.file(layout.STATUS_FILE), {"status": "ok"})
    assert cd.status == "ok" and cd.read(layout.STATUS_FILE) == {"schema": layout.SCHEMA, "status": "ok"}
    with pytest.raises(UserError, match="is not a safe directory name"):
        layout.CellDir.of(tmp_path, "../escape")


def test_write_text_names_the_path_it_cannot_write(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match=r"file/out\.md: cannot write: "):
        layout.write_text(tmp_path / "file" / "out.md", "x")
    mode_file = layout.write_text(tmp_path / "m.txt", "ü", mode=0o640)
    assert mode_file.read_text(encoding="utf-8") == "ü" and mode_file.stat().st_mode & 0o777 == 0o640
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp file left


@pytest.mark.parametrize("command", ["gate", "report", "compare"])
def test_a_run_directory_that_does_not_exist_says_what_writes_one(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A new user's ``make gate`` before any sweep read ``results/latest: not a pdsweep run (run.json
    missing)``; a missing directory now says what writes one (exit 2), an empty one keeps the old words."""
    from pdsweep.cli import main

    gone = tmp_path / "latest"
    argv = [command, str(gone)] + ([str(gone)] if command == "compare" else [])
    assert main(argv) == 2
    assert (
        f"{gone}: no such run directory (`make sweep` or `pdsweep run SWEEP --out DIR` writes one)"
        in capsys.readouterr().err
    )
    gone.mkdir()
    assert main(argv) == 2
    assert f"{gone}: not a pdsweep run (run.json missing)" in capsys.readouterr().err
