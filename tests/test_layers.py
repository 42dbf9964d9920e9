"""The package's layering: every import inside ``pdsweep/`` (top-level, lazy in a
function, or type-only under ``TYPE_CHECKING``) goes down the module order written in
``pdsweep/__init__.py``, never up it. Parsed with ``ast``; nothing is imported."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pdsweep

PKG = Path(pdsweep.__file__).resolve().parent

# Upward edges from or into the modules issue 13 (instance reuse) is rewriting; each is
# to remove after the issue-13 merge. The test fails when one of them no longer exists,
# so this list can only shrink.
KNOWN_BACK_EDGES = {
    ("deploy", "metrics"),  # deploy.py scrapes /metrics for readiness: move the scrape below deploy
}


def module_order() -> list[str]:
    """Module names (``plan``, ``xfer.bench``; the package itself is ``pdsweep``) in the
    order of the package docstring's stage lines (``    name: mod mod ...``)."""
    lines = re.findall(r"^    [a-z-]+:\s+(.+)$", pdsweep.__doc__ or "", re.M)
    return [m for line in lines for m in line.split()]


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or "pdsweep"


def imports_of(path: Path) -> set[str]:
    """pdsweep modules ``path`` imports, as :func:`module_name` spells them."""
    me = module_name(path)
    package = me.split(".") if path.name == "__init__.py" and me != "pdsweep" else me.split(".")[:-1]
    known = {module_name(p) for p in PKG.rglob("*.py")}
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
            for a in node.names:  # `from . import rules` names a module; `__version__` is the package's
                sub = a.name if name == "pdsweep" else f"{name}.{a.name}"
                out.add(sub if sub in known else name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "pdsweep" or a.name.startswith("pdsweep."):
                    out.add(a.name.removeprefix("pdsweep.") if a.name != "pdsweep" else "pdsweep")
    out.discard(me)
    return out


def edges() -> set[tuple[str, str]]:
    return {(module_name(p), dep) for p in PKG.rglob("*.py") for dep in imports_of(p)}


def upward_edges() -> set[tuple[str, str]]:
    rank = {m: i for i, m in enumerate(module_order())}
    return {(a, b) for a, b in edges() if rank[b] > rank[a]}


def test_the_order_lists_every_module_once() -> None:
    order = module_order()
    modules = {module_name(p) for p in PKG.rglob("*.py")}
    assert len(order) == len(set(order)), [m for m in order if order.count(m) > 1]
    assert set(order) == modules, {"not in the order": sorted(modules - set(order)),
                                   "no such module": sorted(set(order) - modules)}


def test_no_import_goes_up_the_pipeline() -> None:
    assert upward_edges() - KNOWN_BACK_EDGES == set()


def test_known_back_edges_still_exist() -> None:
    """A listed edge that is gone must leave the list (it only shrinks)."""
    assert KNOWN_BACK_EDGES - upward_edges() == set()


def test_the_import_parser_sees_lazy_type_only_and_package_imports() -> None:
    deps = {a: {b for x, b in edges() if x == a} for a in ("rules", "xfer.readplan", "cli", "run", "launchers")}
    assert "cell" in deps["rules"]  # under TYPE_CHECKING
    assert deps["xfer.readplan"] == {"topology", "xfer.geometry"}  # `from ..topology`, `from .geometry`
    assert {"gate", "render", "compare", "run"} <= deps["cli"]  # imported inside functions
    assert "pdsweep" in deps["run"]  # `from . import __version__`
    assert "launchers.slurm" in deps["launchers"]  # `from .slurm import` inside a package
