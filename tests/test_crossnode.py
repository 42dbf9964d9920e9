"""Loopback addresses on a path between hosts are refused at plan time, naming the field
(pdsweep/plan/crossnode.py, issue 39)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdsweep.core.errors import UserError
from pdsweep.plan.crossnode import cross_host, is_loopback, names_loopback
from pdsweep.plan.expand import expand
from pdsweep.plan.instance import Slot, instances
from pdsweep.plan.placement import Cluster
from pdsweep.run.dryrun import plan_dict
from pdsweep.sweepfile.sweep import load_sweep

SMOKE = Path(__file__).resolve().parent.parent / "sweeps" / "cpu-smoke.yaml"
PD = "tiny-llama.p1d1.b32-32.fixed"
TWO_HOSTS = ("10.231.39.11", "10.231.39.12")


def _cells(d: dict) -> dict:
    return {c["id"]: c for c in d["cells"]}


def test_loopback_spellings():
    for a in ("127.0.0.1", "127.3.2.1", "localhost", "LOCALHOST.", "::1", "[::1]", "ip6-localhost", "n1.localhost"):
        assert is_loopback(a), a
    for a in ("10.231.39.11", "node1", "0.0.0.0", "::", "mylocalhost", "128.0.0.1"):
        assert not is_loopback(a), a
    assert names_loopback("http://127.0.0.1:8000/v1") and names_loopback('{"host":"localhost"}')
    assert names_loopback("[::1]:5557") and not names_loopback("/models/localhost-llama")
    assert cross_host(["n1", "n2"], TWO_HOSTS) and not cross_host(["n1", "n2"], ["127.0.0.1"] * 2)
    assert not cross_host(["", ""], ["127.0.0.1", "10.0.0.1"])


def test_two_hosts_plan_hands_out_node_addresses():
    d = plan_dict(str(SMOKE), None, PD, Cluster(("n1", "n2"), 0, TWO_HOSTS))
    pre, dec = _cells(d)[PD]["instances"]
    for inst, addr in ((pre, TWO_HOSTS[0]), (dec, TWO_HOSTS[1])):
        assert inst["host"] == addr
        assert inst["argv"][inst["argv"].index("--host") + 1] == addr
        assert inst["env"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == addr


def test_nodes_sharing_loopback_are_one_host():
    """tests/_slurm.py: two slurmd on this machine, both NodeAddr=127.0.0.1 (one host)."""
    d = plan_dict(str(SMOKE), None, PD, Cluster(("n1", "n2"), 0, ("127.0.0.1", "127.0.0.1")))
    assert [i["host"] for i in _cells(d)[PD]["instances"]] == ["127.0.0.1", "127.0.0.1"]


def test_planted_loopback_node_addr_fails_the_plan_naming_fields():
    with pytest.raises(UserError) as e:
        plan_dict(str(SMOKE), None, PD, Cluster(("n1", "n2"), 0, (TWO_HOSTS[0], "127.0.0.1")))
    msg = str(e.value)
    assert f"cell {PD}: loopback address on a path between hosts" in msg
    assert "decode-0 (node n2) host=127.0.0.1" in msg
    assert "decode-0 (node n2) argv --host 127.0.0.1" in msg
    assert "decode-0 (node n2) env VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1" in msg
    assert "prefill-0" not in msg  # its address is reachable


@pytest.mark.parametrize(
    ("var", "val", "named"),
    [
        ("PDSWEEP_TEST_URL", "http://localhost:9000/x", "env PDSWEEP_TEST_URL=http://localhost:9000/x"),
        ("UCX_NET_DEVICES", "lo", "env UCX_NET_DEVICES=lo (UCX on the loopback interface only)"),
    ],
)
def test_planted_loopback_in_env_fails_on_two_hosts_only(var, val, named):
    ls = load_sweep(SMOKE)
    ls.sweep.env["base"][var] = val
    cell = next(c for c in expand(ls).cells if c.id == PD)
    two = Slot(0, (), 30000, hosts=TWO_HOSTS, nodes=("n1", "n2"))
    with pytest.raises(UserError, match="prefill-0 \\(node n1\\) " + named.replace("(", "\\(").replace(")", "\\)")):
        instances(cell, two, ls, "/m", "python")
    one = Slot(0, (), 30000)
    assert [i.host for i in instances(cell, one, ls, "/m", "python")] == ["127.0.0.1"] * 2


def test_run_refuses_a_loopback_node_addr_of_a_multi_host_allocation():
    from pdsweep.plan.crossnode import loopback_node_addrs

    assert loopback_node_addrs(("n1", "n2"), ("10.231.39.11", "localhost")) == ["node n2 NodeAddr=localhost"]
    assert loopback_node_addrs(("n1", "n2"), ("127.0.0.1", "127.0.0.1")) == []  # one host (tests/_slurm.py)
    assert loopback_node_addrs(("n1", "n2"), TWO_HOSTS) == []


def test_run_with_a_planted_loopback_node_addr_is_refused_before_any_write(monkeypatch, tmp_path):
    import types

    import pdsweep.deploy.launchers as launchers
    from pdsweep.run.context import RunOptions
    from pdsweep.run.sweep import launcher_cluster

    fake = types.SimpleNamespace(
        nodes=["pdsweep-n1", "pdsweep-n2"],
        addrs={"pdsweep-n1": "10.231.39.11", "pdsweep-n2": "127.0.0.1"},
        gpus_per_node=0,
    )
    monkeypatch.setattr(launchers, "make_launcher", lambda name: fake)
    with pytest.raises(UserError, match=r"loopback address: node pdsweep-n2 NodeAddr=127\.0\.0\.1 \(scontrol"):
        launcher_cluster(load_sweep(SMOKE), RunOptions(out=tmp_path / "run", launcher="slurm"))
    assert not (tmp_path / "run").exists()
    fake.addrs["pdsweep-n2"] = "10.231.39.12"
    _, cluster = launcher_cluster(load_sweep(SMOKE), RunOptions(out=tmp_path / "run", launcher="slurm"))
    assert cluster is not None and cluster.addrs == TWO_HOSTS
