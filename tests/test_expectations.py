"""Expectations that know the build (issue 11, item 3): fix probes found in the installed
vLLM 0.32.0 and in its #49297-unfixed copy, version ranges, and how plan and run resolve
an ``expect: fail`` that names builds."""

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from pdsweep.builds import fixprobes
from pdsweep.builds.fixprobes import FIXES, probe_python, probe_site
from pdsweep.builds.unfix import EDITS
from pdsweep.builds.vllmsite import vllm_site
from pdsweep.core.errors import UserError
from pdsweep.plan.expand import Cell, expand
from pdsweep.sweepfile.expectations import applies, resolve
from pdsweep.sweepfile.sweep import load_sweep

REPO = Path(__file__).resolve().parent.parent
CELL = Cell(
    model="m",
    prefill_tp=2,
    decode_tp=1,
    prefill_block_size=16,
    decode_block_size=16,
    num_prefill=1,
    num_decode=1,
    kv_buffer_device="cpu",
    build="unfixed",
    expect_fail=True,
    expect_reason="r",
)


def test_every_fix_probe_is_found_in_the_installed_vllm():
    version, fixes = probe_python(sys.executable)
    assert version.startswith("0.32.0")
    assert fixes == {
        "vllm#49297": True,
        "vllm#49762": True,
        "vllm#45357": True,
        "vllm#48481": True,
        "vllm#55306": False,  # open upstream: 0.32.0 still scales B/C by the TP ratio
        "vllm:nixl_num_notifications_after_expiry": True,  # nixl/stats.py registers the counter
        "vllm#55854": True,  # failed transfers include handshake and notification failures
        "NixlPushConnectorWorker._xfer_blocks": True,  # pdsweep's push WRITE log can hook it
    }


def test_unfixed_copy_lacks_49297_only(tmp_path):
    site, version = vllm_site(sys.executable)
    for p in {f.file for f in FIXES.values()}:
        (tmp_path / p).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / p).write_text((site / p).read_text())
    for e in EDITS["0.32.0"]:  # what `make baseline-env` does to its copy
        f = tmp_path / e.file
        f.write_text(f.read_text().replace(e.old, e.new))
    assert probe_site(tmp_path) == {
        "vllm#49297": False,
        "vllm#49762": True,
        "vllm#45357": True,
        "vllm#48481": True,
        "vllm#55306": False,
        "vllm:nixl_num_notifications_after_expiry": True,
        "vllm#55854": True,
        "NixlPushConnectorWorker._xfer_blocks": True,
    }
    conv = tmp_path / FIXES["vllm#55306"].file  # the fix's shape: the pre-fix line gone
    conv.write_text(conv.read_text().replace("remote_base += size * tp_ratio", "remote_base += remote_size"))
    assert probe_site(tmp_path)["vllm#55306"] is True
    (tmp_path / fixprobes.SCHEDULER).unlink()
    assert probe_site(tmp_path)["vllm#45357"] is None  # unreadable: unknown, never "fixed"


def test_expectation_applies_by_version_range_and_missing_fix():
    c = replace(CELL, expect_vllm="<0.33", expect_without=("vllm#49297", "vllm#49762"))
    assert applies(c, "0.32.0+cpu", {"vllm#49297": False, "vllm#49762": True}) == (
        True,
        "vLLM 0.32.0+cpu in <0.33; build unfixed lacks vllm#49297",
    )
    assert applies(c, "0.33.1", {"vllm#49297": False}) == (False, "build unfixed has vLLM 0.33.1, outside <0.33")
    assert applies(c, "0.32.0", {"vllm#49297": True, "vllm#49762": True}) == (
        False,
        "build unfixed contains vllm#49297, vllm#49762",
    )
    assert applies(c, "0.32.0", {"vllm#49297": True, "vllm#49762": None})[0] is None
    assert applies(replace(c, expect_without=()), None, {})[0] is None
    fixed = resolve(c, "0.32.0", {"vllm#49297": True, "vllm#49762": True})
    assert (fixed.expect_fail, fixed.expect_note) == (
        False,
        "does not apply: build unfixed contains vllm#49297, vllm#49762",
    )
    assert resolve(CELL, None, {}) is CELL  # an unconditional expectation is left alone


SWEEP = f"""name: t
platform: cpu
builds:
  fixed: {{}}
  unfixed: {{python: {sys.executable}}}
defaults: {{prefill_block_size: 32, decode_block_size: 32}}
matrix:
  model: [tiny-mla-mamba2]
  tp: [p2d1]
  build: [fixed, unfixed]
  include:
    - {{build: unfixed, expect: fail, without: [vllm#49297], match: 'assert len', reason: "PR 49297 undone"}}
"""


def _plan(tmp_path, body=SWEEP):
    (tmp_path / "models.yaml").write_text((REPO / "sweeps" / "models.yaml").read_text())
    (tmp_path / "s.yaml").write_text(body)
    return expand(load_sweep(tmp_path / "s.yaml"))


def test_plan_resolves_the_expectation_per_build(tmp_path, monkeypatch):
    # both builds are this interpreter's vLLM 0.32.0: #49297 is in, the expectation does not apply
    real = fixprobes.probe_python
    plan = _plan(tmp_path)
    (unfixed,) = [c for c in plan.pd_cells if c.build == "unfixed"]
    assert (unfixed.expect_fail, unfixed.expect_note) == (False, "does not apply: build unfixed contains vllm#49297")
    assert unfixed.expect_without == ("vllm#49297",) and unfixed.expect_match == "assert len"
    monkeypatch.setattr(fixprobes, "probe_python", lambda python: (real(python)[0], {"vllm#49297": False}))
    (unfixed,) = [c for c in _plan(tmp_path).pd_cells if c.build == "unfixed"]
    assert (unfixed.expect_fail, unfixed.expect_note) == (True, "applies: build unfixed lacks vllm#49297")


def test_mission_sweep_encodes_the_build_aware_expectations():
    plan = expand(load_sweep(REPO / "sweeps" / "hybrid-mla-mamba.yaml"))
    cells = {c.id: c for c in plan.pd_cells}
    kimi44 = cells["kimi-linear.p4d4.b128-128.fixed"]
    assert kimi44.expect_without == ("vllm#49762",) and not kimi44.expect_fail  # the installed build has #49762
    assert cells["kimi-linear.p2d1.b128-128.unfixed"].expect_without == ("vllm#49297",)
    assert cells["qwen3.5-0.8b.p2d1.b128-128.fixed"].expect_without == ("vllm#45357", "vllm#48481")
    assert not cells["qwen3.5-0.8b.p2d1.b128-128.fixed"].expect_fail
    assert "kimi-linear.p4d4.b128-128.unfixed" in cells


@pytest.mark.parametrize(
    "entry,msg",
    [
        (
            "{build: unfixed, expect: fail, reason: r, without: [vllm#1]}",
            "unknown fix probe(s) ['vllm#1'] (allowed: vllm#49297",
        ),
        ("{build: unfixed, expect: fail, reason: r, vllm: 'about 0.32'}", "not a PEP 440 version range"),
        ("{build: unfixed, without: [vllm#49297]}", "'without' says for which builds a failure is expected: it needs"),
    ],
)
def test_bad_build_conditions_are_user_errors(tmp_path, entry, msg):
    with pytest.raises(UserError) as e:
        _plan(
            tmp_path,
            SWEEP.replace(
                """{build: unfixed, expect: fail, without: [vllm#49297], match: 'assert len', reason: "PR 49297 undone"}""",
                entry,
            ),
        )
    assert msg in str(e.value)
