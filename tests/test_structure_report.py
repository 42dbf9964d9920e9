"""scripts/structure_report.py counts what the goals of issues 34 and 55 are about, on planted code."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("structure_report", ROOT / "scripts" / "structure_report.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_long_functions_many_parameters_and_lazy_imports_are_counted(tmp_path: Path) -> None:
    sr = _script()
    body = "\n".join(f"    x{i} = {i}" for i in range(85))
    p = tmp_path / "m.py"
    p.write_text(
        f"def long(a, b, c, d, e, f, g, h):\n    from pdsweep.core import stats\n{body}\n\n\ndef short(self):\n    pass\n"
    )
    fs = {f.name: f for f in sr.functions(p)}
    assert sr.n_params(fs["long"]) == 8 and sr.n_params(fs["short"]) == 0
    assert (fs["long"].end_lineno or 0) - fs["long"].lineno + 1 == 87
    assert sr.lazy_imports(p) == 1


def test_a_copied_run_of_six_lines_is_one_duplicate_pair(tmp_path: Path, monkeypatch) -> None:
    sr = _script()
    monkeypatch.setattr(sr, "ROOT", tmp_path)
    run = "\n".join(f"    total = total + value_{i} * {i}" for i in range(6))
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text(f"def f():\n{run}\n    return total\n")
    lines = run.splitlines()
    b.write_text("def g():\n    y = 1\n" + "\n".join([*lines[:3], "    # a comment", "", *lines[3:]]) + "\n")
    assert sr.duplicate_pairs([a, b]) == [("a.py", 2, "b.py", 3)]  # comments and blank lines do not count
    b.write_text("def g():\n" + "\n".join(run.splitlines()[:5]) + "\n")  # five lines: not a pair
    assert sr.duplicate_pairs([a, b]) == []


def test_the_report_of_this_tree_has_every_figure(capsys) -> None:
    assert _script().main([]) == 0
    out = capsys.readouterr().out
    for name in ("files over 500 lines", "functions over 80 lines", "duplicate pairs", "import cycles: 0 ok"):
        assert name in out


def test_test_folders_dtype_tables_and_basename_pairs_are_counted(tmp_path: Path, monkeypatch) -> None:
    sr = _script()
    monkeypatch.setattr(sr, "ROOT", tmp_path)
    pkg = tmp_path / "pdsweep"
    for d in ("spec", "tests", "measure", "judge", "commands", "plan", "run"):
        (pkg / d).mkdir(parents=True)
    for rel in (
        "measure/accuracy.py",
        "judge/accuracy.py",
        "commands/gate.py",
        "judge/gate.py",
        "plan/cell.py",
        "run/cell.py",
    ):
        (pkg / rel).write_text("")
    (pkg / "measure" / "accuracy.py").write_text("DTYPE_BYTES = {'fp8': 1}\n")
    (pkg / "judge" / "accuracy.py").write_text("def f():\n    DTYPE_BYTES: dict = {}\n")
    paths = sorted(pkg.rglob("*.py"))
    assert sr.test_folders(pkg) == ["pdsweep/spec", "pdsweep/tests"]
    assert sr.definitions(paths, "DTYPE_BYTES") == ["pdsweep/judge/accuracy.py:2", "pdsweep/measure/accuracy.py:1"]
    # commands/gate.py is the front of `pdsweep gate`: not a pair; plan/cell ~ run/cell is one (BASENAME_TOPICS
    # tells their topics apart, measure/accuracy ~ judge/accuracy has no entry: it shares a topic)
    assert sr.basename_pairs(paths, pkg) == [
        ("accuracy", "judge/accuracy.py", "measure/accuracy.py"),
        ("cell", "plan/cell.py", "run/cell.py"),
    ]
    assert "accuracy" not in sr.BASENAME_TOPICS and "cell" in sr.BASENAME_TOPICS


def test_the_check_passes_on_this_tree() -> None:
    """``--check``: every figure meets its goal (step three's and step four's, issue 55)."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "structure_report.py"), "--check"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr
    for figure in (
        "in-function pdsweep imports",
        "package folders named like test folders: 0 ok",
        "DTYPE_BYTES definitions: 1 ok",
        "module pairs sharing a basename and a topic: 0 ok",
        "files over 500 lines: 0 ok",
    ):
        assert figure in r.stdout, figure


def test_the_call_graph_follows_resolvable_calls_only(tmp_path: Path) -> None:
    """Imported functions, ``module.f()``, a class's ``__init__``, ``self.m()`` and a base class's
    method are followed, transitively; a call through a value of unknown type is not."""
    sr = _script()
    pkg = tmp_path / "pdsweep"
    for d in ("a", "b", "c", "d"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "top.py").write_text(
        "from pdsweep.b.help import helper\nfrom pdsweep.b import help as hmod\n\n\n"
        "def entry(x):\n    helper(x)\n    hmod.other()\n    x.fails()\n    return Box(x).go()\n\n\n"
        "class Base:\n    def ping(self):\n        from pdsweep.c.deep import leaf\n\n        return leaf()\n\n\n"
        "class Box(Base):\n    def __init__(self, x):\n        self.x = x\n\n    def go(self):\n        return self.ping()\n"
    )
    (pkg / "b" / "help.py").write_text("def helper(x):\n    return x\n\n\ndef other():\n    return 1\n")
    (pkg / "c" / "deep.py").write_text("def leaf():\n    return 2\n")
    (pkg / "d" / "never.py").write_text("def fails():\n    return 3\n")  # x.fails(): type unknown
    got = sr.call_graph("a.top", "entry", pkg)
    assert got == {
        ("a.top", "entry"),
        ("a.top", "Box.__init__"),
        ("b.help", "helper"),
        ("b.help", "other"),
    }
    # Box(x).go() is a call on a value: not followed, so Base.ping only via self in a method
    (pkg / "a" / "top.py").write_text((pkg / "a" / "top.py").read_text().replace("Box(x).go()", "Box.go(x)"))
    got = sr.call_graph("a.top", "entry", pkg)
    assert {("a.top", "Box.go"), ("a.top", "Base.ping"), ("c.deep", "leaf")} <= got
    assert ("d.never", "fails") not in got


def test_gate_run_enters_the_judge_and_the_results_layout_never_a_renderer() -> None:
    mods = {m for m, _ in _script().call_graph("judge.gate", "gate_run")}
    assert {"judge.gate", "judge.facts", "judge.agreement", "judge.flaky", "results.layout"} <= mods
    assert not {m for m in mods if m.split(".")[0] in ("report", "measure", "run", "deploy")}
