"""ci-examples/ as their platforms document them: each file validates against its platform's
schema (check-jsonschema's vendored SchemaStore schemas: no network), the workflow passes
actionlint, and a simulated nightly shows that no step reads a file no earlier step wrote
(or, on Buildkite, uploaded as an artifact before a ``wait``)."""

from __future__ import annotations

import fnmatch
import glob
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from fixtures.make_runs import MIXED, MIXED_REJECTED, write_run

from pdsweep.judge.gate import gate_run
from pdsweep.report.html import write_report
from pdsweep.report.render import write_junit, write_summary
from pdsweep.results import layout

EXAMPLES = Path(__file__).resolve().parents[1] / "ci-examples"
GHA, BUILDKITE = EXAMPLES / "github-actions-nightly.yml", EXAMPLES / "buildkite-pipeline.yml"
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    path = shutil.which(name, path=str(BIN)) or shutil.which(name)
    assert path, f"{name} is not installed (pip install -e '.[dev]')"
    return path


@pytest.mark.parametrize(("path", "schema"), [(GHA, "vendor.github-workflows"), (BUILDKITE, "vendor.buildkite")])
def test_schema(path: Path, schema: str) -> None:
    r = subprocess.run(
        [tool("check-jsonschema"), "--builtin-schema", schema, str(path)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_actionlint() -> None:
    cmd = [tool("actionlint"), "-config-file", str(EXAMPLES / "actionlint.yaml"), str(GHA)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


# ---------------------------------------------------------------- the simulated nightly
def nightly(ws: Path, run: str, history: str | None = None) -> None:
    """What `make nightly RUN=run HISTORY=history` leaves in the workspace ``ws``: the run (cells with
    logs and cell.json), its report, junit.xml, summary.md and dashboard.html, and the history store."""
    run_dir = write_run(ws / Path(run).parent, Path(run).name, list(MIXED.values()), MIXED_REJECTED)
    for cell in run_dir.iterdir():
        if (cell / layout.CELL_FILE).is_file():
            layout.write_text(cell / layout.LOGS_DIR / "decode-0.log", "log\n")
    result = gate_run(run_dir)
    write_junit(result, run_dir / layout.JUNIT_FILE)
    write_summary(result, run_dir / layout.SUMMARY_FILE)
    write_report(run_dir)
    layout.write_text(run_dir / "dashboard.html", "<html></html>\n")
    if history:
        layout.write_text(ws / history, "sqlite\n")


def expand(text: str, env: dict[str, str]) -> str:
    """``text`` with ``${{ env.X }}``, ``$X`` and ``${X}`` (and Buildkite's runtime ``$$X``) set from ``env``."""
    text = text.replace("$$", "$")
    text = re.sub(r"\$\{\{\s*env\.(\w+)\s*\}\}", lambda m: env[m.group(1)], text)
    return re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), m.group(0)), text)


def files(ws: Path, pattern: str) -> set[str]:
    """Files of ``ws`` a path or glob names (a directory: every file under it)."""
    out: set[str] = set()
    for hit in glob.glob(pattern, root_dir=ws, recursive=True):
        p = ws / hit
        out |= {str(f.relative_to(ws)) for f in p.rglob("*") if f.is_file()} if p.is_dir() else {hit}
    return out


def gha_problems(wf: dict[str, Any], ws: Path) -> list[str]:
    """Steps of the workflow that read a file no earlier step wrote, and what the nightly needs."""
    env = {k: str(v) for k, v in (wf.get("env") or {}).items()}
    problems = []
    if (wf.get("permissions") or {}).get("checks") != "write":
        problems.append("permissions: checks: write missing (mikepenz/action-junit-report)")
    restored, saved = gha_state(wf)
    for var in ("HISTORY", "BASELINE"):
        if not (carried(env.get(var, ""), restored) and carried(env.get(var, ""), saved)):
            problems.append(f"{var} is not restored and saved by actions/cache: a fresh runner loses it")
    (job,) = wf["jobs"].values()
    made = False
    uploaded: set[str] = set()
    for i, step in enumerate(job["steps"]):
        run = expand(step.get("run", ""), env)
        if "make nightly" in run:
            if f"RUN={env.get('RUN')}" not in run.replace('"', ""):
                problems.append(f"step {i}: make nightly without RUN=$RUN")
            nightly(ws, env["RUN"], env.get("HISTORY"))
            made = True
            continue
        reads = re.findall(r"(?:cat|<)\s+(\S+)", run)
        reads += re.findall(r"hashFiles\('([^']+)'\)", str(step.get("if", "")))
        w = step.get("with") or {}
        reads += [expand(str(w[k]), env) for k in ("report_paths",) if k in w]
        for path in (shlex.split(p)[0] for p in reads):
            if not files(ws, path):
                problems.append(f"step {i} ({step.get('name') or step.get('uses')}): reads {path}, no step wrote it")
        if "upload-artifact" in str(step.get("uses")):
            up = set().union(*(files(ws, expand(p, env)) for p in str(w.get("path")).split() if p[0] != "!"))
            up -= set().union(*(files(ws, expand(p[1:], env)) for p in str(w.get("path")).split() if p[0] == "!"))
            uploaded |= up
    for want in ("logs/decode-0.log", "/cell.json", "/summary.md", "/junit.xml", "/report.html", "/dashboard.html"):
        if made and not any(f.endswith(want) for f in uploaded):
            problems.append(f"no artifact has {want}")
    if not made:
        problems.append("no step runs make nightly")
    return problems


def gha_state(wf: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(paths restored by actions/cache/restore with a restore-keys prefix (the latest entry),
    paths saved by actions/cache/save whose ``if`` lets a red night through). actions/cache (restore
    + save in one) saves only after a green job: it does not carry a red night's history."""
    (job,) = wf["jobs"].values()
    restored: list[str] = []
    saved: list[str] = []
    for step in job["steps"]:
        uses, w = str(step.get("uses", "")), step.get("with") or {}
        paths = str(w.get("path", "")).split()
        if uses.startswith("actions/cache/restore@") and w.get("restore-keys"):
            restored += paths
        if uses.startswith("actions/cache/save@") and "success()" not in str(step.get("if", "success()")):
            saved += paths
    return restored, saved


def carried(path: str, dirs: list[str]) -> bool:
    """Whether ``path`` lies in (or is) one of ``dirs`` (workspace-relative)."""
    return bool(path) and any(path == d.rstrip("/") or path.startswith(d.rstrip("/") + "/") for d in dirs)


def buildkite_problems(pipeline: dict[str, Any], ws: Path) -> list[str]:
    """Steps that read an artifact no step before a ``wait`` uploaded; what the nightly needs."""
    env = {k: str(v) for k, v in (pipeline.get("env") or {}).items()}
    problems = []
    plugins = [p for s in pipeline["steps"] for p in s.get("plugins") or []]
    caches = [next(iter(p.values())) for p in plugins if next(iter(p)).startswith("cache#")]
    for var in ("HISTORY", "BASELINE"):
        for way in ("restore", "save"):
            if not carried(env.get(var, ""), [c["path"] for c in caches if c.get(way) == "pipeline"]):
                problems.append(f"{var} is not {way}d by the cache plugin (pipeline): a fresh agent loses it")
    uploaded: set[str] = set()  # artifacts of the steps before the last wait
    pending: set[str] = set()  # of the steps since
    for i, step in enumerate(pipeline["steps"]):
        if "wait" in step:
            if step.get("continue_on_failure") is not True:
                problems.append(f"step {i}: wait without continue_on_failure: the annotation skips a failed gate")
            uploaded |= pending
            pending = set()
            continue
        commands = [expand(c, env) for c in step.get("commands") or [step.get("command", "")] if c]
        local: set[str] = set()
        for c in commands:
            if "make nightly" in c:
                nightly(ws, env["RUN"], env.get("HISTORY"))
                for tgz in re.findall(r"tar -czf (\S+)", c):
                    layout.write_text(ws / tgz, "state\n")
            for path in re.findall(r"buildkite-agent artifact download (\S+)", c):
                if not {f for f in uploaded if fnmatch.fnmatch(f, path)}:
                    problems.append(f"step {i}: downloads {path}, not uploaded before a wait")
                local.add(path)
            for path in re.findall(r"<\s*(\S+)", c):
                if path not in local:
                    problems.append(f"step {i}: reads {path}, not downloaded")
        for plugin in step.get("plugins") or []:
            for name, conf in plugin.items():
                if name.startswith("junit-annotate") and not any(
                    fnmatch.fnmatch(f, conf["artifacts"]) for f in uploaded
                ):
                    problems.append(f"step {i}: junit-annotate reads {conf['artifacts']}, not uploaded before a wait")
        for pattern in step.get("artifact_paths") or []:
            pending |= files(ws, expand(pattern, env))
    for want in ("logs/decode-0.log", "/cell.json", "/summary.md", "/junit.xml", "/report.html", "/dashboard.html"):
        if not any(f.endswith(want) for f in uploaded):
            problems.append(f"no artifact {want}")
    return problems


def test_github_actions_artifact_flow(tmp_path: Path) -> None:
    assert gha_problems(yaml.safe_load(GHA.read_text()), tmp_path) == []


def test_buildkite_artifact_flow(tmp_path: Path) -> None:
    assert buildkite_problems(yaml.safe_load(BUILDKITE.read_text()), tmp_path) == []


def test_the_checks_catch_what_issue_37_found(tmp_path: Path) -> None:
    """The examples as they were: junit-annotate in the sweep step, logs left out, no
    permissions, HISTORY in the checkout."""
    bk = yaml.safe_load(BUILDKITE.read_text())
    sweep, _wait, _save, annotate, _summary = bk["steps"]
    sweep["plugins"] = annotate["plugins"]
    bk["steps"] = [sweep]
    assert "BASELINE is not saved by the cache plugin (pipeline): a fresh agent loses it" in buildkite_problems(
        bk, tmp_path / "s"
    )
    assert any("junit-annotate reads results/nightly/junit.xml" in p for p in buildkite_problems(bk, tmp_path / "a"))
    wf = yaml.safe_load(GHA.read_text())
    del wf["permissions"]
    wf["env"]["HISTORY"] = "results/history.sqlite"
    wf["env"]["BASELINE"] = "/data/pdsweep/last-green"  # runner-local disk: an ephemeral runner loses it
    (job,) = wf["jobs"].values()
    upload = next(s for s in job["steps"] if "upload-artifact" in str(s.get("uses")))
    upload["with"]["path"] = "results/nightly/\n!results/nightly/**/logs/*.log"
    got = gha_problems(wf, tmp_path / "b")
    assert "permissions: checks: write missing (mikepenz/action-junit-report)" in got
    assert "HISTORY is not restored and saved by actions/cache: a fresh runner loses it" in got
    assert "BASELINE is not restored and saved by actions/cache: a fresh runner loses it" in got
    assert "no artifact has logs/decode-0.log" in got
    job["steps"] = [s for s in job["steps"] if "make nightly" not in s.get("run", "")]
    assert any("reads results/nightly/junit.xml, no step wrote it" in p for p in gha_problems(wf, tmp_path / "c"))
