"""The table of reported PD failure shapes (``docs/bug-shapes.yaml``) and its page
(``docs/bug-shapes.md``): each shape with its upstream references and what in pdsweep covers
it. ``python -m pdsweep.sweepfile.shapes [PATH]`` prints the page; tests/test_sweepfile_shapes.py checks
that the committed page matches and that every ``covered_by`` entry exists."""

from __future__ import annotations

import sys
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pdsweep.core.errors import UserError
from pdsweep.core.paths import REPO

SHAPES_FILE = REPO / "docs" / "bug-shapes.yaml"
KINDS = ("cell", "rule", "check", "workload", "flag")  # what a covered_by entry points at


class Cover(BaseModel):
    """One thing that covers a shape: exactly one of ``cell`` (with its ``sweep``), ``rule``
    (pdsweep.plan.rules.RULES), ``check`` (a gate check name), ``workload``, ``flag`` (a
    refused vllm serve flag, pdsweep.sweepfile.guards.REFUSED_FLAGS)."""

    model_config = ConfigDict(extra="forbid")
    cell: str | None = None
    sweep: str | None = None
    rule: str | None = None
    check: str | None = None
    workload: str | None = None
    flag: str | None = None
    note: str = ""

    @model_validator(mode="after")
    def _one(self) -> Cover:
        set_ = [k for k in KINDS if getattr(self, k)]
        if len(set_) != 1:
            raise ValueError(f"give exactly one of {', '.join(KINDS)} (got {set_ or 'none'})")
        if (self.cell is None) != (self.sweep is None):
            raise ValueError("cell and sweep go together")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k))

    @property
    def target(self) -> str:
        return str(getattr(self, self.kind))


class Shape(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(pattern=r"^[a-z0-9-]+$")
    title: str
    symptom: str
    upstream: list[str] = Field(min_length=1)
    covered_by: list[Cover] = Field(min_length=1)


class Shapes(BaseModel):
    model_config = ConfigDict(extra="forbid")
    shapes: list[Shape] = Field(min_length=1)


def load_shapes(path: str | Path = SHAPES_FILE) -> list[Shape]:
    """The shapes of ``path``. Raises UserError naming the file and the field for a bad file."""
    import yaml

    path = Path(path)
    try:
        return Shapes.model_validate(yaml.safe_load(path.read_text())).shapes
    except OSError as e:
        raise UserError(f"{path}: cannot read: {e}") from None
    except yaml.YAMLError as e:
        raise UserError(f"{path}: not YAML: {e}") from None
    except ValidationError as e:
        errs = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
        raise UserError(f"{path}: {errs}") from None


def render(shapes: list[Shape]) -> str:
    """docs/bug-shapes.md: one section per shape, then a summary table."""
    out = [
        "# Reported PD failure shapes",
        "",
        "Failures users reported since August 2026, several of which answer HTTP 200 with wrong text, each",
        "with its upstream references and what in pdsweep covers it. Generated from",
        "`docs/bug-shapes.yaml` (`PYTHONPATH=. python -m pdsweep.sweepfile.shapes > docs/bug-shapes.md`);",
        "tests/test_sweepfile_shapes.py checks that this page matches and that every cell, rule, check, workload",
        "and flag named below exists. The drill cells live in `sweeps/drills.yaml` (run by `make test-all`",
        "through tests/test_drills_real.py, or `pdsweep run sweeps/drills.yaml`).",
        "",
        "| shape | covered by |",
        "|---|---|",
    ]
    for s in shapes:
        out.append(f"| [{s.id}](#{s.id}) | {', '.join(f'{c.kind} `{c.target}`' for c in s.covered_by)} |")
    for s in shapes:
        out += ["", f"## {s.id}", "", f"**{s.title}.** {s.symptom}.", "", "Upstream:", ""]
        out += [f"- {u}" for u in s.upstream]
        out += ["", "Covered by:", ""]
        for c in s.covered_by:
            where = f" in `{c.sweep}`" if c.sweep else ""
            out.append(f"- {c.kind} `{c.target}`{where}" + (f": {c.note}" if c.note else ""))
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render(load_shapes(sys.argv[1] if len(sys.argv) > 1 else SHAPES_FILE)))
