#!/usr/bin/env python3
"""Print the structure figures issues 34 and 55 set goals for, measured from the code (``ast``;
nothing is imported or run), and exit 1 when one misses its goal (``--check``).

Figures (``pdsweep/`` only; tests, fixtures and generated files are not counted):

* files over 500 lines; functions over 80 lines (decorators included);
* functions with 8 or more parameters (``self``/``cls`` not counted);
* in-function pdsweep imports (docs/contributing.md "Imports": only where the module brings a
  heavy or optional third-party one);
* package folders named like test folders (``spec``, ``specs``, ``test``, ``tests``: tools that
  follow the RSpec or pytest conventions leave them out of coverage and structure pictures);
* ``DTYPE_BYTES`` definitions (one table of dtype sizes, ``core/dtypes.py``);
* module pairs sharing a basename and a topic: two modules of one basename in different
  subpackages, unless one is the ``commands/`` front of the command of that name or the pair is in
  :data:`BASENAME_TOPICS` with the two topics it tells apart (a pair that shares a topic, e.g. the
  evidence in ``measure/`` and the rule in ``judge/``, is one module or two names);
* import cycles and upward imports (the rules of tests/test_layers.py, whose functions this reuses);
* duplicate pairs: two places sharing a run of 6 or more normalized lines (blank lines, comments,
  imports and lone punctuation dropped, white space folded), counted once per pair of regions;
* the modules the call graph of ``judge.gate.gate_run`` enters (the "rooms" a reader of it walks
  through): from its body, every call of a name that resolves to a pdsweep function, class (its
  ``__init__``/``__post_init__``) or method (``self.m()``, ``Class.m()``, ``module.f()``), followed
  transitively; a call through a value of unknown type (``check.fails(...)``) is not followed.

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
sys.path.insert(0, str(ROOT))  # tests/test_layers.py imports pdsweep: runnable from any python in the repo
PKG = ROOT / "pdsweep"
GOALS = {
    "files over 500 lines": 0,
    "functions over 80 lines": 0,
    "functions with >= 8 parameters": 5,
    "duplicate pairs": 5,
    "import cycles": 0,
    "upward imports": 0,
    "modules gate_run's call graph enters": 8,
    "in-function pdsweep imports": 30,
    "package folders named like test folders": 0,
    "DTYPE_BYTES definitions": 1,
    "module pairs sharing a basename and a topic": 0,
}
TEST_FOLDER_NAMES = ("spec", "specs", "test", "tests")
# Module pairs of one basename that tell different topics apart (the subpackage says which).
BASENAME_TOPICS = {
    "cell": "plan/cell.py: what a cell is (Cell, its id); run/cell.py: running one cell",
    "phases": "sweepfile/phases.py: the phases' YAML schema; measure/phases.py: measuring them",
    "shards": "plan/shards.py: cutting a sweep into n jobs; results/shards.py: their n run directories read as one",
    "sweep": "sweepfile/sweep.py: loading a sweep file; run/sweep.py: the sweep loop",
}
WINDOW = 6


def _layers():
    spec = importlib.util.spec_from_file_location("_layers", ROOT / "tests" / "test_layers.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def sources(pkg: Path = PKG) -> list[Path]:
    return sorted(pkg.rglob("*.py"))


def functions(path: Path) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    tree = ast.parse(path.read_text(), str(path))
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def n_params(f: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = f.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    return len([n for n in names if n not in ("self", "cls")]) + bool(a.vararg) + bool(a.kwarg)


def lazy_import_lines(path: Path) -> list[int]:
    """Line numbers of the pdsweep imports inside a function of ``path``."""
    out = []
    for f in functions(path):
        for n in ast.walk(f):
            if isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").startswith("pdsweep")):
                out.append(n.lineno)
            elif isinstance(n, ast.Import) and any(a.name.startswith("pdsweep") for a in n.names):
                out.append(n.lineno)
    return sorted(set(out))


def lazy_imports(path: Path) -> int:
    return len(lazy_import_lines(path))


def test_folders(pkg: Path = PKG) -> list[str]:
    """Package folders named like a test folder (:data:`TEST_FOLDER_NAMES`)."""
    return sorted(str(d.relative_to(pkg.parent)) for d in pkg.rglob("*") if d.is_dir() and d.name in TEST_FOLDER_NAMES)


def definitions(paths: list[Path], name: str) -> list[str]:
    """``file:line`` of every module-level or nested assignment to ``name``."""
    out = []
    for p in paths:
        for n in ast.walk(ast.parse(p.read_text(), str(p))):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                out.append(f"{p.relative_to(ROOT)}:{n.lineno}")
    return out


def basename_pairs(paths: list[Path], pkg: Path = PKG) -> list[tuple[str, str, str]]:
    """``(basename, module a, module b)`` for two modules of one basename (``__init__`` aside)
    in different folders, except a ``commands/`` module (the front of the command it is named
    after); sorted."""
    by_name: dict[str, list[str]] = defaultdict(list)
    for p in paths:
        rel = p.relative_to(pkg)
        if p.name != "__init__.py" and rel.parts[0] != "commands":
            by_name[p.stem].append(str(rel))
    return sorted((n, a, b) for n, ms in by_name.items() for i, a in enumerate(sorted(ms)) for b in sorted(ms)[i + 1 :])


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


Func = tuple[str, str]  # (module, qualified name: "f" or "Class.m")


class _Module:
    """One pdsweep module's top-level functions, classes (methods, base names) and the names
    its imports bind (anywhere in the file: lazy imports included) as (module, attribute)."""

    def __init__(self, name: str, tree: ast.Module, known: set[str], is_pkg: bool) -> None:
        self.name = name
        self.funcs: dict[str, ast.AST] = {}
        self.classes: dict[str, tuple[dict[str, ast.AST], list[str]]] = {}
        self.binds: dict[str, tuple[str, str | None]] = {}
        for n in tree.body:
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
                self.funcs[n.name] = n
            elif isinstance(n, ast.ClassDef):
                methods = {m.name: m for m in n.body if isinstance(m, ast.FunctionDef | ast.AsyncFunctionDef)}
                self.classes[n.name] = (methods, [b.id for b in n.bases if isinstance(b, ast.Name)])
        pkg = name.split(".") if is_pkg else name.split(".")[:-1]
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom):
                if n.level:
                    base = ".".join([*pkg[: len(pkg) - n.level + 1], *([n.module] if n.module else [])])
                elif n.module and n.module.startswith("pdsweep."):
                    base = n.module.removeprefix("pdsweep.")
                else:
                    continue
                for a in n.names:
                    sub = f"{base}.{a.name}"
                    self.binds[a.asname or a.name] = (sub, None) if sub in known else (base, a.name)
            elif isinstance(n, ast.Import):
                for a in n.names:
                    if a.name.startswith("pdsweep.") and a.asname:
                        self.binds[a.asname] = (a.name.removeprefix("pdsweep."), None)


def _modules(pkg: Path) -> dict[str, _Module]:
    layers = _layers()
    paths = {layers.module_name(p, pkg): p for p in sources(pkg)}
    known = set(paths)
    return {m: _Module(m, ast.parse(p.read_text(), str(p)), known, p.name == "__init__.py") for m, p in paths.items()}


def _lookup(mods: dict[str, _Module], module: str, name: str, depth: int = 0) -> list[Func]:
    """What calling ``name`` of ``module`` runs: a function, a class's ``__init__`` /
    ``__post_init__``, or (through an import, re-exports followed) the same in another module."""
    m = mods.get(module)
    if m is None or depth > 8:
        return []
    if name in m.funcs:
        return [(module, name)]
    if name in m.classes:
        return [(module, f"{name}.{k}") for k in ("__init__", "__post_init__") if k in m.classes[name][0]]
    if name in m.binds:
        target, attr = m.binds[name]
        return _lookup(mods, target, attr, depth + 1) if attr else []
    return []


def _method(mods: dict[str, _Module], module: str, cls: str, name: str, depth: int = 0) -> list[Func]:
    """``cls.name`` of ``module``, searched up the class's bases (by name, imports followed)."""
    m = mods.get(module)
    if m is None or depth > 8:
        return []
    if cls in m.binds and m.binds[cls][1]:
        return _method(mods, m.binds[cls][0], m.binds[cls][1] or "", name, depth + 1)
    if cls not in m.classes:
        return []
    methods, bases = m.classes[cls]
    if name in methods:
        return [(module, f"{cls}.{name}")]
    return next((f for b in bases if (f := _method(mods, module, b, name, depth + 1))), [])


def _callees(mods: dict[str, _Module], fn: Func) -> list[Func]:
    module, qual = fn
    m = mods[module]
    cls, _, name = qual.rpartition(".")
    node = m.classes[cls][0][name] if cls else m.funcs[name]
    out: list[Func] = []
    for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
        f = call.func
        if isinstance(f, ast.Name):
            out += _lookup(mods, module, f.id)
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
            owner = f.value.id
            if owner in ("self", "cls") and cls:
                out += _method(mods, module, cls, f.attr)
            elif owner in m.classes or (owner in m.binds and m.binds[owner][1]):
                out += _method(mods, module, owner, f.attr)
            elif owner in m.binds:  # a module
                out += _lookup(mods, m.binds[owner][0], f.attr)
    return out


def call_graph(module: str, func: str, pkg: Path = PKG) -> set[Func]:
    """Every pdsweep function or method the call graph of ``module.func`` reaches (itself
    included), as (module, qualified name); only calls whose target resolves statically."""
    mods = _modules(pkg)
    todo, seen = [(module, func)], {(module, func)}
    while todo:
        for g in _callees(mods, todo.pop()):
            if g not in seen:
                seen.add(g)
                todo.append(g)
    return seen


def measure() -> dict[str, list[str]]:
    layers = _layers()
    paths = sources()
    rel = {p: str(p.relative_to(ROOT)) for p in paths}
    found: dict[str, list[str]] = {k: [] for k in GOALS}
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
        found["in-function pdsweep imports"] += [f"{rel[p]}:{line}" for line in lazy_import_lines(p)]
    found["duplicate pairs"] = [f"{a}:{la} ~ {b}:{lb}" for a, la, b, lb in duplicate_pairs(paths)]
    found["import cycles"] = [" -> ".join(c) for c in layers.cycles()]
    found["upward imports"] = [f"{a} -> {b}" for a, b in sorted(layers.upward_edges())]
    found["modules gate_run's call graph enters"] = sorted({m for m, _ in call_graph("judge.gate", "gate_run")})
    found["package folders named like test folders"] = test_folders()
    found["DTYPE_BYTES definitions"] = definitions(paths, "DTYPE_BYTES")
    pairs = basename_pairs(paths)
    found["module pairs sharing a basename and a topic"] = [
        f"{a} ~ {b}" for n, a, b in pairs if n not in BASENAME_TOPICS
    ]
    found["module pairs of one basename, topics told apart"] = [
        f"{a} ~ {b} ({BASENAME_TOPICS[n]})" for n, a, b in pairs if n in BASENAME_TOPICS
    ]
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
        print(f"{name}: {len(items)}{mark}")
        if args.list:
            print("".join(f"  {i}\n" for i in items), end="")
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
