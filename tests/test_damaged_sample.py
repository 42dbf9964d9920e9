"""Issue 59: a generated sample of damaged run directories. A passing run (a hybrid PD cell and its
reference, with eval, consistency and a checked load phase planned in run.json) is damaged one
way at a time: each field of each file the gate reads dropped, each list entry (a task's field, a
prompt, a concurrency run, a prefill rank, a checked workload) removed. The gate never says PASS
for the damaged cell unless the field is one the gate does not need (:data:`OPTIONAL`, each with
why), and no damage makes ``pdsweep gate`` print a traceback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from fixtures.make_runs import HYBRID, LOAD, case, edit, ref, write_run

from pdsweep.judge.gate import PASS, gate_run
from pdsweep.results import layout

REF = ref(HYBRID)
CONCS = (2, 8)
BENCH = {"enabled": True, "check": True, "workloads": [{"name": "random"}], "concurrencies": list(CONCS)}
BENCH["num_prompts"] = 16
EVAL = {"tasks": ["pdsweep_arith"], "consistency": {"enabled": True, "lengths": ["short", "blocks", "long"]}}


def _load(c: int) -> dict:
    return {"concurrency": c, "num_prompts": 16, "completed": 16, "errors": 0, "output_tokens": 64}


def _checked(c: int) -> dict:
    return {"workload": "random", "concurrency": c, "checked": 16, "wrong": 0, "stale": 0, "errors": 0, "unmatched": 0}


def passing_run(root: Path) -> Path:
    load = {LOAD: {"runs": [_load(c) for c in CONCS]}}
    answers = {layout.LOAD_CHECK_FILE: {"verdict": "pass", "reasons": [], "workloads": [_checked(c) for c in CONCS]}}
    run = write_run(root, "run", [case(HYBRID, load, answers), case(REF, load)])
    edit(run / layout.RUN_FILE, lambda d: d.update(bench=BENCH, eval=EVAL))
    return run


def _paths(data, prefix=()):
    if prefix:
        yield prefix
    if isinstance(data, dict):
        for k, v in data.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from _paths(v, (*prefix, i))


def _drop(data, path):
    parent = data
    for k in path[:-1]:
        parent = parent[k]
    if isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent.pop(path[-1])
    return data


def damages(run: Path) -> list[tuple[str, tuple]]:
    """(file relative to the run, JSON path dropped) for every field and entry of every file the gate reads."""
    out = []
    for f in sorted(run.rglob("*.json")):
        rel = str(f.relative_to(run))
        out += [(rel, p) for p in _paths(json.loads(f.read_text()))]
    return out


def spell(rel: str, path: tuple) -> str:
    """``cell.json:build.python`` style, the cell id left out (both cells share the rules)."""
    name = rel.replace(HYBRID.id + "/", "pd:").replace(REF.id + "/", "ref:")
    return f"{name}:{'.'.join(map(str, path))}"


# Fields the gate does not need for a verdict; dropping one may leave the cell PASS. Anything not
# listed here must fail when dropped (run.json and plan.json are the plan: not in the sample).
OPTIONAL = {
    r"(pd|ref):[a-z_]+\.json:(schema|cell_id)": "schema defaults to 1; the file's cell is its directory",
    r"(pd|ref):status\.json:(?!status$).+": "status ok decides; kind and expectation agree via cell.json",
    r"(pd|ref):cell\.json:cell\.(?!model$|prefill_tp$|decode_tp$|prefill_block_size$|decode_block_size$"
    r"|num_prefill$|num_decode$|kv_buffer_device$|build$).+": "defaults of a Cell record",
    r"(pd|ref):cell\.json:(compare_key|reference_cell|config_hash|git_sha|host.*|model\.(name|source))": (
        "provenance shown by compare and report, not judged"
    ),
    r"(pd|ref):cell\.json:build\.(nixl_version|patched_files_sha256)": "recorded when probed; null is allowed",
    r"(pd|ref):cell\.json:instances\.\d+\.(name|tp|argv\.[0-2])": "labels; the connector is argv[3:]",
    r"ref:cell\.json:(instances.*|model.*)": "a reference has no connector and no read pattern",
    r"(pd|ref):accuracy\.json:tasks\.pdsweep_arith\.(metric|stderr|reasons|expected\.source)": "shown only",
    r"(pd|ref):accuracy\.json:tasks\.pdsweep_arith\.expected": "a PD task is judged against its reference too",
    r"ref:accuracy\.json:tasks\.pdsweep_arith\.(reference|p_value)": "a reference has no reference",
    r"pd:consistency\.json:(thresholds.*|reasons|prompts\.\d+\.(prompt_tokens|first_divergence))": (
        "recomputed from the tokens and the model's thresholds (thresholds_for)"
    ),
    r"pd:load_check\.json:(reasons|workloads\.\d+\.stale)": "stale answers are counted in wrong",
    r"pd:transfer\.json:(phases.*|totals\.(?!num_transfers$|bytes$|failed_transfers$|failed_notifications$"
    r"|expired_reqs$|notifications_after_expiry$|kv_requests$).+)": "figures, not verdicts (judged by the perf gate)",
    r"pd:transfer\.json:reads_by_prefill_rank\.\d+\.(bytes|descriptors|engines)": "the READ count is the pattern",
    r"ref:transfer\.json:.*": "a reference has no connector: its transfer.json is not judged",
}


def test_the_passing_sample_passes(tmp_path: Path) -> None:
    assert gate_run(passing_run(tmp_path)).headline() == "PASSED: 2 PASS"


def test_no_damaged_run_directory_yields_pass(tmp_path: Path, capsys) -> None:
    import re

    from pdsweep.cli import main

    run = passing_run(tmp_path / "base")
    passed, cells = [], 0
    for i, (rel, path) in enumerate(damages(run)):
        if not rel.startswith((HYBRID.id, REF.id)):
            continue
        cells += 1
        d = tmp_path / f"d{i}"
        shutil.copytree(run, d)
        (d / rel).write_text(json.dumps(_drop(json.loads((d / rel).read_text()), path)))
        cid = rel.split("/")[0]
        name = spell(rel, path)
        r = gate_run(d)
        if r.cell(cid).verdict == PASS and not any(re.fullmatch(p, name) for p in OPTIONAL):
            passed.append(name)
        if i % 7 == 0:  # the CLI on a sample: exit 0/1, never a traceback (exit 3)
            assert main(["gate", str(d)]) in (0, 1), name
            assert "Traceback" not in capsys.readouterr().err
        shutil.rmtree(d)
    assert cells > 300 and passed == []
