"""The torch KV digest (pdsweep.engine.torchdigest) on CPU tensors (the dry run of the GPU path): a
one-byte change always changes it, it equals its pure-Python definition, and kvdigest uses it over the
storages vLLM registered (decode's READ, the byte-flip drill) with the lines naming it."""

from __future__ import annotations

import logging
import types

import numpy as np
import pytest
import torch
from conftest import kv_worker
from test_kvdigest import wrapped

from pdsweep.core.kvintegrity import integrity, integrity_reasons
from pdsweep.core.kvlines import TORCH_DIGEST_NAME, parse_landed, parse_offers
from pdsweep.core.kvsample import fraction_for, sampled, ttft_share
from pdsweep.engine import kvdigest as K
from pdsweep.engine import torchdigest as T
from pdsweep.xfer import digestcheck
from pdsweep.xfer.digestcheck import digest_check, summary


def test_every_one_byte_change_changes_the_digest():
    """A 1 KiB region, each of its 1024 bytes changed alone, with XOR masks 0x01, 0x80 (an int32 word's
    sign bit in its top byte) and 0xFF: 3072 changed copies digested in one call, each differs from the
    original in both 64-bit lanes."""
    g = torch.Generator().manual_seed(58)
    base = torch.randint(0, 256, (1024,), dtype=torch.uint8, generator=g)
    copies = base.repeat(3 * 1024 + 1, 1)  # row 0: the original
    pos = torch.arange(1024)
    for k, mask in enumerate((0x01, 0x80, 0xFF)):
        rows = 1 + k * 1024 + pos
        copies[rows, pos] ^= mask
    flat = copies.reshape(-1)
    got = T.digest_tensor_regions(flat, [r * 1024 for r in range(copies.shape[0])], 1024)
    orig = got[0]
    same_lane = [i for i, d in enumerate(got[1:], 1) if d[:16] == orig[:16] or d[16:] == orig[16:]]
    assert same_lane == [], f"{len(same_lane)} one-byte changes kept a lane, first at copy {same_lane[:1]}"
    assert len(set(got)) == len(got)


def test_the_batched_digest_equals_its_definition_for_words_and_bytes():
    data = bytes(np.random.default_rng(7).integers(0, 256, 4096, dtype=np.uint8))
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    # int32 words: aligned offsets, length a multiple of 4 (rows 256 B apart, one 2.5 KiB-apart outlier)
    got = T.digest_tensor_regions(flat, [0, 256, 512, 3072], 1024)
    assert got == [T.reference_digest(data[o : o + 1024]) for o in (0, 256, 512, 3072)]
    # bytes: odd length and offsets
    assert T.digest_tensor_regions(flat, [1, 7, 1000], 13) == [
        T.reference_digest(data[o : o + 13]) for o in (1, 7, 1000)
    ]
    assert len(got[0]) == 32 and got[0] != got[1]


def test_a_storage_map_digests_regions_of_registered_tensors_and_knows_no_other():
    """vLLM registers each KV cache tensor's storage (``base_worker.py`` ``register_kv_caches``); a view
    of a storage maps to the whole storage, and an address outside every storage has no digest."""
    k = torch.arange(256, dtype=torch.int32)  # 1 KiB
    v = torch.full((128,), 7, dtype=torch.int64)  # 1 KiB
    smap = T.StorageMap(T.tensors_of({"layer.0": [k[10:], v]}))
    ka, va = k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr()
    got = smap.digest_many([(ka + 64, 128), (va, 1024), (ka + 1020, 8), (1, 4)])
    assert got[:2] == [T.reference_digest(bytes(k.numpy())[64:192]), T.reference_digest(bytes(v.numpy()))]
    assert got[2:] == [None, None]  # past k's storage; unregistered
    assert smap.devices == ["cpu"] and not smap.on_device(ka)


def read_tensor(flip_every: int, caplog: pytest.LogCaptureFixture) -> tuple[torch.Tensor, str]:
    """Decode's READ of block 1 (64 B) of a registered CPU tensor, digested with torch (forced: the dry run)."""
    buf = torch.arange(128, dtype=torch.uint8)
    K.use_storages({"layer.0": buf}, force_torch=True)
    nixl = wrapped(flip_every)
    base = buf.data_ptr()
    local = np.array([[base, 64, 0], [base + 64, 64, 0]], dtype=np.uint64)
    remote = np.array([[0xA000, 64, 0], [0xA040, 64, 0]], dtype=np.uint64)
    lh = nixl.prep_xfer_dlist("NIXL_INIT_AGENT", nixl.get_xfer_descs(local, "VRAM"))
    rh = nixl.prep_xfer_dlist(b"prefill-agent", nixl.get_xfer_descs(remote, "VRAM"))
    x = nixl.make_prepped_xfer("READ", lh, np.array([1]), rh, np.array([1]), notif_msg=b"cmpl-7-0:1")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm.pdsweep.engine.kvdigest"):
        nixl.check_xfer_state(x)
    return buf, "\n".join(r.getMessage() for r in caplog.records)


@pytest.fixture
def torch_state(monkeypatch):
    """The torch path, with no raw host pointer (ctypes) usable: device memory cannot be read that way."""
    monkeypatch.setattr(K, "ctypes", None)
    yield
    K._STATE.update(map=None, torch=False, sample=1.0)


def test_decode_digests_vram_reads_with_torch_and_the_line_names_it(caplog, torch_state):
    buf, text = read_tensor(0, caplog)
    (rec,) = parse_landed(text)
    assert rec["impl"] == TORCH_DIGEST_NAME == K.impl_name()
    assert rec["reads"] == {(0xA040, 64): T.reference_digest(bytes(range(64, 128)))}


def test_the_byte_flip_drill_flips_through_the_storage_map(caplog, torch_state):
    buf, text = read_tensor(1, caplog)
    assert int(buf[64]) == 64 ^ 0xFF and buf[65:].tolist() == list(range(65, 128))
    (rec,) = parse_landed(text)
    assert rec["reads"][(0xA040, 64)] == T.reference_digest(bytes(buf[64:].numpy()))


def test_a_region_outside_the_registered_storages_is_never_read_blindly(torch_state):
    K.use_storages({"layer.0": torch.zeros(64, dtype=torch.uint8)}, force_torch=True)
    with pytest.raises(ValueError, match="in no KV cache storage vLLM registered"):
        K.digest_many([(0x1000, 64)])


def test_the_device_checks_digest_step_times_it_and_proves_it_on_the_device():
    """scripts/device_check.py's step (pdsweep.xfer.digestcheck) on the host: GB/s per descriptor size,
    the device's digest equal to the host's, one flipped byte seen, the estimate from the measured GB/s."""
    r = digest_check("cpu", iters=1, size=2**20)
    assert (r["ok"], r["equals_host_digest"], r["one_byte_changes_it"], r["buffer_mib"]) == (True, True, True, 1)
    gbps = r["64k"]["gbps"]
    assert gbps > 0 and r["1024k"]["gbps"] > 0
    assert r["estimate"]["ttft_share_at_default_0.25"] == round(ttft_share(0.25, gbps), 4)
    assert r["estimate"]["sample_for_2_percent"] == round(fraction_for(gbps), 3)
    assert summary(r).startswith(f"kv digest (wsum-128, cpu, 1 MiB): {gbps} GB/s (64 KiB descriptors)")


def test_the_device_checks_digest_step_fails_when_device_and_host_digests_differ(monkeypatch):
    monkeypatch.setattr(digestcheck, "reference_digest", lambda data: "0" * 32)
    r = digestcheck.digest_check("cpu", iters=1, size=2**20)
    assert (r["ok"], r["equals_host_digest"]) == (False, False)


def test_register_kv_caches_maps_what_vllm_registered_and_leaves_host_kv_to_sha256(torch_state):
    """After vLLM's ``register_kv_caches``: its ``device_kv_caches`` (or ``host_xfer_buffers`` when it
    stages KV in host memory) become the storage map; host tensors keep SHA-256 unless torch is forced."""
    kv, staged = torch.zeros(256, dtype=torch.uint8), torch.ones(128, dtype=torch.uint8)
    worker = types.SimpleNamespace(device_kv_caches={"l0": kv}, host_xfer_buffers={"l0": staged}, use_host_buffer=False)
    register = K.wrap_register_kv_caches(lambda self, kv_caches: "registered")
    assert register(worker, None) == "registered" and K._STATE["map"] is None and K.impl_name() == "sha256-64"
    K._STATE["torch"] = True
    register(worker, None)
    assert K.impl_name() == TORCH_DIGEST_NAME and K._STATE["map"].locate(kv.data_ptr() + 10, 8)[1] == 10
    worker.use_host_buffer = True
    register(worker, None)
    assert K._STATE["map"].locate(kv.data_ptr(), 1) is None and K._STATE["map"].locate(staged.data_ptr(), 1)


def offering_worker(mem: torch.Tensor) -> types.SimpleNamespace:
    """A prefill worker (rank 0, agent ``agent-p0``) whose KV (``conftest.kv_worker``'s K and V regions) is
    ``mem``, registered as device memory (``VRAM``)."""
    return kv_worker(mem.data_ptr(), agent="agent-p0", memory_type="VRAM")


def test_prefill_offers_device_kv_with_torch_and_a_sampled_out_request_without_digests(torch_state):
    mem = torch.arange(640, dtype=torch.int32).to(torch.uint8)
    K.use_storages({"l0": mem}, force_torch=True)
    w = offering_worker(mem)
    K._STATE["sample"] = 0.5
    inn = next(r for r in (f"cmpl-{i}" for i in range(50)) if sampled(r, 0.5))
    out = next(r for r in (f"cmpl-{i}" for i in range(50)) if not sampled(r, 0.5))
    (rec,) = parse_offers(K.offer_line(w, inn, [[3]]))
    raw = bytes(mem.numpy())
    assert (rec["impl"], rec["sample"], rec["sampled_out"], rec["bytes"]) == (TORCH_DIGEST_NAME, 0.5, False, 64)
    assert rec["units"][:2] == [
        (0, "kv", 3, "0", mem.data_ptr() + 96, 32, T.reference_digest(raw[96:128])),
        (0, "kv", 3, "0.0", mem.data_ptr() + 96, 16, T.reference_digest(raw[96:112])),
    ]
    (skip,) = parse_offers(K.offer_line(w, out, [[3]]))
    assert (skip["sampled_out"], skip["units"], skip["req"]) == (True, [], out)


def test_decode_leaves_a_sampled_out_read_undigested_and_unflipped(torch_state):
    buf = torch.arange(64, dtype=torch.uint8)
    K.use_storages({"l0": buf}, force_torch=True)
    K._STATE["sample"] = 0.5
    out = next(r for r in (f"cmpl-{i}" for i in range(50)) if not sampled(r, 0.5))
    rows = np.array([[buf.data_ptr(), 64, 0]], dtype=np.uint64), np.array([[0xA000, 64, 0]], dtype=np.uint64)
    (rec,) = parse_landed(K.landed_line((*rows, "p0", out, ""), "DONE", flip_now=True))
    assert (rec["state"], rec["reads"], rec["req"]) == ("SAMPLED_OUT", {}, out)
    assert buf.tolist() == list(range(64))  # no drill flip on a READ nobody compares


def test_the_worker_attributes_the_storage_map_reads_are_vllms():
    """vLLM 0.32's ``NixlBaseConnectorWorker`` keeps what it registered under these names
    (``nixl/base_worker.py`` ``register_kv_caches``); the wrapper reads them after it."""
    import inspect

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker

    src = inspect.getsource(NixlBaseConnectorWorker)
    for line in ("self.device_kv_caches = kv_caches", "self.use_host_buffer = ", "self.host_xfer_buffers = "):
        assert line in src, line


def dry_run_pd(flip_every: int, caplog: pytest.LogCaptureFixture) -> dict:
    """The torch path end to end in one process: prefill offers block 3 of its KV tensor, the "READ" copies
    its two descriptors (K, V) into decode's KV tensor, decode digests them, and integrity joins the two."""
    prefill_kv = torch.arange(640, dtype=torch.int32).to(torch.uint8)
    decode_kv = torch.zeros(640, dtype=torch.uint8)
    K.use_storages({"prefill": prefill_kv, "decode": decode_kv}, force_torch=True)
    with caplog.at_level(logging.INFO, logger="vllm.pdsweep.engine.kvdigest"):
        prefill_text = K.offer_line(offering_worker(prefill_kv), "cmpl-1", [[3]])
    decode_kv[96:128], decode_kv[416:448] = prefill_kv[96:128], prefill_kv[416:448]  # NIXL's READ
    p, d = prefill_kv.data_ptr(), decode_kv.data_ptr()
    nixl = wrapped(flip_every)
    local = np.array([[d + 96, 32, 0], [d + 416, 32, 0]], dtype=np.uint64)
    remote = np.array([[p + 96, 32, 0], [p + 416, 32, 0]], dtype=np.uint64)
    lh = nixl.prep_xfer_dlist("NIXL_INIT_AGENT", nixl.get_xfer_descs(local, "VRAM"))
    rh = nixl.prep_xfer_dlist(b"agent-p0", nixl.get_xfer_descs(remote, "VRAM"))
    x = nixl.make_prepped_xfer("READ", lh, np.array([0, 1]), rh, np.array([0, 1]), notif_msg=b"cmpl-1:1")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm.pdsweep.engine.kvdigest"):
        nixl.check_xfer_state(x)
    return integrity(prefill_text, "\n".join(r.getMessage() for r in caplog.records))


def test_dry_run_prefill_and_decode_torch_digests_match_and_a_flip_fails_the_block(caplog, torch_state):
    ok = dry_run_pd(0, caplog)
    assert (ok["compared"], ok["matched"], ok["mismatched"], ok["impl"]) == (1, 1, 0, [TORCH_DIGEST_NAME])
    assert integrity_reasons(ok, "c/transfer.json") == []
    flipped = dry_run_pd(1, caplog)
    assert (flipped["matched"], flipped["mismatched"], flipped["byte_flips_injected"]) == (0, 1, 1)
    (reason,) = integrity_reasons(flipped, "c/transfer.json")
    assert reason.startswith("c/transfer.json: integrity: 1 mismatched block(s) of 1; first: request cmpl-1 group 0:kv")
    assert "prefill rank 0 block 3" in reason


def test_the_dry_run_without_torch_skips_the_digest_step_and_says_so(monkeypatch):
    """The py312 dry run (CI: a bare venv with the carried wheels, no torch) skips the step and says so;
    on a GPU (``cuda``) a missing torch fails the check."""
    monkeypatch.setitem(__import__("sys").modules, "torch", None)  # import torch -> ImportError
    dry, gpu = digest_check("cpu", iters=1), digest_check("cuda", iters=1)
    assert (dry["ok"], dry["skipped"], gpu["ok"], gpu["skipped"]) == (False, True, False, False)
    assert summary(dry).startswith("kv digest: SKIPPED (the dry run) torch not importable")
    assert summary(gpu).startswith("kv digest: torch not importable")
