"""Two runs on one host never take the same port block (pdsweep.deploy.portlocks): a block is
claimed with an flock that another process (another ``pdsweep run``) sees before any vLLM of
the first listens, and that the kernel drops when the claiming process dies."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from _fakerun import PORT_BASE, make_sweep, status
from _fakerun import tok as tok

from pdsweep.deploy.portblocks import AltBlocks, PortBlocks
from pdsweep.deploy.portlocks import LOCK_DIR_ENV, HostClaims
from pdsweep.plan.instance import PORTS_PER_SLOT, Slot

# A range no other test uses, below Linux's ephemeral ports (ip_local_port_range, 32768-60999 by
# default): the kernel hands those to any client socket on the host, and a test's lane that another
# test's connection happens to hold moves to an alternate block (CI stop 61: 47000 -> 59800).
BASE = 6000


@pytest.fixture(autouse=True)
def own_dir(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv(LOCK_DIR_ENV, str(tmp_path / "locks"))
    return tmp_path / "locks"


def other_run(lock_dir: Path, base: int) -> subprocess.Popen:
    """A process that claims ``base`` and keeps it until killed (it prints ``held`` first)."""
    code = (
        "import sys, time\nfrom pathlib import Path\nfrom pdsweep.deploy.portlocks import HostClaims\n"
        f"c = HostClaims(Path({str(lock_dir)!r}))\nassert c.claim({base})\nprint('held', flush=True)\ntime.sleep(60)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


def test_a_block_claimed_by_another_run_is_skipped_until_that_run_dies(own_dir: Path) -> None:
    other = other_run(own_dir, BASE)
    try:
        blocks = PortBlocks()
        assert blocks.claim([BASE, BASE + 16], lambda b: True) == BASE + 16  # BASE is the other run's
    finally:
        other.kill()
        other.wait()
    assert blocks.claim([BASE], lambda b: True) == BASE  # the kernel dropped the dead run's claim


def test_a_released_block_is_free_for_another_claimant_and_a_refused_one_is_not_kept(own_dir: Path) -> None:
    a, b = PortBlocks(), PortBlocks()  # two runs in one process: two open files, so they exclude too
    assert a.claim([BASE], lambda _: True) == BASE
    assert b.claim([BASE], lambda _: True) is None
    assert b.claim([BASE + 16], lambda _: False) is None  # ports busy: no claim left behind
    assert HostClaims(own_dir).claim(BASE + 16)
    a.release(BASE)
    assert b.claim([BASE], lambda _: True) == BASE


def test_a_cell_whose_lane_another_run_claims_moves_to_an_alternate_block(own_dir: Path) -> None:
    slot = Slot(0, (), BASE)
    other = HostClaims(own_dir / "..")  # not the same directory: no effect
    assert other.claim(BASE)
    alt = AltBlocks()
    got, _ = alt.free_slot(slot, [], proxy_only=True)
    assert got == slot  # nothing claims the lane where runs claim
    rival = HostClaims(own_dir)
    assert not rival.claim(BASE)  # this run holds its lane while the cell runs
    alt.release(got)
    assert rival.claim(BASE)  # now another run has it
    moved, _ = alt.free_slot(slot, [], proxy_only=True)
    assert moved.port_base >= BASE + 64 * PORTS_PER_SLOT
    alt.release(moved)


def test_two_runs_started_together_with_one_port_base_both_pass(tmp_path: Path, tok: Path, monkeypatch) -> None:
    """The fault: vLLM binds its ports seconds after it starts, so two runs started together
    with one ``port_base`` both saw lane 0 free and one's instances died binding it (before the
    claims both runs' cells failed: ``OSError: [Errno 98] Address already in use``)."""
    monkeypatch.delenv(LOCK_DIR_ENV)  # the host's claim directory, as two users' runs share it
    sweep = make_sweep(
        tmp_path,
        tok,
        env="  base: {FAKE_BIND_AFTER_S: '3'}",
        matrix="  model: [fake-gqa]\n  tp: [p1d1]\n",
        extra="  reference: false\n",
        port_base=PORT_BASE + 100,
    )
    runs = [
        subprocess.Popen(
            [sys.executable, "-m", "pdsweep", "run", str(sweep), "--out", str(tmp_path / f"run{i}"), "--quiet"]
            + ["--skip-eval", "--no-history", "--no-reuse", "--no-preflight"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in (0, 1)
    ]
    outs = [p.communicate(timeout=240)[0] for p in runs]
    got = [status(tmp_path / f"run{i}", "fake-gqa.p1d1.b16-16.fixed") for i in (0, 1)]
    assert [g["status"] for g in got] == ["ok", "ok"], (got, outs)
    ports = [{i["port"] for i in g["instances"]} for g in got]
    assert not ports[0] & ports[1], ports


def test_closing_gives_every_claim_back_and_a_dropped_object_does_too(own_dir: Path) -> None:
    """A run's end closes its claims (pdsweep.run.sweep: ctx.alt.close(), the pool's blocks); an
    object dropped without close() lets go of its flocks when collected."""
    blocks = PortBlocks()
    assert blocks.claim([BASE], lambda _: True) == BASE and blocks.claim([BASE + 16], lambda _: True) == BASE + 16
    rival = HostClaims(own_dir)
    assert not rival.claim(BASE) and not rival.claim(BASE + 16)
    blocks.close()
    assert rival.claim(BASE) and rival.claim(BASE + 16) and blocks.claimed == set()
    rival.close()
    lost = HostClaims(own_dir)
    assert lost.claim(BASE)
    del lost
    import gc

    gc.collect()
    assert HostClaims(own_dir).claim(BASE)
