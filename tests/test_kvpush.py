"""Push-mode KV integrity (issue 58, "Push mode: digest the WRITE targets"): prefill digests the source
rows of each WRITE vLLM's push worker posts (pdsweep.engine.kvpushdigest), decode digests its destination
blocks once every WRITE was notified, pdsweep.core.kvpush joins them on decode's agent and addresses."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import types

import pytest
from conftest import FakeNixl, kv_worker

from pdsweep.core.kvintegrity import integrity_reasons
from pdsweep.core.kvlines import PUSHED_TAG, WRITE_TAG, parse_pushed, parse_writes
from pdsweep.core.kvpush import push_integrity
from pdsweep.engine import kvdigest as K
from pdsweep.engine import kvpushdigest as KP


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()[:16]


def addr_of(buf: bytearray) -> int:
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))


def push_nixl() -> FakeNixl:
    cls = types.new_class("PushWrapped", (FakeNixl,))
    cls.get_xfer_descs = K.wrap_get_xfer_descs(FakeNixl.get_xfer_descs)
    cls.prep_xfer_dlist = K.wrap_prep_xfer_dlist(FakeNixl.prep_xfer_dlist)
    cls.make_prepped_xfer = KP.wrap_make_prepped_xfer(FakeNixl.make_prepped_xfer)
    nixl = FakeNixl()
    nixl.__class__ = cls
    return nixl


def prefill_writes(p_mem: bytearray, d_mem: bytearray, blocks: list[int], d_blocks: list[int], caplog) -> str:
    """Prefill's path (vLLM push_worker ``_xfer_blocks``): prepare its own rows and decode's, then WRITE
    ``blocks`` into decode's ``d_blocks`` (descriptor ids from vLLM's ``_compute_desc_ids``)."""
    p, d = kv_worker(addr_of(p_mem), agent="p-agent"), kv_worker(addr_of(d_mem), agent="d-agent")
    nixl = push_nixl()
    lh = nixl.prep_xfer_dlist("NIXL_INIT_AGENT", nixl.get_xfer_descs(p.src_blocks_data, "DRAM"))
    rh = nixl.prep_xfer_dlist(b"d-agent", nixl.get_xfer_descs(d.src_blocks_data, "DRAM"))

    def xfer_blocks(self, read_spec, dst_engine_id, request_id, remote_request_id, **_):
        ids = dict(dst_num_blocks=10, block_size_ratio=None, physical_blocks_per_logical=1)
        lids = p._compute_desc_ids(block_ids=read_spec.local_block_ids, **ids)
        rids = d._compute_desc_ids(block_ids=read_spec.remote_block_ids, **ids)
        return nixl.make_prepped_xfer("WRITE", lh, lids, rh, rids, notif_msg=f"{remote_request_id}:1".encode())

    spec = types.SimpleNamespace(remote_rank=0, local_block_ids=[blocks], remote_block_ids=[d_blocks])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm.pdsweep.engine.kvpushdigest"):
        KP.wrap_xfer_blocks(xfer_blocks)(
            p, read_spec=spec, dst_engine_id="D", request_id="cmpl-p-1", remote_request_id="cmpl-d-1"
        )
    assert getattr(KP._POSTING, "write", None) is None  # cleared once vLLM's _xfer_blocks returned
    return "\n".join(r.getMessage() for r in caplog.records)


def decode_lands(d_mem: bytearray, d_blocks: list[int], caplog, prefill_tp: int = 1, flip_every: int = 0) -> str:
    """Decode's path (vLLM push_worker ``_get_new_notifs``): the last notification completes the request,
    which gets an empty ``_recving_transfers`` entry for ``_pop_done_transfers``."""
    d = kv_worker(addr_of(d_mem), agent="d-agent")
    d._recving_transfers = {}
    d._recving_metadata = {"cmpl-d-1": types.SimpleNamespace(local_physical_block_ids=[d_blocks], tp_size=prefill_tp)}

    def get_new_notifs(self):
        self._recving_transfers.setdefault("cmpl-d-1", [])
        return set()

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm.pdsweep.engine.kvpushdigest"):
        assert KP.wrap_get_new_notifs(get_new_notifs, flip_every)(d) == set()
    return "\n".join(r.getMessage() for r in caplog.records)


def test_prefill_digests_the_write_source_rows_keyed_by_decode_address(caplog):
    p_mem, d_mem = bytearray((i * 7) % 251 for i in range(640)), bytearray(640)
    before = bytes(p_mem)
    text = prefill_writes(p_mem, d_mem, [3], [7], caplog)
    (w,) = parse_writes(text)
    db = addr_of(d_mem)
    assert (w["agent"], w["engine"], w["rank"], w["req"], w["dreq"], w["bytes"]) == (
        "d-agent", "E", 0, "cmpl-p-1", "cmpl-d-1", 64
    )  # fmt: skip
    # prefill block 3 (K at 96, V at 416) WRITTEN to decode block 7 (K at 224, V at 544)
    assert w["units"] == [
        (0, "kv", 3, "0", db + 224, 32, sha(bytes(p_mem[96:128]))),
        (0, "kv", 3, "1", db + 544, 32, sha(bytes(p_mem[416:448]))),
    ]
    assert bytes(p_mem) == before  # digested, never written


def test_decode_digests_its_destination_blocks_before_vllm_reports_them_received(caplog):
    d_mem = bytearray(range(256)) + bytearray(range(256)) + bytearray(128)
    text = decode_lands(d_mem, [7], caplog, prefill_tp=2)
    (r,) = parse_pushed(text)
    db = addr_of(d_mem)
    assert (r["agent"], r["req"], r["state"], r["split"], r["bytes"]) == ("d-agent", "cmpl-d-1", "DONE", 2, 64)
    # whole descriptors and, prefill TP 2 > decode TP 1, each prefill rank's half
    assert r["reads"] == {
        (db + 224, 32): sha(bytes(d_mem[224:256])),
        (db + 224, 16): sha(bytes(d_mem[224:240])),
        (db + 240, 16): sha(bytes(d_mem[240:256])),
        (db + 544, 32): sha(bytes(d_mem[544:576])),
        (db + 544, 16): sha(bytes(d_mem[544:560])),
        (db + 560, 16): sha(bytes(d_mem[560:576])),
    }
    assert r["wholes"] == [(0, "kv", 7, db + 224, 32), (0, "kv", 7, db + 544, 32)]
    assert len(parse_pushed(decode_lands(d_mem, [7], caplog, prefill_tp=1))[0]["reads"]) == 2


def copy_block(p_mem: bytearray, d_mem: bytearray, src: int, dst: int) -> None:
    """What the WRITE does: prefill block ``src`` (K and V) into decode block ``dst``."""
    for region in (0, 1):
        s, t = region * 320 + src * 32, region * 320 + dst * 32
        d_mem[t : t + 32] = p_mem[s : s + 32]


def test_push_cell_matches_end_to_end_and_a_flipped_byte_names_the_block(caplog):
    p_mem = bytearray((i * 7) % 251 for i in range(640))
    d_mem = bytearray(640)
    prefill = prefill_writes(p_mem, d_mem, [3, 4], [7, 8], caplog)
    copy_block(p_mem, d_mem, 3, 7)
    copy_block(p_mem, d_mem, 4, 8)
    got = push_integrity(prefill, decode_lands(d_mem, [7, 8], caplog))
    assert (got["mode"], got["compared"], got["matched"], got["mismatched"], got["missing"]) == ("push", 2, 2, 0, 0)
    assert got["source"].startswith("pdsweep.engine.kvpushdigest (sha256-64 per NIXL WRITE descriptor")
    assert integrity_reasons(got, "t") == []
    flipped = push_integrity(prefill, decode_lands(d_mem, [7, 8], caplog, flip_every=1))
    assert (flipped["mismatched"], flipped["matched"], flipped["byte_flips_injected"]) == (1, 1, 1)
    assert d_mem[224] == p_mem[96] ^ 0xFF  # decode block 7's first byte, flipped in decode's KV cache
    (reason,) = integrity_reasons(flipped, "t")
    assert reason.startswith(
        "t: integrity: 1 mismatched block(s) of 2; first: request cmpl-p-1 group 0:kv prefill rank 0 block 3 "
        "(decode's bytes differ from what prefill wrote there)"
    )


def write(agent: str, rank: int, req: str, dreq: str, units: list[tuple]) -> str:
    d = ";".join(f"{g}/{k}/{b}/{i}/{a:x}/{n}/{dig}" for g, k, b, i, a, n, dig in units)
    return f"INFO {WRITE_TAG} agent={agent} engine=P rank={rank} req={req} dreq={dreq} us=8 bytes=512 d={d}\n"


def pushed(agent: str, dreq: str, reads: list[tuple], split: int = 2) -> str:
    d = ";".join(f"{a:x}/{n}/{dig}" for a, n, dig in reads)
    return f"INFO {PUSHED_TAG} agent={agent} req={dreq} state=DONE us=4 bytes=512 split={split} d={d}\n"


# P TP 2 -> D TP 1, MLA + SSM hybrid: both prefill ranks WRITE the latent whole, each its SSM conv half
P2D1 = write("d0", 0, "p-1", "d-1", [(0, "mla", 5, "0", 0x100, 512, "L"), (1, "ssm-conv", 2, "0", 0x900, 128, "c0")])
P2D1 += write("d0", 1, "p-1", "d-1", [(0, "mla", 5, "0", 0x100, 512, "L"), (1, "ssm-conv", 2, "0", 0x980, 128, "c1")])


def test_p2d1_each_prefill_rank_writes_its_shard_of_decodes_descriptor():
    reads = [(0x100, 512, "L"), (0x900, 256, "whole"), (0x900, 128, "c0"), (0x980, 128, "c1")]
    got = push_integrity(P2D1, pushed("d0", "d-1", reads))
    assert (got["compared"], got["matched"], got["missing"], got["stale"]) == (4, 4, 0, 0)
    # rank 1's shard never landed where it wrote it: missing, naming prefill rank 1
    got = push_integrity(P2D1, pushed("d0", "d-1", reads[:3]))
    assert (got["missing"], got["missing_by_group"]) == (1, {"1:ssm-conv": [1]})
    assert got["first"]["missing"] == {"request": "p-1", "group": "1:ssm-conv", "prefill_rank": 1, "block": 2}
    # a latent the two prefill ranks disagree on is no replica in push mode: one of them lost the race
    assert push_integrity(P2D1.replace("/512/L;", "/512/M;", 1), pushed("d0", "d-1", reads))["mismatched"] == 1


def test_bytes_prefill_wrote_there_for_another_request_are_stale():
    later = write("d0", 0, "p-2", "d-2", [(1, "ssm-conv", 9, "0", 0x900, 128, "c9")])
    got = push_integrity(P2D1 + later, pushed("d0", "d-1", [(0x100, 512, "L"), (0x900, 128, "c9"), (0x980, 128, "c1")]))
    assert (got["stale"], got["first"]["stale"]["prefill_rank"], got["unread_requests"]) == (1, 0, 1)


@pytest.mark.parametrize("text", ["", "INFO PDSWEEP_KV_OFFER agent=p engine=E rank=0 req=r us=1 bytes=1 split=2 d="])
def test_a_push_cell_without_write_digests_is_not_measured(text):
    got = push_integrity(text, pushed("d0", "d-1", [(0x100, 512, "L")]))
    assert got["not_measured"].startswith("no PDSWEEP_KV_WRITE line in the prefill logs")
    (reason,) = integrity_reasons(got, "c/transfer.json")
    assert reason.startswith("c/transfer.json: integrity: not measured (no PDSWEEP_KV_WRITE line")


def test_a_decode_block_no_prefill_rank_wrote_is_unwritten():
    """The push shape of vLLM PR #49297: decode's SSM conv descriptor (256 B) is written as two 128 B shards,
    one per prefill rank; with rank 1's WRITE lacking it, decode's second half is whatever it held."""
    lines = pushed("d0", "d-1", [(0x100, 512, "L"), (0x900, 128, "c0"), (0x980, 128, "c1")])
    whole = lines.replace("d=100/512/L;", "d=0/mla/4/100/512/L;1/ssm-conv/6/900/256/w;")
    got = push_integrity(P2D1, whole)
    assert (got["matched"], got["unwritten"], integrity_reasons(got, "t")) == (4, 0, [])
    rank0_only = P2D1.split("\n")[0] + "\n"
    got = push_integrity(rank0_only, whole)
    assert got["unwritten"] == 1
    assert got["first"]["unwritten"] == {
        "request": "p-1",
        "decode_request": "d-1",
        "group": "1:ssm-conv",
        "decode_block": 6,
    }
    assert integrity_reasons(got, "t") == [
        "t: integrity: 1 decode block(s) no prefill WRITE covered; first: request p-1 (decode request d-1) group "
        "1:ssm-conv decode block 6 (decode's KV there is whatever the block held before)"
    ]


def test_the_hooks_are_where_vllm_has_them():
    """The installed vLLM's push worker and NIXL wrapper get the three wrappers (restored after), and every
    release pdsweep keeps (tests/fixtures/vllm_releases, 0.27.0-0.34.0) has the shape they rely on: the WRITE
    posted in ``_xfer_blocks`` with the decode request id, the completed count in ``_get_new_notifs``."""
    from pathlib import Path

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker as W
    from vllm.distributed.nixl_utils import NixlWrapper

    saved = W._xfer_blocks, W._get_new_notifs, NixlWrapper.make_prepped_xfer
    try:
        assert KP.install_push_digest(3) is True
        assert all(getattr(f, KP._MARK) for f in (W._xfer_blocks, W._get_new_notifs, NixlWrapper.make_prepped_xfer))
    finally:
        W._xfer_blocks, W._get_new_notifs, NixlWrapper.make_prepped_xfer = saved
    rel = Path(__file__).parent / "fixtures" / "vllm_releases"
    files = sorted(rel.glob("*/vllm/distributed/kv_transfer/kv_connector/v1/nixl/push_worker.py"))
    assert len(files) >= 9
    for f in files:
        src = f.read_text()
        for needle in (
            "def _xfer_blocks(",
            "remote_request_id=",
            "def _get_new_notifs(",
            "_recving_transfers.setdefault(",
        ):
            assert needle in src, f"{f}: {needle}"
