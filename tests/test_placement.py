"""Placement over nodes x GPUs (pdsweep/plan/placement.py) and `pdsweep plan --nodes/--gpus-per-node`:
a TP group within one node, P and D on different nodes when that is what fits, disjoint
(node, GPU) pairs for concurrent cells, "needs N GPUs on M nodes" for what never fits.
Two-node behaviour is shown here with named fake nodes (the real Slurm tests run one node)."""

import json
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from pdsweep.cli import main
from pdsweep.plan.expand import Cell, expand
from pdsweep.plan.instance import PORTS_PER_SLOT, instances
from pdsweep.plan.placement import Cluster, ClusterPool, fit_groups, groups, min_nodes, needs
from pdsweep.plan.schedule import pack
from pdsweep.run.dryrun import plan_dict
from pdsweep.sweepfile.sweep import load_sweep

SWEEPS = Path(__file__).resolve().parent.parent / "sweeps"
HYBRID = SWEEPS / "hybrid-mla-mamba.yaml"


def cell(p: int, d: int, n_p: int = 1, n_d: int = 1, dp: int = 1) -> Cell:
    return Cell("m", p, d, 16, 16, n_p, n_d, "cuda", "fixed", decode_dp=dp)


def test_groups_follow_instance_order():
    assert groups(cell(8, 4)) == [8, 4]
    assert groups(cell(2, 1, n_p=2, n_d=3)) == [2, 2, 1, 1, 1]
    assert groups(cell(1, 2, dp=2)) == [1, 4]
    assert groups(cell(4, 2).reference()) == [2]


def test_p8d4_splits_prefill_and_decode_over_two_nodes():
    got = fit_groups([8, 4], {"a": list(range(8)), "b": list(range(8))})
    assert got == [("a", tuple(range(8))), ("b", (0, 1, 2, 3))]
    assert fit_groups([8, 4], {"a": list(range(8))}) is None
    # best fit: the 2-GPU group goes where 2 are left, keeping the emptier node whole
    assert fit_groups([2], {"a": [6, 7], "b": list(range(8))}) == [("a", (6, 7))]


def test_needs_names_gpus_and_nodes():
    one = Cluster.synthetic(1, 8)
    assert needs(cell(8, 4), one) == "needs 12 GPUs on 2 nodes, allocation has 1 node x 8 GPUs"
    assert needs(cell(8, 1), Cluster.synthetic(2, 8)) is None
    assert needs(cell(16, 1), Cluster.synthetic(4, 8)) == (
        "needs 16 GPUs on one node for one TP group (17 GPUs in all), allocation has 4 nodes x 8 GPUs"
    )
    assert min_nodes([8, 4, 4, 2], 8) == 3 and min_nodes([9], 8) == 0
    cpu = Cell("m", 2, 1, 32, 32, 1, 1, "cpu", "fixed", platform="cpu")
    assert needs(cpu, Cluster(("vm",), 0)) is None


def test_pool_release_returns_node_gpus():
    pool = ClusterPool(Cluster.synthetic(2, 8), 20000)
    s1 = pool.try_acquire(cell(8, 4))
    assert s1.hosts == ("node0", "node1") and s1.gpus == (*range(8), 0, 1, 2, 3)
    s2 = pool.try_acquire(cell(2, 2))
    assert s2.hosts == ("node1", "node1") and s2.gpus == (4, 5, 6, 7) and s2.index == 1
    assert pool.try_acquire(cell(1, 1)) is None
    pool.release(s1)
    assert pool.free == {"node0": list(range(8)), "node1": [0, 1, 2, 3]}
    s3 = pool.try_acquire(cell(8, 4))  # the lane and GPUs came back
    assert (s3.index, s3.hosts, s3.gpus) == (0, ("node0", "node1"), (*range(8), 0, 1, 2, 3))
    assert pool.try_acquire(cell(1, 1)) is None


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 8), st.integers(1, 8), st.integers(1, 2)), min_size=1, max_size=20),
    st.integers(1, 4),
    st.integers(1, 8),
)
def test_concurrent_cells_never_share_node_gpus_or_ports(shapes, n_nodes, gpn):
    cells = [Cell(f"m{i}", p, d, 16, 16, 1, n, "cuda", "fixed") for i, (p, d, n) in enumerate(shapes)]
    cluster = Cluster.synthetic(n_nodes, gpn)
    s = pack(cells, cluster.num_gpus, pool=ClusterPool(cluster, 20000))
    assert len(s.placements) + len(s.too_big) == len(cells)
    assert all(needs(c, cluster) for c in s.too_big)
    for i, a in enumerate(s.placements):
        insts = s.to_dict()["placements"][i]["instances"]
        assert [len(x["gpus"]) for x in insts] == groups(a.cell)  # each TP group on one node
        assert all(max(x["gpus"]) < gpn for x in insts)
        pairs_a = {(x["node"], g) for x in insts for g in x["gpus"]}
        assert len(pairs_a) == a.cell.num_gpus
        for j, b in enumerate(s.placements[i + 1 :], start=i + 1):
            if a.start_s < b.end_s and b.start_s < a.end_s:
                pairs_b = {(x["node"], g) for x in s.to_dict()["placements"][j]["instances"] for g in x["gpus"]}
                assert not pairs_a & pairs_b
                assert abs(a.slot.port_base - b.slot.port_base) >= PORTS_PER_SLOT


def test_mission_sweep_places_every_cell_on_2x8():
    d = plan_dict(str(HYBRID), None, None, Cluster.synthetic(2, 8))
    assert d["schedule"]["needs_more_gpus"] == []
    n_cells = len(expand(load_sweep(HYBRID)).cells) - len(d["folded"])  # a folded cell runs as another
    assert len(d["schedule"]["placements"]) == n_cells == len(d["cells"])
    big = {c["id"]: c for c in d["cells"]}["kimi-linear.p8d4.b128-128.fixed"]
    pre, dec = big["instances"]
    assert pre["node"] != dec["node"] and len(pre["gpus"]) == 8 and len(dec["gpus"]) == 4
    for inst in (pre, dec):  # served on its node; NIXL side channel announced at its node
        assert inst["argv"][inst["argv"].index("--host") + 1] == inst["host"]
        assert inst["env"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == inst["host"]
        assert inst["env"]["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, inst["gpus"]))


def test_plan_cli_nodes(capsys):
    assert main(["plan", str(HYBRID), "--nodes", "2", "--gpus-per-node", "8", "--cells", "kimi-linear.p8d4*"]) == 0
    out = capsys.readouterr().out
    assert "not scheduled" not in out
    # the reference holds node0:0-3 from t=0, so p8d4.fixed takes node1 whole and node0's other half
    assert "prefill-0@node1:0-7 decode-0@node0:4-7 kimi-linear.p8d4.b128-128.fixed" in out
    assert "single-0@node0:0-3 kimi-linear.ref-tp4.b128.fixed" in out
    assert (
        main(
            [
                "plan",
                str(HYBRID),
                "--nodes",
                "1",
                "--gpus-per-node",
                "8",
                "--cells",
                "kimi-linear.p8d4*",
                "--format",
                "json",
            ]
        )
        == 0
    )
    d = json.loads(capsys.readouterr().out)
    assert {x["reason"] for x in d["schedule"]["needs_more_gpus"]} == {
        "needs 12 GPUs on 2 nodes, allocation has 1 node x 8 GPUs",
        # its reference: only the p8d4 cells are compared with it
        "reference of NOT-RUNNABLE cells only (2, e.g. kimi-linear.p8d4.b128-128.fixed): nothing to compare",
    }
    assert main(["plan", str(HYBRID), "--nodes", "2"]) == 2
    assert "--gpus-per-node" in capsys.readouterr().err


def test_single_host_plan_is_unchanged():
    ls = load_sweep(SWEEPS / "cpu-smoke.yaml")
    c = expand(ls).pd_cells[0]
    slot = pack([c], 0).placements[0].slot
    specs = instances(c, slot, ls, "/m", "python")
    assert {s.host for s in specs} == {"127.0.0.1"}
    assert all("VLLM_NIXL_SIDE_CHANNEL_HOST" not in s.env for s in specs)
    assert specs[0].argv[specs[0].argv.index("--host") + 1] == "127.0.0.1"
