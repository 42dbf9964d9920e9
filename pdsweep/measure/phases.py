"""Measured phases of a ready deployment: /metrics scrapes around each phase, the
consistency probe's raw outputs, and the optional load phase (``vllm bench serve``)."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pdsweep.core.kvintegrity import integrity, integrity_reasons
from pdsweep.core.kvpush import push_integrity
from pdsweep.core.logscan import nixl_reads_by_rank, nixl_writes_by_rank, read_fault_counts, transfer_topologies
from pdsweep.deploy.deployment import CellFailed, Deployment, stop_if_ended
from pdsweep.measure import benchserve
from pdsweep.measure.endpoints import completions_url
from pdsweep.measure.evalproc import EvalTarget, run_lm_eval_bounded
from pdsweep.measure.loadrun import WorkloadTarget, budget_s, run_workload
from pdsweep.measure.metrics import NIXL_BYTES, cell_transfer, parse, scrape_sync, ucx_transports_from_logs
from pdsweep.measure.probe import complete, path_check
from pdsweep.measure.prompts import build_prompts, probe_text
from pdsweep.measure.repeats import Probes, engine_cpu_s, run_repeats
from pdsweep.measure.workloads import build
from pdsweep.plan.budgets import bench_budget_s, eval_budget_s
from pdsweep.plan.expand import Cell
from pdsweep.plan.runtimeblocks import mismatches, runtime_blocks
from pdsweep.results import layout
from pdsweep.sweepfile.sweep import LoadedSweep

log = logging.getLogger(__name__)


@contextlib.contextmanager
def scrape_phase(
    dep: Deployment,
    phases: dict[str, Any],
    name: str,
    out_dir: Path | None = None,
    spent: dict[str, float] | None = None,
) -> Iterator[None]:
    """Scrape every instance's /metrics (and the PD proxy's, as instance ``proxy``) before
    and after the block; store ``phases[name][instance] = (before, after, wall_s)`` and the raw text under
    ``<cell>/metrics/``. An instance that cannot be scraped is left out, so its
    metrics read as missing (the gate fails closed). A shared instance's counters are
    cumulative over every cell that used it: only these before/after deltas belong to
    this cell. Seconds spent scraping are added to ``spent['scrape_s']``."""
    out_dir = out_dir or (dep.log_dir or dep.handles[0].log_path.parent).parent / "metrics"
    out_dir.mkdir(parents=True, exist_ok=True)

    targets = [(h.name, h.url) for h in dep.handles]
    if dep.proxy is not None:  # the PD proxy counts the requests decode must have read KV for
        targets.append(("proxy", dep.proxy.url))  # type: ignore[attr-defined]

    def grab(tag: str) -> dict[str, Any]:
        t = time.monotonic()
        snaps = {}
        for iname, url in targets:
            try:
                text = scrape_sync(f"{url}/metrics")
            except (httpx.HTTPError, OSError) as e:  # recorded as missing
                log.warning("%s: /metrics scrape failed (%s): %s", iname, tag, e)
                continue
            (out_dir / f"{name}.{iname}.{tag}.txt").write_text(text)
            snaps[iname] = parse(text)
        if spent is not None:
            spent["scrape_s"] = spent.get("scrape_s", 0.0) + time.monotonic() - t
        return snaps

    before, t0 = grab("before"), time.monotonic()
    try:
        yield
    finally:
        wall = time.monotonic() - t0
        after = grab("after")
        phases[name] = {n: (before[n], after[n], wall) for n in before if n in after}


@dataclass
class CellMeasure:
    """How to measure one ready cell: its directory ``cdir``, the model path ``mpath``, the
    ``on_phase`` callback (phase name), the read-back ``blocks`` (None: the plan's), whether to
    ``skip_eval``, ``spent`` (seconds pdsweep itself spends, by item: the harness share) and
    ``pair``, the load repeats' partner (:mod:`pdsweep.measure.paired`; None: not paired)."""

    cdir: Path
    mpath: str
    on_phase: Callable[[str], None]
    blocks: dict[str, Any] | None = None
    skip_eval: bool = False
    spent: dict[str, float] | None = None
    pair: Any = None  # pdsweep.measure.paired.PairSide / Unpaired (bench.pair_builds), else None


def measure_cell(ls: LoadedSweep, cell: Cell, dep: Deployment, m: CellMeasure) -> None:
    """The measured phases: eval (lm-eval), consistency probe, optional load; each
    bracketed by /metrics scrapes of every instance (transfer.json). ``m.spent`` collects
    the seconds pdsweep itself spends (scrapes, transfer.json, the load driver's start-up)."""
    cdir, mpath, on_phase, blocks, spent = m.cdir, m.mpath, m.on_phase, m.blocks, m.spent
    ev = ls.sweep.eval
    phases: dict[str, Any] = {}
    if not m.skip_eval and ev.tasks:
        on_phase("eval")
        model = ls.catalogue.models[cell.model]

        target = EvalTarget(
            f"{dep.url}/v1/completions", cell.model, model.tokenizer or mpath, model.chat, model.trust_remote_code
        )
        with scrape_phase(dep, phases, "eval", spent=spent):
            results = run_lm_eval_bounded(target, ev, cdir, eval_budget_s(ev))
        layout.write_json(cdir / layout.EVAL_RAW, {"cell_id": cell.id, "tasks": results})
    if ev.consistency.enabled:
        on_phase("consistency")
        with scrape_phase(dep, phases, "consistency", spent=spent):
            probe = collect_probe(ls, cell, dep, mpath, blocks)
        layout.write_json(cdir / layout.PROBE_RAW, {"cell_id": cell.id, **probe})
    if ls.sweep.bench.enabled:
        on_phase("bench")

        logs = tuple(h.log_path for h in dep.decode_handles) if cell.kind == "pd" else ()
        pids = [h.pid for h in dep.handles]
        probes = Probes(logs, lambda: engine_cpu_s(pids))
        with scrape_phase(dep, phases, "bench", spent=spent):  # repeats: a loop around run_load
            load = run_repeats(ls, cell, dep, mpath, cdir, run_load, probes, m.pair)
            load["workloads"] = run_checked(ls, cell, dep, mpath, blocks)  # every answer checked, once
        if spent is not None:  # the load driver's own seconds: start-up and result files, not the requests
            spent["load_driver_s"] = sum(
                r["driver_s"] - (r.get("duration_s") or 0.0) for r in load["runs"] if r.get("driver_s") is not None
            )
        layout.write_json(cdir / layout.LOAD_FILE, {"cell_id": cell.id, **load})

    t = time.monotonic()
    push = dep.transfer_mode == "push"  # prefill WRITEs: its logs and metrics are the transfer's
    ucx = (
        ucx_transports_from_logs((h.log_path for h in dep.initiator_handles), "write" if push else "read")
        if cell.kind == "pd"
        else None
    )
    layout.write_json(
        cdir / layout.TRANSFER_FILE,
        {
            "cell_id": cell.id,
            **({"transfer_mode": dep.transfer_mode} if cell.kind == "pd" else {}),
            "ucx_transports": ucx,
            **(read_split(dep) if cell.kind == "pd" else {}),
            **cell_transfer(phases, "prefill" if push else "decode"),
        },
    )
    if spent is not None:
        spent["transfer_s"] = spent.get("transfer_s", 0.0) + time.monotonic() - t


def read_split(dep: Deployment) -> dict[str, Any]:
    """From this cell's share of its decode logs: ``transfer_plans`` (vLLM's
    ``TransferTopology`` per prefill engine) and ``reads_by_prefill_rank`` (completed READs
    and NIXL bytes per prefill TP rank, whole cell: warm-up and every phase; None when no
    READ line was logged, e.g. a build without pdsweep's vLLM plugin). In push mode the
    plans and ``writes_by_prefill_rank`` (completed WRITEs per prefill TP rank) come from the
    prefill logs instead. See
    :mod:`pdsweep.engine.readlog`, :func:`pdsweep.core.logscan.nixl_reads_by_rank`."""

    def text_of(handles: list[Any]) -> str:
        offsets = {str(u.handle.log_path): u.log_offset for u in dep.uses}
        text = ""
        for h in handles:
            try:
                with open(h.log_path, errors="replace") as f:
                    f.seek(offsets.get(str(h.log_path), 0))
                    text += f.read()
            except OSError:
                continue
        return text

    decode = text_of(dep.decode_handles)
    if dep.transfer_mode == "push":  # prefill handshakes with decode and WRITEs (nixl/push_worker.py)
        prefill = text_of(dep.role("prefill"))
        return {
            "transfer_plans": transfer_topologies(prefill),
            "reads_by_prefill_rank": None,
            "writes_by_prefill_rank": nixl_writes_by_rank(prefill) or None,
            "read_faults": read_fault_counts(decode),
            "integrity": push_integrity(prefill, decode),  # pdsweep.core.kvpush
        }
    return {
        "transfer_plans": transfer_topologies(decode),
        "reads_by_prefill_rank": nixl_reads_by_rank(decode) or None,
        "read_faults": read_fault_counts(decode),
        "integrity": integrity(text_of(dep.role("prefill")), decode),  # pdsweep.core.kvintegrity
    }


def failed_cell_integrity(dep: Deployment) -> list[str]:
    """The KV integrity reasons (:func:`pdsweep.core.kvintegrity.integrity_reasons`) of a pull or push PD
    cell whose measuring stopped on an error, from its logs so far: a failed cell writes no transfer.json,
    so its status reason must carry what the digests saw (a READ NIXL refused, missing SSM shards).
    Empty when nothing was digested or nothing is wrong."""
    integ = read_split(dep)["integrity"]
    return [] if integ.get("not_measured") else integrity_reasons(integ, "KV digests in the logs so far")


def read_back_blocks(dep: Deployment, planned: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per instance ``{"planned", "runtime", "mismatch"}`` (:func:`pdsweep.plan.runtimeblocks.runtime_blocks`
    from its ``/metrics`` and log; ``planned`` by instance name). A scrape that fails leaves
    the runtime values to the log; nothing here raises."""
    out: dict[str, Any] = {}
    for h in dep.handles:
        try:
            text = scrape_sync(h.url)
        except (httpx.HTTPError, OSError):
            text = None
        try:
            log_text = h.log_path.read_text(errors="replace")
        except OSError:
            log_text = ""
        run = runtime_blocks(text, log_text, nixl=not h.name.startswith("single"))
        plan = planned.get(h.name) or {}
        out[h.name] = {
            "planned": {k: plan.get(k) for k in ("logical", "kernel")},
            "runtime": run,
            "mismatch": mismatches(plan, run),
        }
    return out


def probe_block(cell: Cell, blocks: dict[str, Any] | None) -> tuple[int, str]:
    """The effective decode block the probe prompts are sized from, and where it came from:
    the first decode (or single) instance's read-back value, else the plan's, else the
    configured ``decode_block_size``."""
    role = "single" if cell.kind == "ref" else "decode"
    inst = next((v for k, v in (blocks or {}).items() if k.startswith(role + "-")), None) or {}
    for source in ("runtime", "planned"):
        if (inst.get(source) or {}).get("logical"):
            return int(inst[source]["logical"]), source
    return cell.decode_block_size, "configured"


def collect_probe(
    ls: LoadedSweep, cell: Cell, dep: Deployment, mpath: str, blocks: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Send the consistency prompts (exact token counts: short, several blocks, long)
    greedy with top-1 logprobs, one at a time; the raw outputs are judged later against
    the reference cell's (:mod:`pdsweep.judge.verdicts`). A reference cell also runs
    :func:`pdsweep.measure.probe.path_check` per prompt (``eval.consistency.triage``).
    A failed request is recorded in the prompt's ``error`` (the judge fails it), never raised."""
    import asyncio

    model = ls.catalogue.models[cell.model]
    spec = ls.sweep.eval.consistency
    max_len = ls.sweep.defaults.max_model_len or model.max_model_len
    block, source = probe_block(cell, blocks)
    text = probe_text(spec.text, model.tiny is not None and model.tiny.train is not None)
    prompts = build_prompts(
        model.tokenizer or mpath, block, max_len, spec.lengths, spec.max_tokens, text, model.trust_remote_code
    )
    sizing = {"block_size": block, "block_source": source, "max_model_len": max_len, "text": text}
    cap = max_len - spec.max_tokens - 1
    if "blocks" in spec.lengths and cap < 3 * block:
        sizing["note"] = (
            f"max_model_len {max_len} holds no 3 effective blocks of {block} tokens (with "
            f"max_tokens {spec.max_tokens}): the 'blocks' prompt is {cap} tokens, "
            f"{cap / block:.2f} blocks"
        )

    async def go() -> list[dict[str, Any]]:
        rows = []
        async with httpx.AsyncClient(timeout=ls.sweep.defaults.request_timeout_s) as client:
            for p in prompts:
                row: dict[str, Any] = {
                    "name": p.name,
                    "prompt_tokens": p.num_tokens,
                    "tokens": [],
                    "token_logprobs": [],
                    "error": None,
                }
                url = completions_url(dep.url)
                try:
                    row["tokens"], row["token_logprobs"] = await complete(client, url, cell.model, p, spec.max_tokens)
                except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
                    row["error"] = f"request failed: {type(e).__name__}: {e}"
                if cell.kind == "ref" and spec.triage and not row["error"]:
                    row["path_check"] = await path_check(
                        client, url, cell.model, p, row["tokens"], row["token_logprobs"]
                    )
                rows.append(row)
        return rows

    return {"max_tokens": spec.max_tokens, "sizing": sizing, "prompts": asyncio.run(go())}


def run_load(ls: LoadedSweep, cell: Cell, dep: Deployment, mpath: str, cdir: Path) -> dict[str, Any]:
    """One repeat of the load phase's performance runs: with a ``random`` workload, ``vllm
    bench serve`` (random dataset, local tokenizer; in this process when it can be:
    :mod:`pdsweep.measure.benchserve`) at each concurrency of the sweep's ``bench`` section
    (``runs``), each within :func:`pdsweep.plan.budgets.bench_budget_s`.
    :func:`pdsweep.measure.repeats.run_repeats` loops it; the checked workloads
    (:func:`run_checked`) run once after the repeats. Returns ``{"runs": [...]}``, each run with
    ``driver_s`` (its wall seconds, start-up included). Raises ``CellFailed('bench')`` past a
    budget, RuntimeError on a non-zero exit."""
    b = ls.sweep.bench
    python = json.loads((cdir / "cell.json").read_text())["build"]["python"]
    model = ls.catalogue.models[cell.model]
    runs = []
    for conc in b.concurrencies if any(w.name == "random" for w in b.workloads) else []:
        stop_if_ended(dep.handles, f"vllm bench serve (concurrency {conc})")
        load = benchserve.LoadRun(
            dep.url,
            cell.model,
            model.tokenizer or mpath,
            model.trust_remote_code,
            b.input_len,
            b.output_len,
            b.num_prompts,
            conc,
            cdir / "logs",
            f"load-c{conc}.json",
            tuple((b.goodput or {}).items()),
        )
        budget = bench_budget_s(b, ls.sweep.defaults, conc)
        try:
            rc, secs = benchserve.run(python, load, cdir / "logs" / f"load-c{conc}.log", budget)
        except TimeoutError:
            raise CellFailed(
                "bench",
                f"vllm bench serve (concurrency {conc}) exceeded its wall-clock budget of "
                f"{budget:.0f} s (bench phase); see logs/load-c{conc}.log",
            ) from None
        if rc != 0:
            raise RuntimeError(f"vllm bench serve (concurrency {conc}) exited {rc}; see logs/load-c{conc}.log")
        run = benchserve.figures(benchserve.read_result(load), load)
        run["driver_s"] = secs  # the call, start-up included; the harness overhead is driver_s - duration_s
        runs.append(run)
    return {"runs": runs}


def decode_kv_bytes(dep: Deployment) -> float | None:
    """Cumulative ``vllm:nixl_bytes_transferred`` sum (bytes) over the decode instances'
    /metrics; None when one cannot be scraped or has no such histogram (the byte check then
    has no number: fails closed)."""
    total = 0.0
    for h in dep.decode_handles:
        try:
            hist = parse(scrape_sync(h.url)).histograms.get(NIXL_BYTES)
        except (httpx.HTTPError, OSError, ValueError):
            return None
        if hist is None:
            return None
        total += hist.sum
    return total


def run_checked(
    ls: LoadedSweep, cell: Cell, dep: Deployment, mpath: str, blocks: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Every ``bench.workloads`` entry (:mod:`pdsweep.measure.workloads`) through pdsweep's
    client (:func:`pdsweep.measure.loadrun.run_workload`): on a PD cell at each
    ``bench.concurrencies`` point, on the reference cell once at concurrency 1 (its answers
    are the reference). Raises ``CellFailed('bench')`` past a run's budget."""
    b, d = ls.sweep.bench, ls.sweep.defaults
    model = ls.catalogue.models[cell.model]
    max_len = d.max_model_len or model.max_model_len
    block, _ = probe_block(cell, blocks)
    text = probe_text(ls.sweep.eval.consistency.text, model.tiny is not None and model.tiny.train is not None)
    concs = [1] if cell.kind == "ref" else list(b.concurrencies)
    kv = (lambda: decode_kv_bytes(dep)) if cell.kind == "pd" else (lambda: None)
    target = WorkloadTarget(completions_url(dep.url), cell.model, d.request_timeout_s, kv)
    out = []
    for w in b.workloads:
        reqs = build(w, b, model.tokenizer or mpath, block, max_len, text, model.trust_remote_code)
        for conc in concs:
            stop_if_ended(dep.handles, f"load workload {w.name} (concurrency {conc})")
            budget = b.budget_s or budget_s(reqs, conc, d.request_timeout_s)
            try:
                out.append(run_workload(target, w.name, reqs, conc, budget))
            except TimeoutError:
                raise CellFailed(
                    "bench", f"load workload {w.name} (concurrency {conc}) exceeded its budget of {budget:.0f} s"
                ) from None
    return out
