#!/usr/bin/env python3
"""Print the structure figures issue 34 sets goals for, measured from the code (``ast``; nothing
is imported or run), and exit 1 when one misses its goal (``--check``).

Figures (``pdsweep/`` only; tests, fixtures and generated files are not counted):

* files over 500 lines; functions over 80 lines (decorators included);
* functions with 8 or more parameters (``self``/``cls`` not counted);
* lazy in-package imports (a ``pdsweep`` import inside a function);
* import cycles and upward imports (the rules of tests/test_layers.py, whose functions this reuses);
* duplicate pairs: two places sharing a run of 6 or more normalized lines (blank lines, comments,
  imports and lone punctuation dropped, white space folded), counted once per pair of regions;
* the modules ``judge.gate`` reaches through its imports (the "rooms" a reader of ``gate_run`` enters).

Usage: ``python scripts/structure_report.py [--check] [--list]``.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "pdsweep"
GOALS = {
    "files over 500 lines": 0,
    "functions over 80 lines": 0,
    "functions with >= 8 parameters": 5,
    "duplicate pairs": 5,
    "import cycles": 0,
    "upward imports": 0,
    "modules judge.gate reaches": 8,
}
WINDOW = 6


def _layers():
    spec = importlib.util.spec_from_file_location("_layers", ROOT / "tests" / "test_layers.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def sources() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


def functions(path: Path) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    tree = ast.parse(path.read_text(), str(path))
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def n_params(f: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = f.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    return len([n for n in names if n not in ("self", "cls")]) + bool(a.vararg) + bool(a.kwarg)


def lazy_imports(path: Path) -> int:
    count = 0
    for f in functions(path):
        for n in ast.walk(f):
            if isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").startswith("pdsweep")):
                count += 1
            elif isinstance(n, ast.Import) and any(a.name.startswith("pdsweep") for a in n.names):
                count += 1
    return count


_SKIP = re.compile(r"^(#.*|import .*|from \S+ import .*|[()\[\]{},:]+|\"\"\"|''')?$")


def normalized(path: Path) -> list[tuple[int, str]]:
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        s = " ".join(line.split())
        if not _SKIP.match(s):
            out.append((i, s))
    return out


def duplicate_pairs(paths: list[Path]) -> list[tuple[str, int, str, int]]:
    """Pairs of regions sharing a run of ``WINDOW`` normalized lines, one row per pair of
    files and region (overlapping windows of one run merged)."""
    seen: dict[str, list[tuple[Path, int, int]]] = defaultdict(list)
    for p in paths:
        lines = normalized(p)
        for k in range(len(lines) - WINDOW + 1):
            key = hashlib.sha1("\n".join(s for _, s in lines[k : k + WINDOW]).encode()).hexdigest()
            seen[key].append((p, k, lines[k][0]))
    runs: dict[tuple[Path, Path], list[tuple[int, int, int, int]]] = defaultdict(list)
    for places in seen.values():
        if len(places) < 2 or len(places) > 8:  # a shape in more than 8 places is boilerplate
            continue
        for i, (pa, ka, la) in enumerate(places):
            for pb, kb, lb in places[i + 1 :]:
                if pa == pb and abs(ka - kb) < WINDOW:
                    continue
                runs[(pa, pb)].append((ka, kb, la, lb))
    rows = []
    for (pa, pb), ws in runs.items():
        ws.sort()
        last = None
        for ka, kb, la, lb in ws:
            if last is None or not (ka == last[0] + 1 and kb == last[1] + 1):
                rows.append((str(pa.relative_to(ROOT)), la, str(pb.relative_to(ROOT)), lb))
            last = (ka, kb)
    return rows


def reached(start: str, edges: set[tuple[str, str]]) -> set[str]:
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    todo, out = [start], {start}
    while todo:
        for b in graph[todo.pop()]:
            if b not in out and b != "pdsweep":
                out.add(b)
                todo.append(b)
    return out


def measure() -> dict[str, list[str]]:
    layers = _layers()
    paths = sources()
    rel = {p: str(p.relative_to(ROOT)) for p in paths}
    found: dict[str, list[str]] = {k: [] for k in GOALS}
    found["lazy in-package imports"] = []
    for p in paths:
        n = len(p.read_text().splitlines())
        if n > 500:
            found["files over 500 lines"].append(f"{rel[p]} ({n})")
        for f in functions(p):
            length = (f.end_lineno or f.lineno) - (f.decorator_list[0].lineno if f.decorator_list else f.lineno) + 1
            if length > 80:
                found["functions over 80 lines"].append(f"{rel[p]}:{f.lineno} {f.name} ({length})")
            if n_params(f) >= 8:
                found["functions with >= 8 parameters"].append(f"{rel[p]}:{f.lineno} {f.name} ({n_params(f)})")
        if k := lazy_imports(p):
            found["lazy in-package imports"].append(f"{rel[p]} ({k})")
    found["duplicate pairs"] = [f"{a}:{la} ~ {b}:{lb}" for a, la, b, lb in duplicate_pairs(paths)]
    found["import cycles"] = [" -> ".join(c) for c in layers.cycles()]
    found["upward imports"] = [f"{a} -> {b}" for a, b in sorted(layers.upward_edges())]
    found["modules judge.gate reaches"] = sorted(reached("judge.gate", layers.edges()) - {"judge.gate"})
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when a figure misses its goal")
    ap.add_argument("--list", action="store_true", help="list what each figure counts")
    args = ap.parse_args(argv)
    found = measure()
    lines = sum(len(p.read_text().splitlines()) for p in sources())
    print(f"pdsweep/: {len(sources())} modules, {lines} lines")
    missed = []
    for name, items in found.items():
        goal = GOALS.get(name)
        mark = "" if goal is None else (" ok" if len(items) <= goal else f" MISSES goal <= {goal}")
        if goal is not None and len(items) > goal:
            missed.append(name)
        if name == "lazy in-package imports":
            print(f"{name}: {sum(int(i.rsplit('(', 1)[1][:-1]) for i in items)} in {len(items)} modules")
        else:
            print(f"{name}: {len(items)}{mark}")
        if args.list:
            print("".join(f"  {i}\n" for i in items), end="")
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
