"""pdsweep.core.kvlines: the one parser of the KV digest lines both modes log (pull: offer/landed,
push: write/pushed); what each line carries end to end is in test_kvdigest, test_kvpush, test_integrity."""

from __future__ import annotations

import pytest

from pdsweep.core.kvlines import LANDED_TAG, PUSHED_TAG, parse_landed, parse_pushed


def test_a_pushed_entry_naming_its_block_is_a_whole_descriptor_and_a_landed_one_is_refused():
    """Decode's two d= fields share a parser: PUSHED names the decode block of each whole descriptor
    (``g/kind/block/addr/len/digest``), LANDED never does (``addr/len/digest``), so there it is an error."""
    entry = "0/kv/7/e0/32/aa"
    (r,) = parse_pushed(f"{PUSHED_TAG} agent=d0 req=d-1 state=DONE us=3 bytes=48 split=2 d={entry};e0/16/bb")
    assert (r["agent"], r["req"], r["state"], r["us"], r["bytes"], r["split"]) == ("d0", "d-1", "DONE", 3, 48, 2)
    assert r["reads"] == {(0xE0, 32): "aa", (0xE0, 16): "bb"} and r["wholes"] == [(0, "kv", 7, 0xE0, 32)]
    with pytest.raises(ValueError, match=f"{LANDED_TAG} d= entry '{entry}': allowed <addr hex>/<len>/<digest>"):
        parse_landed(f"{LANDED_TAG} agent=p0 req=p-1 state=DONE us=3 bytes=32 d={entry}")
    (ok,) = parse_landed(f"{LANDED_TAG} agent=p0 req=p-1 state=DONE us=3 bytes=32 tp_ratio=-2 d=e0/32/aa")
    assert (ok["reads"], ok["tp_ratio"], ok["order"], ok["impl"]) == ({(0xE0, 32): "aa"}, -2, {}, "sha256-64")
