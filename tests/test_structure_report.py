"""scripts/structure_report.py counts what issue 34's goals are about, on planted code."""

from __future__ import annotations

import importlib.util
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
