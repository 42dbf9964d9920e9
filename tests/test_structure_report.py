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
