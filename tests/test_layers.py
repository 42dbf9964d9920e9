"""The package's layering: every import inside ``pdsweep/`` (top-level, lazy in a
function, or type-only under ``TYPE_CHECKING``) stays in its own subpackage or goes down
the layer order written in ``pdsweep/__init__.py``, never up it, and no two modules import
each other in a cycle. Parsed with ``ast``; nothing is imported."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pdsweep

PKG = Path(pdsweep.__file__).resolve().parent


def layer_order() -> list[str]:
    """Subpackage and top-level module names from the docstring's ``layers:`` line."""
    m = re.search(r"^    layers:\s+(.+(?:\n            .+)*)$", pdsweep.__doc__ or "", re.M)
    assert m, "pdsweep/__init__.py has no '    layers: ...' line"
    return m.group(1).split()


def module_name(path: Path, pkg: Path = PKG) -> str:
    rel = path.relative_to(pkg).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or "pdsweep"


def layer_of(module: str) -> str:
    """``plan.rules`` -> ``plan``; ``cli`` -> ``cli``; the package itself -> ``pdsweep``."""
    return module.split(".")[0]


def imports_of(path: Path, pkg: Path = PKG) -> set[str]:
    """pdsweep modules ``path`` imports, as :func:`module_name` spells them."""
    me = module_name(path, pkg)
    package = me.split(".") if path.name == "__init__.py" and me != "pdsweep" else me.split(".")[:-1]
    if me == "pdsweep":
        package = []
    known = {module_name(p, pkg) for p in pkg.rglob("*.py")}
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                target = [*base, *(node.module.split(".") if node.module else [])]
            elif node.module and (node.module == "pdsweep" or node.module.startswith("pdsweep.")):
                target = node.module.split(".")[1:]
            else:
                continue
            name = ".".join(target) or "pdsweep"
            for a in node.names:  # `from pdsweep.plan import rules` names a module
                sub = a.name if name == "pdsweep" else f"{name}.{a.name}"
                out.add(sub if sub in known else name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "pdsweep" or a.name.startswith("pdsweep."):
                    out.add(a.name.removeprefix("pdsweep.") if a.name != "pdsweep" else "pdsweep")
    out.discard(me)
    return out


def edges(pkg: Path = PKG) -> set[tuple[str, str]]:
    return {(module_name(p, pkg), dep) for p in pkg.rglob("*.py") for dep in imports_of(p, pkg)}


def upward_edges(pkg: Path = PKG) -> set[tuple[str, str]]:
    rank = {name: i for i, name in enumerate(layer_order())}
    rank["pdsweep"] = -1  # the package (its __version__) is below everything
    return {(a, b) for a, b in edges(pkg) if layer_of(a) != layer_of(b) and rank[layer_of(b)] > rank[layer_of(a)]}


def cycles(pkg: Path = PKG) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges(pkg):
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_order_lists_every_layer_once() -> None:
    order = layer_order()
    layers = {layer_of(module_name(p)) for p in PKG.rglob("*.py")} - {"pdsweep"}
    assert len(order) == len(set(order)), [m for m in order if order.count(m) > 1]
    assert set(order) == layers, {
        "not in the order": sorted(layers - set(order)),
        "no such layer": sorted(set(order) - layers),
    }


def test_rendering_ranks_above_the_rules() -> None:
    """``report`` renders what ``judge`` decides: a judge module never imports a renderer."""
    order = layer_order()
    assert order.index("judge") < order.index("report") < order.index("history")
    assert not {(a, b) for a, b in edges() if layer_of(a) == "judge" and layer_of(b) == "report"}


def test_no_import_goes_up_the_pipeline() -> None:
    assert upward_edges() == set()


def test_no_import_cycle() -> None:
    assert cycles() == []


def test_top_level_holds_only_the_package_entry_points() -> None:
    """Everything but the CLI lives in a stage's subpackage."""
    assert sorted(p.name for p in PKG.glob("*.py")) == ["__init__.py", "__main__.py", "cli.py"]


def test_the_import_parser_sees_lazy_type_only_and_package_imports() -> None:
    deps = {
        a: {b for x, b in edges() if x == a}
        for a in ("plan.rules", "plan.readplan", "commands.gate", "commands.run", "run.sweep", "deploy.launchers")
    }
    assert "plan.cell" in deps["plan.rules"]  # under TYPE_CHECKING
    assert deps["plan.readplan"] == {"plan.topology", "plan.geometry", "core.logscan"}
    assert {"judge.gate", "report.render"} <= deps["commands.gate"]  # inside functions
    assert "run.sweep" in deps["commands.run"]
    assert "pdsweep" in deps["run.sweep"]  # `from pdsweep import __version__`
    assert "deploy.launchers.slurm" in deps["deploy.launchers"]  # lazily, inside make_launcher


def test_the_checker_catches_an_upward_import_and_a_cycle(tmp_path: Path) -> None:
    """The checks are not vacuous: a planted upward import and a planted cycle are seen."""
    import shutil

    fake = tmp_path / "pdsweep"
    shutil.copytree(PKG, fake, ignore=shutil.ignore_patterns("__pycache__"))
    with (fake / "core" / "stats.py").open("a") as f:
        f.write("\nfrom pdsweep.judge import gate\n")
    with (fake / "plan" / "topology.py").open("a") as f:
        f.write("\nfrom pdsweep.plan import rules\n")
    assert ("core.stats", "judge.gate") in upward_edges(fake)
    assert any({"plan.topology", "plan.rules"} <= set(c) for c in cycles(fake))
    assert upward_edges() == set() and cycles() == []
