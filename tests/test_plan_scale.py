"""`pdsweep plan` at scale (issue 40 item 3): vLLM's answers kept per install on disk
(pdsweep.builds.answers), rejected cells grouped per rule, references of NOT-RUNNABLE cells
left out, one makespan (the one `run` follows). The timings are in bench/test_scale_1000.py."""

from __future__ import annotations

from pathlib import Path

from pdsweep.builds import answers, argcheck
from pdsweep.plan.cell import Cell
from pdsweep.plan.schedule import GpuPool, not_runnable, pack
from pdsweep.run.dryrun import print_plan, rejected_text


def _venv(root: Path) -> str:
    init = root / "lib" / "python3.11" / "site-packages" / "vllm" / "__init__.py"
    init.parent.mkdir(parents=True)
    init.write_text("__version__ = '0.32.0'\n")
    (root / "bin").mkdir()
    return str(root / "bin" / "python")


def test_fingerprint_names_the_install_and_changes_with_it(tmp_path: Path) -> None:
    py = _venv(tmp_path / "v")
    first = answers.fingerprint(py)
    assert first is not None and len(first) == 16
    init = tmp_path / "v" / "lib" / "python3.11" / "site-packages" / "vllm" / "__init__.py"
    init.write_text("__version__ = '0.33.0'  # reinstalled\n")
    answers.fingerprint.cache_clear()
    assert answers.fingerprint(py) not in (None, first)
    assert answers.fingerprint(str(tmp_path / "none" / "bin" / "python")) is None  # no vLLM on disk: no store


def test_argv_check_asks_vllm_once_per_distinct_args_then_reads_the_store(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(answers.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(answers, "fingerprint", lambda python: "f" * 16)
    answers.forget()
    asked: list[tuple[str, ...]] = []

    def fake_ask(args, python=None):
        asked.extend(map(tuple, args))
        return lambda: ["vllm serve: error: unrecognized arguments: --bogus" if "--bogus" in a else None for a in args]

    monkeypatch.setattr(argcheck, "ask_vllm", fake_ask)
    base = ["/py", "-m", "vllm.entrypoints.cli.main", "serve", "/models/m", "--port"]
    items = [
        ("c1", "prefill-0", [*base, "20001", "--bogus"]),
        ("c2", "prefill-0", [*base, "20201", "--bogus"]),  # only the port differs: one question
        ("c1", "decode-0", [*base, "20002"]),
    ]
    want = [
        "c1 instance prefill-0: vllm serve: error: unrecognized arguments: --bogus",
        "c2 instance prefill-0: vllm serve: error: unrecognized arguments: --bogus",
    ]
    assert argcheck.check_instances(items) == want
    assert len(asked) == 2 and all(a[a.index("--port") + 1] == argcheck.CHECK_PORT for a in asked)
    answers.forget()  # saved to disk, memory dropped: a new plan process
    assert len(list(tmp_path.glob("argv-ffffffffffffffff-*.json"))) == 1  # per install and probe code
    assert argcheck.check_instances(items) == want
    assert len(asked) == 2  # answered from the store: vLLM not asked again


def test_backend_probe_answers_come_from_the_store(tmp_path, monkeypatch) -> None:
    from pdsweep.builds import attnprobe

    monkeypatch.setenv(answers.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(answers, "fingerprint", lambda python: "e" * 16)
    answers.forget()
    attnprobe._ask.cache_clear()
    calls = []

    class FakeProbe:
        def ask(self, q):
            calls.append(q)
            return {"priorities": ["FLASH_ATTN"], "backends": [{"name": "FLASH_ATTN", "reasons": []}]}

    monkeypatch.setattr(attnprobe, "_probe", lambda python: FakeProbe())
    q = dict(capability=(9, 0), use_mla=False, head_size=128, dtype="bfloat16")
    first = attnprobe.select(**q, python="/x/bin/python")
    answers.forget()
    attnprobe._ask.cache_clear()
    assert attnprobe.select(**q, python="/x/bin/python") == first
    assert first["priorities"] == ["FLASH_ATTN"] and len(calls) == 1
    attnprobe._ask.cache_clear()
    answers.forget()


def _rej(cell: str, rule: str, reason: str) -> dict:
    return {"cell_id": cell, "rule": rule, "reason": reason}


def test_rejected_cells_are_grouped_per_rule_with_counts() -> None:
    long = "decode kernel block 16 is not a multiple of prefill kernel block 128 " + "x" * 200
    rows = [_rej(f"m.p1d1.b128-16.{b}{v}", "block-ratio", long) for b in ("fixed", "unfixed") for v in ("", ".prefix")]
    rows.append(_rej("m.p2d1.b16-16.fixed", "heads", "prefill TP 2 does not divide num_attention_heads=3"))
    text = "".join(rejected_text(rows))
    assert text.count(long) == 1  # once, not per build and variant
    assert "rejected: 5 cells by 2 rules" in text
    assert "  block-ratio: 4 cells, 1 distinct reason(s)\n" in text
    assert f"       4 x {long}\n" in text
    assert "e.g. m.p1d1.b128-16.fixed, m.p1d1.b128-16.fixed.prefix, m.p1d1.b128-16.unfixed and 1 more" in text
    assert text.index("block-ratio") < text.index("heads:")  # the largest group first
    assert rejected_text([]) == []


def _pd(p: int, d: int) -> Cell:
    return Cell("m", p, d, 16, 16, 1, 1, "cuda", "fixed")


def test_references_of_not_runnable_cells_are_not_scheduled() -> None:
    big, small = _pd(4, 4), _pd(1, 1)
    ref_big, ref_small = big.reference("fixed", "base"), small.reference("fixed", "base")
    cells = [big, small, ref_big, ref_small]
    refs = {big.id: ref_big.id, small.id: ref_small.id}

    def ref_of(c: Cell) -> str:
        return refs[c.id]

    pool = GpuPool(4, 20000)  # p4d4 needs 8
    why = not_runnable(cells, pool, ref_of)
    assert why == {
        big.id: "needs 8 GPUs, host has 4",
        ref_big.id: f"reference of NOT-RUNNABLE cells only (1, e.g. {big.id}): nothing to compare",
    }
    sched = pack(cells, 4, ref_of=ref_of)
    assert {p.cell.id for p in sched.placements} == {small.id, ref_small.id}
    assert sched.reasons[ref_big.id].startswith("reference of NOT-RUNNABLE")
    # a reference chosen alone (`--cells`) still runs
    assert not_runnable([ref_big], pool, ref_of) == {}


def test_plan_prints_one_makespan_the_one_run_follows(capsys) -> None:
    row = {"start_s": 0.0, "ready_s": 300.0, "gpus": 2, "prestarted": 0}
    d = {
        "sweep": "s.yaml",
        "platform": "cuda",
        "gpus": 8,
        "nodes": None,
        "cells": [],
        "rejected": [],
        "schedule": {"placements": [], "needs_more_gpus": [], "makespan_s": 50218.0, "serial_s": 90000.0},
        "reuse": {
            "instances": [],
            "distinct": 3,
            "per_cell": 4,
            "schedule": {
                "cells": [
                    {**row, "cell": "a", "end_s": 420.0, "instance_starts": 2},
                    {**row, "cell": "b", "start_s": 420.0, "end_s": 81140.0, "instance_starts": 2, "prestarted": 1},
                ],
                "instance_starts": 4,
                "makespan_s": 81140.0,
                "sequential_s": 90000.0,
            },
        },
        "makespan": {"s": 81140.0, "follows": "reuse dispatch"},
    }
    print_plan(d)
    out = capsys.readouterr().out
    assert out.count("makespan") == 1
    assert "estimated makespan 81140 s (the schedule `run` follows: reuse dispatch) vs 90000 s one cell" in out
    assert "50218" not in out
    assert "t=    420s..  81140s  2 GPUs  2 instance starts (1 prestarted)  b" in out
    assert "; 4 instance starts: 1 again (stopped for room, or an expected failure)" in out
