"""After the cells ran (the end of :func:`pdsweep.run.sweep.run_sweep`): judge each cell's raw
measurements against its expected score and its same-sweep single-instance reference; write
accuracy.json, consistency.json and load_check.json.

Raw inputs (written by ``run``): ``eval.json`` (lm-eval figures per task) and
``probe.json`` (greedy tokens + logprobs per prompt). A reference cell runs before the
PD cells that need it; judging is separate so a resumed run re-judges everything.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pdsweep.judge.accuracy import judge, load_expected
from pdsweep.judge.consistency import judge_consistency, thresholds_for
from pdsweep.judge.load import judge_cell_load
from pdsweep.measure.probe import compare
from pdsweep.results import layout
from pdsweep.sweepfile.sweep import LoadedSweep

log = logging.getLogger(__name__)
EVAL_RAW, PROBE_RAW = layout.EVAL_RAW, layout.PROBE_RAW


def _raw(run_dir: Path, cell_id: str, name: str) -> dict[str, Any] | None:
    return layout.CellDir.of(run_dir, cell_id).read(name)


def merge_probes(pd: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """Line up PD and reference outputs prompt by prompt (by name) and compare them
    (:func:`pdsweep.measure.probe.compare`). A prompt missing on either side compares as
    empty, which fails."""
    ref_rows = {r["name"]: r for r in ref.get("prompts", [])}
    rows = []
    for p in pd.get("prompts", []):
        r = ref_rows.get(p["name"], {})
        row = {
            "name": p["name"],
            "prompt_tokens": p.get("prompt_tokens"),
            "pd_tokens": p.get("tokens", []),
            "pd_logprobs": p.get("token_logprobs", []),
            "ref_tokens": r.get("tokens", []),
            "ref_logprobs": r.get("token_logprobs", []),
            "error": p.get("error") or r.get("error") or (None if r else "reference has no such prompt"),
            "path_check": r.get("path_check"),
        }
        row.update(compare(row["pd_tokens"], row["pd_logprobs"], row["ref_tokens"], row["ref_logprobs"]))
        rows.append(row)
    return {"max_tokens": pd.get("max_tokens"), "prompts": rows}


def judge_run(run_dir: Path, ls: LoadedSweep) -> None:
    """Write accuracy.json / consistency.json for every cell whose status is ok.
    Cells without raw results get none: the gate then fails them (fail closed)."""
    index = layout.read_json(Path(run_dir) / layout.RUN_FILE)
    # the scores frozen when the run started (what the gate holds accuracy.json to)
    expected = index["expected"] if isinstance(index.get("expected"), dict) else load_expected()
    cells = {cid: layout.CellDir.of(run_dir, cid).read(layout.CELL_FILE) for cid in index["cells"]}
    for cid, meta in cells.items():
        if meta is None or layout.cell_status(run_dir, cid) != "ok":
            continue
        cdir = layout.CellDir.of(run_dir, cid)
        cell, ref_id = meta["cell"], meta.get("reference_cell")
        is_ref = cell["kind"] == "ref"
        ev = _raw(run_dir, cid, EVAL_RAW)
        if ev is not None:
            ref_acc = None
            if ref_id and layout.cell_status(run_dir, ref_id) == "ok":
                ref_acc = layout.CellDir.of(run_dir, ref_id).read(layout.ACCURACY_FILE)
                if ref_acc is None and (ref_ev := _raw(run_dir, ref_id, EVAL_RAW)):
                    ref_acc = {"cell_id": ref_id, "tasks": ref_ev["tasks"]}
            body = judge(
                cid, ev["tasks"], expected.get(cell["model"]), ref_acc, ls.sweep.gate.alpha, is_reference=is_ref
            )
            layout.write_json(cdir.file(layout.ACCURACY_FILE), body)
        pd_probe = _raw(run_dir, cid, PROBE_RAW)
        if pd_probe is not None and not is_ref:
            ref_probe = _raw(run_dir, ref_id, PROBE_RAW) if ref_id else None
            model = ls.catalogue.models[cell["model"]]
            th = thresholds_for(model.attention, model.ssm, cell["prefill_tp"] == cell["decode_tp"])
            merged = merge_probes(pd_probe, ref_probe or {})
            body = judge_consistency(cid, ref_id if ref_probe else None, merged, th)
            layout.write_json(cdir.file(layout.CONSISTENCY_FILE), body)
        if not is_ref:  # every load answer vs the reference's (load_check.json)
            judge_cell_load(run_dir, cid, meta, ls)
