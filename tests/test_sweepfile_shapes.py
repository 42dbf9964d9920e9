"""The shapes table (issue 38): docs/bug-shapes.yaml lists each reported PD failure shape with its
upstream references and what covers it; docs/bug-shapes.md is rendered from it, and every
``covered_by`` entry must exist, so a row can never point at a cell or rule that is gone."""

from pathlib import Path
from typing import get_args

import pytest

from pdsweep.core.errors import UserError
from pdsweep.judge.gate import checks_for
from pdsweep.plan.expand import expand
from pdsweep.plan.rules import RULES
from pdsweep.sweepfile.gatespec import GateSpec
from pdsweep.sweepfile.guards import REFUSED_FLAGS
from pdsweep.sweepfile.phases import WorkloadSpec
from pdsweep.sweepfile.shapes import SHAPES_FILE, Cover, load_shapes, render
from pdsweep.sweepfile.sweep import load_sweep

REPO = Path(__file__).resolve().parent.parent


def _missing(shapes) -> list[str]:
    """Every covered_by entry that does not exist, as 'shape: kind target'."""
    checks = {c.name for c in checks_for(GateSpec(transports=["cma"]), bench=True, load_answers=True)}
    workloads = set(get_args(WorkloadSpec.model_fields["name"].annotation))
    plans: dict[str, set[str]] = {}
    out = []
    for s in shapes:
        for c in s.covered_by:
            if c.kind == "cell":
                if c.sweep not in plans:
                    plans[c.sweep] = {x.id for x in expand(load_sweep(REPO / c.sweep)).cells}
                ok = c.cell in plans[c.sweep]
            else:
                ok = c.target in {"rule": RULES, "check": checks, "workload": workloads, "flag": REFUSED_FLAGS}[c.kind]
            if not ok:
                out.append(f"{s.id}: {c.kind} {c.target}")
    return out


def test_the_five_shapes_of_issue_38_each_point_at_something_that_exists():
    shapes = load_shapes()
    assert [s.id for s in shapes] == [
        "stale-read-after-lease-expiry",
        "mamba2-ngroups1-decode-tp-larger",
        "chunk-boundary-read",
        "all-transfers-failed-reported-success",
        "pp-prefill-push",
    ]
    assert _missing(shapes) == []
    # a row pointing at a cell or rule that is gone is caught
    bad = shapes[0].model_copy(update={"covered_by": [Cover(cell="tiny-llama.p9d9.gone", sweep="sweeps/drills.yaml")]})
    bad2 = shapes[1].model_copy(update={"covered_by": [Cover(rule="no-such-rule")]})
    assert _missing([bad, bad2]) == [
        "stale-read-after-lease-expiry: cell tiny-llama.p9d9.gone",
        "mamba2-ngroups1-decode-tp-larger: rule no-such-rule",
    ]


def test_docs_page_is_rendered_from_the_data():
    page = (REPO / "docs" / "bug-shapes.md").read_text()
    assert page == render(load_shapes(SHAPES_FILE)), (
        "run: PYTHONPATH=. python -m pdsweep.sweepfile.shapes > docs/bug-shapes.md"
    )


def test_bad_shapes_file_names_file_and_field(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("shapes:\n  - {id: x, title: t, symptom: s, upstream: [u], covered_by: [{rule: a, check: b}]}\n")
    with pytest.raises(UserError, match=r"s\.yaml: shapes\.0\.covered_by\.0: Value error, give exactly one of cell"):
        load_shapes(p)
