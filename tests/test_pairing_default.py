"""Build pairs are measured paired by default (pdsweep.plan.pairing): the plan of a sweep with
two builds of one cell interleaves their load repeats unless the sweep opts out
(``bench.pair_builds: false``), and says what pairing adds to the makespan; a cell expected to
die at its first PD request pairs with nothing."""

from __future__ import annotations

import json
from types import SimpleNamespace as NS

from _fakerun import FAKE_PY, make_sweep
from _fakerun import tok as tok  # (the fixture)

from pdsweep.cli import main
from pdsweep.plan.pairing import pairing
from pdsweep.run.pairs import plan_pairs

A, B = "fake-gqa.p1d1.b16-16.fixed", "fake-gqa.p1d1.b16-16.unfixed"
BENCH = "bench: {enabled: true, num_prompts: 2, concurrencies: [1], check: false, repeats: 2%s}\n"


def _plan(tmp_path, tok, capsys, opt: str = "") -> tuple[dict, str]:
    """``pdsweep plan`` of a fake two-build sweep: (its json, its text)."""
    sweep = make_sweep(
        tmp_path,
        tok,
        matrix="  model: [fake-gqa]\n  tp: [p1d1]\n  build: [fixed, unfixed]\n",
        builds=f"  fixed: {{python: {FAKE_PY}}}\n  unfixed: {{python: {FAKE_PY}}}",
        extra="  reference: false\n" + BENCH % opt,
    )
    assert main(["plan", str(sweep), "--no-check-argv", "--format", "json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert main(["plan", str(sweep), "--no-check-argv"]) == 0
    return d, capsys.readouterr().out


def test_the_plan_of_a_two_build_sweep_interleaves_by_default(tmp_path, tok, capsys):
    d, text = _plan(tmp_path, tok, capsys)
    how = "the default (two builds of one cell; opt out with bench.pair_builds: false)"
    assert d["pairs"] == {"pairs": [{"a": A, "b": B}], "alone": {}, "how": how, "overhead_s": 41.0, "first_s": None}
    assert d["pairs_off"] is None
    assert d["makespan"]["pairs_s"] == 41.0
    assert d["makespan"]["s"] == round(d["schedule"]["makespan_s"] + 41.0, 1)
    assert f"build pairs: 1 measured paired, load repeats interleaved (ABBA), no extra repeats; {how}" in text
    assert f"  pair {A} (a) + {B} (b)\n" in text and "; + 41 s for the build pairs)" in text


def test_the_opt_out_plans_no_pair_and_says_so(tmp_path, tok, capsys):
    d, text = _plan(tmp_path, tok, capsys, ", pair_builds: false")
    assert d["pairs"] is None and d["makespan"]["pairs_s"] == 0.0
    assert d["makespan"]["s"] == round(d["schedule"]["makespan_s"], 1)
    assert d["pairs_off"] == "bench.pair_builds: false (the sweep's opt-out)"
    assert "build pairs: none measured paired (bench.pair_builds: false (the sweep's opt-out))" in text
    assert "  pair " not in text


def test_the_default_stays_off_where_the_load_phase_cannot_pair():
    bench = dict(pair_builds=None, enabled=True, target_ci=None, repeats=None)
    assert pairing(NS(**bench)) == (True, "the default (two builds of one cell; opt out with bench.pair_builds: false)")
    assert pairing(NS(**{**bench, "repeats": 1})) == (False, "default off: bench.repeats 1 (one pair has no interval)")
    assert pairing(NS(**{**bench, "enabled": False}))[1] == "default off: no load phase (bench.enabled: false)"
    assert pairing(NS(**{**bench, "target_ci": 0.05}))[0] is False


def test_a_partner_that_dies_at_its_first_request_pairs_with_nothing():
    """cpu-smoke's tiny-mla-mamba2 p2d1: the unfixed cell's decode dies on the pre-#49297 assert."""
    match = (
        r"AssertionError at vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_worker\.py:\d+ _read_blocks_for_req"
    )
    key = "m.p2d1.b128-128"
    fixed = NS(id=f"{key}.fixed", kind="pd", compare_key=key, build="fixed", expect_fail=False, expect_match=None)
    dies = NS(id=f"{key}.unfixed", kind="pd", compare_key=key, build="unfixed", expect_fail=True, expect_match=match)
    single = NS(id="n.p1d1.b32-32.fixed", kind="pd", compare_key="n.p1d1.b32-32", build="fixed", expect_fail=False)
    pairs, why = plan_pairs(["fixed", "unfixed"], [fixed, dies, single], [fixed, dies, single], explicit=False)
    no_load = "expected to die at its first PD request (the pre-#49297 single-read assert): no load phase to pair"
    assert pairs == [] and why == {fixed.id: f"partner {dies.id} {no_load}", dies.id: no_load}
