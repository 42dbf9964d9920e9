"""The KV digests inside vLLM (pdsweep.engine.kvdigest): decode's READ bookkeeping over NIXL's
descriptor lists, the byte-flip drill, and prefill's descriptors of an offered block from vLLM's
own ``NixlBaseConnectorWorker._compute_desc_ids``."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import types

import numpy as np
import pytest
from conftest import FakeNixl, kv_worker

from pdsweep.core.faults import flip_byte_every, sweep_fault
from pdsweep.core.kvlines import parse_landed, parse_offers
from pdsweep.engine import kvdigest as K


def wrapped(flip_every: int = 0) -> FakeNixl:
    nixl = FakeNixl()
    cls = types.new_class("Wrapped", (FakeNixl,))
    cls.get_xfer_descs = K.wrap_get_xfer_descs(FakeNixl.get_xfer_descs)
    cls.prep_xfer_dlist = K.wrap_prep_xfer_dlist(FakeNixl.prep_xfer_dlist)
    cls.make_prepped_xfer = K.wrap_make_prepped_xfer(FakeNixl.make_prepped_xfer)
    cls.check_xfer_state = K.wrap_check_xfer_state(FakeNixl.check_xfer_state, flip_every)
    nixl.__class__ = cls
    return nixl


def read_one(nixl: FakeNixl, buf: bytearray, caplog: pytest.LogCaptureFixture, notif: bytes = b"cmpl-7-0:1") -> str:
    """Decode's path: prepare local and remote lists as vLLM does, READ block 1, poll it DONE."""
    base = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
    local = np.array([[base, 64, 0], [base + 64, 64, 0]], dtype=np.uint64)
    remote = np.array([[0xA000, 64, 0], [0xA040, 64, 0]], dtype=np.uint64)
    lh = nixl.prep_xfer_dlist("NIXL_INIT_AGENT", nixl.get_xfer_descs(local, "DRAM"))
    rh = nixl.prep_xfer_dlist(b"prefill-agent", nixl.get_xfer_descs(remote, "DRAM"))  # vLLM: the name as bytes
    x = nixl.make_prepped_xfer("READ", lh, np.array([1]), rh, np.array([1]), notif_msg=notif)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm.pdsweep.engine.kvdigest"):
        nixl.check_xfer_state(x)
    return "\n".join(r.getMessage() for r in caplog.records)


def test_decode_digests_the_local_bytes_of_a_done_read_keyed_by_the_remote_range(caplog):
    buf = bytearray(range(128))
    text = read_one(wrapped(), buf, caplog)
    (rec,) = parse_landed(text)
    want = hashlib.sha256(bytes(buf[64:])).hexdigest()[:16]
    assert (rec["agent"], rec["req"], rec["state"]) == ("prefill-agent", "cmpl-7-0", "DONE")
    assert rec["reads"] == {(0xA040, 64): want}
    assert buf == bytearray(range(128))  # read, never written


def test_the_byte_flip_drill_changes_decode_kv_and_its_digest(caplog):
    buf = bytearray(range(128))
    text = read_one(wrapped(flip_every=1), buf, caplog)
    assert buf[64] == 64 ^ 0xFF and buf[65:] == bytearray(range(65, 128))
    (rec,) = parse_landed(text)
    assert rec["reads"][(0xA040, 64)] == hashlib.sha256(bytes(buf[64:])).hexdigest()[:16]
    assert f"{K.FLIP_TAG} req=cmpl-7-0 remote_addr=a040" in text
    assert flip_byte_every("flip-byte-1-in-4") == 4 and sweep_fault("flip-byte-1-in-4").where == "engine"


def test_a_failed_read_logs_no_digest(caplog):
    nixl = wrapped()
    type(nixl).check_xfer_state = K.wrap_check_xfer_state(lambda self, h: "ERR")
    (rec,) = parse_landed(read_one(nixl, bytearray(128), caplog))
    assert (rec["state"], rec["reads"]) == ("ERR", {})


def test_prefill_descriptors_of_an_offered_block_come_from_vllm_compute_desc_ids():
    """Two regions (K and V) of 10 blocks each, 32 bytes a block: block 3 is descriptors 3 and 13."""
    mem = bytearray(b"k" * 320 + b"v" * 320)
    base = ctypes.addressof((ctypes.c_char * len(mem)).from_buffer(mem))
    w = kv_worker(base, tp_rank=1, agent="agent-p1")
    got = K.offered_descs(w, [[3]])
    assert got == [(0, "kv", 3, 0, base + 96, 32), (0, "kv", 3, 1, base + 416, 32)]
    # parts whatever the cell (KV_DIGEST_PARTS): a p1d2 decode rank's half matches without a per-cell env
    (rec,) = parse_offers(K.offer_line(w, "cmpl-9", [[3]]))
    assert (rec["agent"], rec["engine"], rec["rank"], rec["req"], rec["bytes"]) == ("agent-p1", "E", 1, "cmpl-9", 64)
    dig = hashlib.sha256(b"k" * 32).hexdigest()[:16]
    half = hashlib.sha256(b"k" * 16).hexdigest()[:16]
    assert rec["units"][:3] == [
        (0, "kv", 3, "0", base + 96, 32, dig),
        (0, "kv", 3, "0.0", base + 96, 16, half),
        (0, "kv", 3, "0.1", base + 112, 16, half),
    ]


def test_prefill_scheduler_hands_offered_blocks_to_the_workers_on_the_next_metadata():
    """vLLM's pull scheduler answers a finished prefill request with do_remote_prefill and the blocks
    it keeps (``pull_scheduler.py`` ``request_finished``); the next metadata carries them, once."""
    answers = {"p": (True, {"do_remote_prefill": True, "remote_block_ids": ([4, 5], [9])}), "d": (False, None)}
    finished = K.wrap_request_finished(lambda self, request, block_ids: answers[request.request_id])
    build = K.wrap_build_meta(lambda self, out: types.SimpleNamespace())
    assert finished(None, types.SimpleNamespace(request_id="p"), None)[0] is True
    finished(None, types.SimpleNamespace(request_id="d"), None)
    assert build(None, None)._pdsweep_offered == {"p": [[4, 5], [9]]}
    assert not hasattr(build(None, None), "_pdsweep_offered")


def test_a_read_nixl_refuses_names_the_first_descriptor_whose_lengths_differ(caplog):
    nixl = wrapped()

    def refuse(self, *a, **kw):
        raise RuntimeError("NIXL_ERR_INVALID_PARAM")

    type(nixl).make_prepped_xfer = K.wrap_make_prepped_xfer(refuse)
    local = np.array([[0x10, 64, 0], [0x50, 128, 0]], dtype=np.uint64)
    remote = np.array([[0xA000, 64, 0], [0xA040, 64, 0]], dtype=np.uint64)
    lh = nixl.prep_xfer_dlist("NIXL_INIT_AGENT", nixl.get_xfer_descs(local, "DRAM"))
    rh = nixl.prep_xfer_dlist(b"p-agent", nixl.get_xfer_descs(remote, "DRAM"))
    with caplog.at_level(logging.INFO, logger="vllm.pdsweep.engine.kvdigest"), pytest.raises(RuntimeError):
        nixl.make_prepped_xfer("READ", lh, [0, 1], rh, [0, 1], notif_msg=b"cmpl-3:1")
    (rec,) = parse_landed("\n".join(r.getMessage() for r in caplog.records))
    assert (rec["agent"], rec["req"], rec["state"], rec["reads"]) == (
        "p-agent",
        "cmpl-3",
        "REFUSED",
        {(0xA040, 64): "local128"},
    )


def test_decode_logs_vllms_tp_ratio_and_the_reads_remote_block_order(caplog):
    """vLLM's ``_read_blocks`` posts the READ (``make_prepped_xfer``) for ``read_spec.remote_block_ids``; the
    landed line carries them per non-empty group and vLLM's own ``TransferTopology.tp_ratio`` (decode TP 2,
    prefill TP 1: 2)."""
    from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology

    nixl = wrapped()
    buf = bytearray(range(128))
    base = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
    lh = nixl.prep_xfer_dlist("NIXL_INIT_AGENT", nixl.get_xfer_descs(np.array([[base, 64, 0]] * 2, np.uint64), "DRAM"))
    rh = nixl.prep_xfer_dlist(b"p-agent", nixl.get_xfer_descs(np.array([[0xA000, 64, 0]] * 2, np.uint64), "DRAM"))

    def read_blocks(self, read_spec, dst_engine_id, remote_request_id):  # vLLM's: computes ids, posts the READ
        return nixl.make_prepped_xfer("READ", lh, [0], rh, [1], notif_msg=f"{remote_request_id}:2".encode())

    topo = types.SimpleNamespace(tp_size=2, get_engine_info=lambda e: types.SimpleNamespace(remote_tp_size=1))
    topo.tp_ratio = types.MethodType(TransferTopology.tp_ratio, topo)
    worker = types.SimpleNamespace(transfer_topo=topo)
    spec = types.SimpleNamespace(remote_block_ids=[[6, 5], []], block_ids_by_region=False)
    handle = K.wrap_read_blocks(read_blocks)(worker, read_spec=spec, dst_engine_id="E", remote_request_id="cmpl-4")
    with caplog.at_level(logging.INFO, logger="vllm.pdsweep.engine.kvdigest"):
        nixl.check_xfer_state(handle)
    (rec,) = parse_landed("\n".join(r.getMessage() for r in caplog.records))
    assert (rec["req"], rec["tp_ratio"], rec["order"]) == ("cmpl-4", 2, {0: [6, 5]})
    assert getattr(K._POSTING, "fields", "") == ""  # cleared once vLLM's _read_blocks returned
