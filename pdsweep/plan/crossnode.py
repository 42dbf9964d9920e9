"""Addresses on a cross-host path (issue 39): a PD cell whose instances sit on different
hosts must hand out each node's reachable address, never a loopback one.

What crosses hosts, per instance (:class:`pdsweep.plan.instance.InstanceSpec`):

- ``host``: where pdsweep polls readiness (``http://HOST:PORT/health``) and where the PD
  proxy, running on the host of pdsweep, sends its requests (the proxy's upstreams);
- ``argv --host``: the address ``vllm serve`` binds (vllm/entrypoints/openai/cli_args.py);
- ``env VLLM_NIXL_SIDE_CHANNEL_HOST``: the NIXL side channel the prefill listens on and
  returns to decode as ``remote_host`` in ``kv_transfer_params`` (vLLM
  ``kv_connector/v1/nixl`` ``NixlConnectorScheduler``; vllm/envs.py default ``localhost``);
- any other env value or argv item naming a loopback address (a URL, ``host:port``);
- ``env UCX_NET_DEVICES`` naming ``lo``: UCX would read KV only over loopback
  (UCX ``ucs/config``; ``lo`` is the loopback interface).

"Different hosts": the cell's instances run on more than one node *and* those nodes have
more than one address. Nodes sharing one address are one machine (several ``slurmd`` on one
host: tests/_slurm.py), where loopback reaches every instance. A loopback address on a
node list with other addresses is a misconfigured ``NodeAddr`` (or a planted one), refused
at plan time naming the instance and field.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Sequence
from typing import Protocol

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
# a loopback literal as a whole token inside a longer value (URL, host:port, JSON)
_IN_TEXT = re.compile(
    r"(?:^|[\s/@\"'\[=,(])(127\.\d{1,3}\.\d{1,3}\.\d{1,3}|localhost|::1)(?=$|[\s:/\"'\],)])", re.IGNORECASE
)


class _Spec(Protocol):  # pdsweep.plan.instance.InstanceSpec (frozen: read-only attributes)
    @property
    def name(self) -> str: ...
    @property
    def host(self) -> str: ...
    @property
    def node(self) -> str: ...
    @property
    def argv(self) -> Sequence[str]: ...
    @property
    def env(self) -> dict[str, str]: ...


def is_loopback(addr: str) -> bool:
    """``addr`` (an IP address, optionally ``[bracketed]``, or a host name) is a loopback
    address: 127.0.0.0/8, ``::1``, ``localhost`` and its aliases (/etc/hosts of Debian),
    or a name under ``.localhost`` (RFC 6761)."""
    a = addr.strip().strip("[]").lower().rstrip(".")
    if a in LOOPBACK_NAMES or a.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(a).is_loopback
    except ValueError:
        return False


def names_loopback(text: str) -> bool:
    """``text`` is, or contains as a token (URL host, ``host:port``, JSON string), a
    loopback address."""
    return is_loopback(text) or bool(_IN_TEXT.search(text))


def cross_host(nodes: Iterable[str], hosts: Iterable[str]) -> bool:
    """Instances on these ``nodes`` (empty: this host) with these ``hosts`` (addresses) span
    more than one machine: more than one node and more than one address."""
    return len({n for n in nodes if n}) > 1 and len(set(hosts)) > 1


def loopback_fields(specs: Sequence[_Spec]) -> list[str]:
    """``"INSTANCE (node NODE) FIELD=VALUE"`` for every loopback address on a cross-host
    path of one cell's ``specs``; empty when the cell runs on one host."""
    if not cross_host((s.node for s in specs), (s.host for s in specs)):
        return []
    out: list[str] = []
    for s in specs:
        where = f"{s.name} (node {s.node})"
        if is_loopback(s.host):
            out.append(f"{where} host={s.host} (its readiness URL and the proxy's upstream; the node's NodeAddr)")
        argv = list(s.argv)
        for i, item in enumerate(argv):
            if item == "--host" and i + 1 < len(argv) and is_loopback(argv[i + 1]):
                out.append(f"{where} argv --host {argv[i + 1]}")
            elif item.startswith("--host=") and is_loopback(item.split("=", 1)[1]):
                out.append(f"{where} argv {item}")
            elif i and argv[i - 1] != "--host" and not item.startswith("--host=") and names_loopback(item):
                out.append(f"{where} argv {item!r}")
        for var, val in s.env.items():
            if var == "UCX_NET_DEVICES" and any(d.split(":")[0].strip() == "lo" for d in str(val).split(",")):
                out.append(f"{where} env UCX_NET_DEVICES={val} (UCX on the loopback interface only)")
            elif names_loopback(str(val)):
                out.append(f"{where} env {var}={val}")
    return out


def loopback_node_addrs(nodes: Sequence[str], addrs: Sequence[str]) -> list[str]:
    """``"node N NodeAddr=A"`` for each node of an allocation whose address is loopback while
    other nodes have other addresses (nodes on more than one host): every cell placed across
    such a node would hand the loopback address to the other host. Empty for one host."""
    if len(set(addrs)) < 2:
        return []
    return [f"node {n} NodeAddr={a}" for n, a in zip(nodes, addrs) if is_loopback(a)]
