"""Issue 59: a generated sample of damaged run directories. A passing run (a hybrid PD cell and its
reference, with eval, consistency and a checked load phase planned in run.json) is damaged one
way at a time: each field of each file the gate reads (the cells' results files, run.json and
plan.json: :func:`pdsweep.judge.gate.gate_run`, :data:`pdsweep.judge.facts.CELL_FILES`) dropped,
each list entry (a task's field, a prompt, a concurrency run, a prefill rank, a checked workload, a
planned cell) removed. The gate never says PASS unless the field is one the gate does not need
(:data:`OPTIONAL`, each with why), and no damage makes ``pdsweep gate`` print a traceback."""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path

from fixtures.jsondoc import drop, json_paths
from fixtures.make_runs import HYBRID, LOAD, case, edit, ref, write_run

from pdsweep.cli import main
from pdsweep.core.errors import UserError
from pdsweep.judge.gate import gate_run
from pdsweep.results import layout

REF = ref(HYBRID)
CONCS = (2, 8)
BENCH = {"enabled": True, "check": True, "workloads": [{"name": "random"}], "concurrencies": list(CONCS)}
BENCH |= {"num_prompts": 16, "repeats": 1}  # one vllm bench serve run per concurrency


def _load(c: int) -> dict:
    return {"concurrency": c, "num_prompts": 16, "completed": 16, "errors": 0, "output_tokens": 64}


def _checked(c: int) -> dict:
    return {"workload": "random", "concurrency": c, "checked": 16, "wrong": 0, "stale": 0, "errors": 0, "unmatched": 0}


def passing_run(root: Path) -> Path:
    """The sample: run.json freezes the sweep defaults' gate and eval, the load phase (:data:`BENCH`) and
    the model's expected score (the accuracy.json ``expected`` of the fixture, 0.8 +/- 0.05)."""
    load = {LOAD: {"runs": [_load(c) for c in CONCS]}}
    checked = {"verdict": "pass", "reasons": [], "workloads": [_checked(c) for c in CONCS], "reference_cell": REF.id}
    answers = {layout.LOAD_CHECK_FILE: checked}
    run = write_run(root, "run", [case(HYBRID, load, answers), case(REF, load)])
    edit(run / layout.RUN_FILE, lambda d: d.update(bench=BENCH))
    return run


def damages(run: Path) -> list[tuple[str, tuple]]:
    """(file relative to the run, JSON path dropped) for every field and entry of every file the gate reads."""
    out = []
    for f in sorted(run.rglob("*.json")):
        rel = str(f.relative_to(run))
        out += [(rel, p) for p in json_paths(json.loads(f.read_text())) if p]
    return out


def spell(rel: str, path: tuple) -> str:
    """``cell.json:build.python`` style, the cell id left out (both cells share the rules)."""
    name = f"{rel}:{'.'.join(map(str, path))}"
    return (
        name.replace(HYBRID.id + "/", "pd:")
        .replace(REF.id + "/", "ref:")
        .replace(HYBRID.id, "PD")
        .replace(REF.id, "REF")
    )


CELL_DEFAULTS = (
    r"(?!model$|prefill_tp$|decode_tp$|prefill_block_size$|decode_block_size$|num_prefill$|num_decode$"
    r"|kv_buffer_device$|build$).+"
)
# Fields the gate does not need for a verdict; dropping one may leave the run PASSED. Anything not
# listed here must fail when dropped.
OPTIONAL = {
    r"(run|plan)\.json:schema": "schema defaults to 1",
    r"run\.json:(name|sweep|sweep_name|sweep_sha256|started|finished|host.*|git_sha|pdsweep_version)": (
        "provenance shown by report and history, not judged"
    ),
    r"run\.json:eval\.(?!tasks|reference$|consistency$|consistency\.(enabled|lengths|max_tokens)).+": (
        "how lm-eval and the probe ran (limit, seed, ...), not what the files must hold"
    ),
    r"run\.json:expected\.kimi-linear\.pdsweep_arith\.source": "shown only",
    r"plan\.json:schedule": "the placement, not judged",
    r"plan\.json:cells\.\d+\.(id|"
    + CELL_DEFAULTS
    + ")": "the id is recomputed from the record; defaults of a Cell record",
    r"(pd|ref):[a-z_]+\.json:(schema|cell_id)": "schema defaults to 1; the file's cell is its directory",
    r"(pd|ref):status\.json:(?!status$).+": "status ok decides; kind and expectation agree via cell.json",
    r"(pd|ref):cell\.json:cell\." + CELL_DEFAULTS: "defaults of a Cell record",
    r"(pd|ref):cell\.json:(compare_key|reference_cell|config_hash|git_sha|host.*|model\.(name|source))": (
        "provenance shown by compare and report, not judged"
    ),
    r"(pd|ref):cell\.json:build\.(nixl_version|patched_files_sha256)": "recorded when probed; null is allowed",
    r"(pd|ref):cell\.json:instances\.\d+\.(name|tp|argv\.[0-2])": "labels; the connector is argv[3:]",
    r"ref:cell\.json:(instances.*|model.*)": "a reference has no connector and no read pattern",
    r"(pd|ref):accuracy\.json:tasks\.pdsweep_arith\.(metric|stderr|reasons|expected\.source)": "shown only",
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


def _outcome(run: Path, capsys, cli: bool) -> str:
    """PASS or FAIL (``gate_run``); with ``cli`` the command too: exit 0/1, never a traceback (exit 3)."""
    try:
        verdict = "PASS" if gate_run(run).passed else "FAIL"
    except UserError:
        verdict = "exit 2"
    if cli:
        assert main(["gate", str(run)]) == {"PASS": 0, "FAIL": 1, "exit 2": 2}[verdict]
        assert "Traceback" not in capsys.readouterr().err
    return verdict


def test_no_damaged_run_directory_yields_pass(tmp_path: Path, capsys) -> None:
    run = passing_run(tmp_path / "base")
    passed, outcomes, used = [], collections.Counter(), set()
    for i, (rel, path) in enumerate(damages(run)):
        original = (run / rel).read_text()
        (run / rel).write_text(json.dumps(drop(json.loads(original), path)))
        name = spell(rel, path)
        outcome = _outcome(run, capsys, cli=i % 7 == 0)
        (run / rel).write_text(original)
        (run / layout.JUNIT_FILE).unlink(missing_ok=True)
        (run / layout.SUMMARY_FILE).unlink(missing_ok=True)
        outcomes[outcome] += 1
        why = [p for p in OPTIONAL if re.fullmatch(p, name)] if outcome == "PASS" else []
        used.update(why)
        if outcome == "PASS" and not why:
            passed.append(name)
    print(f"{sum(outcomes.values())} damages: {dict(outcomes)}")
    assert passed == []
    assert sum(outcomes.values()) > 500 and outcomes["FAIL"] > 250
    assert set(OPTIONAL) - used == set()  # every optional entry names a field whose loss passes
