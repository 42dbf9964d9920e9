"""Gate check: a PD cell READ its KV over the UCX transport the sweep expects
(``gate.transports``, e.g. ``[cma]`` on one CPU host, ``[cuda_ipc]`` or ``[rc]`` on GPUs).
UCX falls back to ``tcp`` silently when the expected transport is unusable (vllm issue 52607:
pull mode over cuda_ipc fell back to TCP, 0.5 vs 49 GB/s); the cell then passes every other
check at a fraction of the bandwidth. The transports are transfer.json ``ucx_transports``
(:func:`pdsweep.measure.metrics.ucx_transports_from_logs`: UCX's "remote memory read"
protocol tables, ``UCX_PROTO_INFO=y``), spelled ``<transport>/<device>`` (``cma/memory``,
``tcp/eth0``: the device is the network interface).

The expectation depends on the cell's placement (cell.json ``instances[].node`` and
``host``): on one host ``gate.transports``; when prefill and decode run on different hosts
(:func:`pdsweep.plan.crossnode.cross_host`: more than one node and more than one address)
``gate.transports_cross_host`` (e.g. ``[tcp]``, ``[rc]``): shared-memory transports (``cma``,
``posix``, ``cuda_ipc``) cannot cross hosts, so a one-host expectation does not apply there and
a cross-host cell with none fails closed.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdsweep.judge.facts import CellFiles, show
from pdsweep.plan.crossnode import cross_host
from pdsweep.results import layout


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
class TransportCheck:
    """Fails a PD cell whose READs used a transport outside the expectation of its
    placement (``expected`` on one host, ``across_hosts`` across hosts; empty: none given),
    naming the transports used and expected, or whose transports are unknown (fail closed)."""

    expected: tuple[str, ...]
    across_hosts: tuple[str, ...] = ()
    name: str = "transport"

    def applies(self, kind: str) -> bool:
        return kind != "ref"

    def fails(self, files: CellFiles) -> list[str]:
        tr = files.get(layout.TRANSFER_FILE)
        if tr is None:
            return [files.problem(layout.TRANSFER_FILE)]
        w = files.where(layout.TRANSFER_FILE)
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
        used = tr.get("ucx_transports")
        if not isinstance(used, list) or not used:
            return [
                f"{w}: ucx_transports is {show(used)}: the UCX READ transport is unknown (expected: {want}; "
                "no UCX protocol table in the decode logs, UCX_PROTO_INFO=y)"
            ]
        bad = [u for u in map(str, used) if not any(matches(transport_name(u), e) for e in expected)]
        if bad:
            fell = " (fell back to tcp)" if not hosts and any(transport_name(u) == "tcp" for u in bad) else ""
            return [f"{w}: KV READ over UCX transport(s) {', '.join(map(str, used))}{fell}; expected: {want}"]
        return []
