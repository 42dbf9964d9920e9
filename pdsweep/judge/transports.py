"""Gate check: a PD cell READ its KV over the UCX transport the sweep expects
(``gate.transports``, e.g. ``[cma]`` on one CPU host, ``[cuda_ipc]`` or ``[rc]`` on GPUs).
UCX falls back to ``tcp`` silently when the expected transport is unusable (vllm issue 52607:
pull mode over cuda_ipc fell back to TCP, 0.5 vs 49 GB/s); the cell then passes every other
check at a fraction of the bandwidth. The transports are transfer.json ``ucx_transports``
(:func:`pdsweep.measure.metrics.ucx_transports_from_logs`: UCX's "remote memory read"
protocol tables, ``UCX_PROTO_INFO=y``), spelled ``<transport>/<device>`` (``cma/memory``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdsweep.judge.facts import CellFiles, show
from pdsweep.results import layout


def transport_name(t: str) -> str:
    """``cma/memory`` -> ``cma``; ``rc_mlx5/mlx5_0:1`` -> ``rc_mlx5``."""
    return t.split("/", 1)[0].strip()


def matches(used: str, expected: str) -> bool:
    """``used`` (a UCX transport name) is ``expected`` or a flavour of it (``rc_mlx5`` is ``rc``)."""
    return used == expected or used.startswith(expected + "_")


@dataclass(frozen=True)
class TransportCheck:
    """Fails a PD cell whose READs used a transport outside ``expected`` (naming the
    transports used and expected), or whose transports are unknown (fail closed)."""

    expected: tuple[str, ...]
    name: str = "transport"

    def applies(self, kind: str) -> bool:
        return kind != "ref"

    def fails(self, files: CellFiles) -> list[str]:
        tr = files.get(layout.TRANSFER_FILE)
        if tr is None:
            return [files.problem(layout.TRANSFER_FILE)]
        w = files.where(layout.TRANSFER_FILE)
        want = ", ".join(self.expected)
        used = tr.get("ucx_transports")
        if not isinstance(used, list) or not used:
            return [
                f"{w}: ucx_transports is {show(used)}: the UCX READ transport is unknown (expected: {want}; "
                "no UCX protocol table in the decode logs, UCX_PROTO_INFO=y)"
            ]
        bad = [u for u in map(str, used) if not any(matches(transport_name(u), e) for e in self.expected)]
        if bad:
            fell = " (fell back to tcp)" if any(transport_name(u) == "tcp" for u in bad) else ""
            return [f"{w}: KV READ over UCX transport(s) {', '.join(map(str, used))}{fell}; expected: {want}"]
        return []
