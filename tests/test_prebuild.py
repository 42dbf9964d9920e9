"""pdsweep.run.prebuild: every tiny checkpoint a run serves is built once, in cell order, before
any instance starts; one that cannot be built is reported, not raised (its cells fail with it)."""

from __future__ import annotations

from pathlib import Path

from pdsweep.core.errors import UserError
from pdsweep.plan.expand import expand
from pdsweep.run import prebuild, runplan
from pdsweep.run import sweep as run_sweep_mod
from pdsweep.run.context import RunOptions
from pdsweep.sweepfile.sweep import load_sweep

SMOKE = load_sweep(Path(__file__).resolve().parent.parent / "sweeps" / "cpu-smoke.yaml")


def test_each_tiny_model_is_built_once_in_cell_order(monkeypatch, capsys):
    cells = expand(SMOKE).cells
    calls = []

    def fake_checkpoint_dir(name, model, cache_dir=None, create=True):
        calls.append((name, create))
        if name == "tiny-mla":
            raise UserError("models.yaml: tiny-mla: cannot train")
        return f"/cache/{name}"

    monkeypatch.setattr(prebuild, "checkpoint_dir", fake_checkpoint_dir)
    built, failed = prebuild.prebuild_checkpoints(SMOKE, cells)
    tiny = [m for m in dict.fromkeys(c.model for c in cells) if SMOKE.catalogue.models[m].tiny is not None]
    assert calls == [(m, True) for m in tiny] and len(tiny) >= 3  # built (create=True), each once
    assert failed == {"tiny-mla": "models.yaml: tiny-mla: cannot train"}
    assert built == {m: f"/cache/{m}" for m in tiny if m != "tiny-mla"}
    err = capsys.readouterr().err
    assert "checkpoint tiny-mla: cannot be built: models.yaml: tiny-mla: cannot train" in err
    assert f"checkpoint {tiny[0]}: /cache/{tiny[0]} (" in err


def test_planning_names_a_tiny_checkpoint_and_never_builds_it(monkeypatch, tmp_path):
    """plan.instance.model_path (dry run, plan, preflight) only names the directory; building it
    (minutes of training for a trained kind) is the run's, prebuild.checkpoint_path."""
    from pdsweep.plan import instance

    asked = []
    real = instance.checkpoint_dir
    monkeypatch.setattr(
        instance, "checkpoint_dir", lambda *a, **k: asked.append(k.get("create", True)) or real(*a, **k)
    )
    model = SMOKE.catalogue.models["tiny-llama"]
    path = Path(instance.model_path(model, "tiny-llama", tmp_path))
    assert asked == [False], f"model_path asked checkpoint_dir for create={asked}"
    assert path.parent == tmp_path and path.name.startswith("tiny-llama-") and not path.exists()


def test_run_sweep_builds_checkpoints_before_any_instance(monkeypatch):
    """run_sweep calls the prebuild before it plans instances or starts any cell."""
    order = []
    monkeypatch.setattr(run_sweep_mod, "prebuild_checkpoints", lambda ls, cells: order.append("prebuild") or ({}, {}))
    monkeypatch.setattr(runplan, "_specs", lambda *a: order.append("plan") or [])
    for name in run_sweep_mod.EXECUTORS:
        monkeypatch.setitem(run_sweep_mod.EXECUTORS, name, lambda *a: order.append("cells"))
    monkeypatch.setattr(run_sweep_mod, "build_info", lambda ls, b: {})
    monkeypatch.setattr(run_sweep_mod, "judge_run", lambda *a: None)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        opts = RunOptions(out=Path(d) / "run", quiet=True)
        run_sweep_mod.run_sweep(SMOKE.path, opts)
    assert order[0] == "prebuild" and order[-1] == "cells" and "plan" in order
