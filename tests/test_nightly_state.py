"""The nightly's state across runners: ci-examples/ carry BASELINE and HISTORY between nights
through the platform's own mechanism (GitHub Actions: actions/cache/restore + actions/cache/save;
Buildkite: the cache plugin, fed by the sweep step's state artifact), and ``make nightly-finish``
(the nightly after its run) fails the job when the baseline cannot be updated.

Each night runs in a fresh empty workspace (an ephemeral runner): the example's restore is
simulated from a platform store, the sweep is a fake run (:func:`fixtures.make_runs.write_run`)
at the example's ``RUN``, the real Makefile's ``nightly-finish`` runs with the example's
``BASELINE`` and ``HISTORY``, then the example's save is simulated into the store. Only what the
example restores and saves survives a night."""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from fixtures.make_runs import case, mission, pd, totals, write_run
from test_ci_examples import gha_state

from pdsweep.results import layout

REPO = Path(__file__).resolve().parents[1]
GHA, BUILDKITE = REPO / "ci-examples" / "github-actions-nightly.yml", REPO / "ci-examples" / "buildkite-pipeline.yml"


def fake_run(ws: Path, run: str, night: int, green: bool) -> Path:
    """Night ``night``'s sweep at ``ws/run``: the mission's fixed cells, red with a failed transfer."""
    cases = mission("fixed")
    if not green:
        cases.append(case(pd("qwen3-0.6b", 2, 1), totals(failed_transfers=1)))
    shutil.rmtree(ws / run, ignore_errors=True)
    d = write_run((ws / run).parent, Path(run).name, cases, sweep_name="nightly-fixture")
    index = layout.read_json(d / layout.RUN_FILE)
    index.update(started=f"2026-05-0{night}T02:00:00+00:00", finished=f"2026-05-0{night}T09:00:00+00:00")
    layout.write_json(d / layout.RUN_FILE, index)
    return d


def finish(ws: Path, env: dict[str, str], **over: str) -> subprocess.CompletedProcess[str]:
    """``make nightly-finish`` of the repository's Makefile in ``ws`` (this interpreter, this checkout).
    An absolute path lands on the night's own fresh disk (``ws/disk/...``): an ephemeral runner
    keeps nothing between nights, inside the checkout or outside it."""
    v = {k: over.get(k, env[k]) for k in ("RUN", "BASELINE", "HISTORY")}
    v = {k: str(ws / "disk" / x.lstrip("/")) if x.startswith("/") else x for k, x in v.items()}
    cmd = ["make", "-s", "-C", str(ws), "-f", str(REPO / "Makefile"), "nightly-finish", f"PY={sys.executable}"]
    cmd += [f"{k}={x}" for k, x in v.items()]
    penv = {**os.environ, "PYTHONPATH": str(REPO), "MPLBACKEND": "Agg"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=penv)


# ---------------------------------------------------------------- GitHub Actions
def gha_night(wf: dict[str, Any], store: Path, ws: Path, night: int, green: bool) -> subprocess.CompletedProcess[str]:
    env = {k: str(v) for k, v in wf["env"].items()}
    restored, saved = gha_state(wf)
    for p in restored:
        if (store / p).exists():
            shutil.copytree(store / p, ws / p, dirs_exist_ok=True)
    fake_run(ws, env["RUN"], night, green)
    r = finish(ws, env)
    for p in saved:
        if (ws / p).exists():
            shutil.rmtree(store / p, ignore_errors=True)
            shutil.copytree(ws / p, store / p)
    return r


# ---------------------------------------------------------------- Buildkite
def bk_night(pipeline: dict[str, Any], store: Path, ws: Path, night: int, green: bool) -> subprocess.CompletedProcess:
    """The pipeline's steps in order on fresh workspaces (one per step: another agent): the cache
    plugin's ``restore: pipeline`` before a step's commands and ``save: pipeline`` after them, the
    commands themselves (``make nightly`` replaced by a fake run and ``nightly-finish``; pip,
    install, fetch and annotate skipped), artifacts uploaded by ``artifact_paths`` and downloaded by
    ``buildkite-agent artifact download``."""
    env = {k: str(v) for k, v in pipeline["env"].items()}
    artifacts = ws / "artifacts"
    nightly: subprocess.CompletedProcess[str] | None = None
    for i, step in enumerate(s for s in pipeline["steps"] if "commands" in s):
        here = ws / f"agent-{i}"
        here.mkdir(parents=True)
        caches = [next(iter(p.values())) for p in step.get("plugins") or [] if next(iter(p)).startswith("cache#")]
        for c in caches:
            if c.get("restore") == "pipeline" and (store / c["path"]).exists():
                shutil.copytree(store / c["path"], here / c["path"], dirs_exist_ok=True)
        for cmd in step["commands"]:
            cmd = cmd.replace("$$", "$")
            if "pip download" in cmd or cmd.startswith(("make install", "buildkite-agent annotate")):
                continue
            if "make nightly" in cmd:
                fake_run(here, env["RUN"], night, green)
                nightly = finish(here, env)
                cmd = re.sub(r"make nightly .*?(?= \|\| |$)", f"( exit {nightly.returncode} )", cmd)
            for name in re.findall(r"buildkite-agent artifact download (\S+) \.", cmd):
                if (artifacts / name).exists():
                    (here / name).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(artifacts / name, here / name)
                cmd = cmd.replace(f"buildkite-agent artifact download {name} .", f"test -f {name}")
            rc = subprocess.run(["bash", "-c", cmd], cwd=here, env={**os.environ, **env}, timeout=60).returncode
            if "make nightly" not in str(step["commands"]) and rc != 0:
                return subprocess.CompletedProcess(cmd, rc, "", f"step {i}: {cmd} failed")
        for pat in step.get("artifact_paths") or []:
            for f in here.glob(pat):
                if f.is_file():
                    (artifacts / f.relative_to(here)).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(f, artifacts / f.relative_to(here))
        for c in caches:
            if c.get("save") == "pipeline" and (here / c["path"]).exists():
                shutil.rmtree(store / c["path"], ignore_errors=True)
                shutil.copytree(here / c["path"], store / c["path"])
    assert nightly is not None, "no step runs make nightly"
    return nightly


# ---------------------------------------------------------------- the nights
def history_runs(store: Path, history: str) -> list[tuple[str, str]]:
    with sqlite3.connect(store / history) as conn:
        return conn.execute("SELECT started, path FROM runs ORDER BY started").fetchall()


@pytest.mark.parametrize("example", ["gha", "buildkite"])
def test_two_nights_on_fresh_runners(example: str, tmp_path: Path) -> None:
    """Night 1 green (its run becomes the baseline), night 2 red on a fresh runner: it compares
    against night 1's run and fails; night 3 (fresh again) still finds night 1 as the last green run
    and all three nights in the history (a red night's history is saved too)."""
    conf = yaml.safe_load((GHA if example == "gha" else BUILDKITE).read_text())
    night = gha_night if example == "gha" else bk_night
    store = tmp_path / "platform-store"
    env = {k: str(v) for k, v in conf["env"].items()}
    one = night(conf, store, tmp_path / "n1", 1, True)
    assert one.returncode == 0, one.stdout + one.stderr
    assert "nightly: NO BASELINE" in one.stdout
    two = night(conf, store, tmp_path / "n2", 2, False)
    assert two.returncode != 0, two.stdout
    last_green = f"compare against the last green run {env['BASELINE']} (nightly 2026-05-01T02:00:00+00:00)"
    assert last_green in two.stdout, two.stdout + two.stderr
    three = night(conf, store, tmp_path / "n3", 3, True)
    assert last_green in three.stdout, three.stdout + three.stderr
    assert three.returncode == 0, three.stdout + three.stderr
    runs = history_runs(store, env["HISTORY"])
    assert [s[:10] for s, _ in runs] == ["2026-05-01", "2026-05-02", "2026-05-03"]
    assert all(not Path(p).is_absolute() for _, p in runs), runs  # relative to the store: no runner's path


def test_a_failed_baseline_update_fails_the_job(tmp_path: Path) -> None:
    """A green night whose baseline copy fails (its parent is a file) exits non-zero, saying so."""
    fake_run(tmp_path, "results/nightly", 1, True)
    (tmp_path / "state").write_text("not a directory\n")
    r = finish(tmp_path, {"RUN": "results/nightly", "BASELINE": "state/last-green", "HISTORY": "h/history.sqlite"})
    assert r.returncode != 0, r.stdout + r.stderr
    assert "nightly: FAILED to update the baseline state/last-green from results/nightly" in r.stderr


def test_the_dashboard_does_not_link_a_reused_run_dir(tmp_path: Path) -> None:
    """RUN=results/nightly is reused: night 1's history entry must not link to night 2's report."""
    env = {"RUN": "results/nightly", "BASELINE": "state/last-green", "HISTORY": "state/history.sqlite"}
    fake_run(tmp_path, env["RUN"], 1, True)
    assert finish(tmp_path, env).returncode == 0
    fake_run(tmp_path, env["RUN"], 2, True)
    r = finish(tmp_path, env)
    assert r.returncode == 0, r.stdout + r.stderr
    page = (tmp_path / env["RUN"] / "dashboard.html").read_text()
    links = re.findall(r"<tr><td>(<a href='([^']*)'>)?nightly", page)
    assert [bool(a) for a, _ in links] == [False, True], links  # night 1: no link; night 2: its report
    assert json.loads((tmp_path / env["BASELINE"] / layout.RUN_FILE).read_text())["started"].startswith("2026-05-02")


# ---------------------------------------------------------------- a sharded night
def sharded_night(ws: Path, night: int) -> str:
    """Night ``night`` run as two shard jobs (``run --shard 1/2`` and ``2/2``) at
    ``ws/results/nightly-{1,2}``: the mission's cells cut in two; returns ``RUN`` for nightly-finish."""
    cases = mission("fixed")
    parts = [[cases[0], cases[2]], [cases[1]]]  # p1d1 and the reference | p2d1
    for i, part in enumerate(parts, 1):
        shutil.rmtree(ws / f"results/nightly-{i}", ignore_errors=True)
        d = write_run(ws / "results", f"nightly-{i}", part, sweep_name="nightly-fixture")
        index = layout.read_json(d / layout.RUN_FILE)
        index.update(
            started=f"2026-05-0{night}T0{i}:00:00+00:00",
            finished=f"2026-05-0{night}T0{i + 4}:00:00+00:00",
            shard={"index": i, "count": 2, "cells": len(part), "of": len(cases)},
        )
        layout.write_json(d / layout.RUN_FILE, index)
    return "results/nightly-1,results/nightly-2"


def test_a_sharded_night_is_one_run_in_the_history_the_dashboard_and_compare(tmp_path: Path) -> None:
    """``make nightly-finish RUN=<shard 1>,<shard 2>``: one history entry a night (the merged view
    of its shards), one dashboard row, and night 2 compares all its cells against night 1's run."""
    env = {"BASELINE": "state/last-green", "HISTORY": "state/history.sqlite"}
    one = finish(tmp_path, {**env, "RUN": sharded_night(tmp_path, 1)})
    assert one.returncode == 0, one.stdout + one.stderr
    two = finish(tmp_path, {**env, "RUN": sharded_night(tmp_path, 2)})
    assert two.returncode == 0, two.stdout + two.stderr
    assert (
        "compare against the last green run state/last-green (nightly-1.shards 2026-05-01T01:00:00+00:00)" in two.stdout
    )
    runs = history_runs(tmp_path, env["HISTORY"])
    view = "../results/nightly-1.shards"  # relative to the store
    assert runs == [("2026-05-01T01:00:00+00:00", view), ("2026-05-02T01:00:00+00:00", view)], runs
    page = (tmp_path / "results/nightly-1.shards/dashboard.html").read_text()
    assert len(re.findall(r"<tr><td>(?:<a href='[^']*'>)?nightly-1\.shards", page)) == 2, page
    compared = json.loads((tmp_path / "results/nightly-1.shards" / layout.COMPARE_JSON).read_text())
    got = {c["a"]["cell_id"] for c in compared["cells"]}
    assert got == {c.id for c, _ in mission("fixed")}, got  # every cell of both shards, one run against one
    base = json.loads((tmp_path / env["BASELINE"] / layout.RUN_FILE).read_text())
    assert base["shard"]["count"] == 2 and set(base["cells"]) == {c.id for c, _ in mission("fixed")}


def test_one_shard_alone_is_not_a_run_for_the_history(tmp_path: Path) -> None:
    from pdsweep.core.errors import UserError
    from pdsweep.history.store import add_run

    sharded_night(tmp_path, 1)
    with pytest.raises(UserError, match=r"run\.json: shard: 1/2: one shard of a run; add all its shard directories"):
        add_run(tmp_path / "h.sqlite", tmp_path / "results/nightly-1")


def test_a_shard_job_does_not_append_itself_to_the_history(tmp_path: Path, monkeypatch, capsys) -> None:
    """``pdsweep run --shard i/n --history H`` (each job of a sharded night) leaves H to the night's
    nightly-finish: n shard jobs would otherwise be n entries."""
    import pdsweep.commands.run as run_cmd
    from pdsweep.plan.shards import Shard
    from pdsweep.run.context import RunOptions

    sharded_night(tmp_path, 1)
    monkeypatch.setattr(run_cmd, "run_sweep", lambda sweep, opts: tmp_path / "results/nightly-1")
    db = tmp_path / "h.sqlite"
    assert run_cmd.RunArgs("s.yaml", RunOptions(shard=Shard(1, 2)), db).main() == 0
    assert "--shard 1/2: not added to the history" in capsys.readouterr().err
    assert not db.exists()
