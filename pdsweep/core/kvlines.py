"""The KV digest lines pdsweep's vLLM plugin logs inside vLLM and their parsers: the contract between
the plugin (:mod:`pdsweep.engine.kvdigest`: pull mode's ``OFFER``/``LANDED``; :mod:`pdsweep.engine.kvpushdigest`:
push mode's ``WRITE``/``PUSHED``; the line formats are in their module docs) and the judges that read them back
(:mod:`pdsweep.core.kvintegrity`, :mod:`pdsweep.core.kvpush`). Standard library only: the plugin, loaded in
every vLLM process, imports its tags from here.

Each parser returns one dict per line (``us``: microseconds of digest, ``bytes``: bytes digested; both whole
numbers) and raises ``ValueError`` on a ``d=`` entry not in the format the plugin writes; a line cut before
its ``d=`` field matches no pattern and is skipped.
"""

from __future__ import annotations

import re
from typing import Any

OFFER_TAG = "PDSWEEP_KV_OFFER"  # prefill: the blocks offered for a pull READ (one line per request and rank)
LANDED_TAG = "PDSWEEP_KV_LANDED"  # decode: the bytes a READ landed (one line per READ)
WRITE_TAG = "PDSWEEP_KV_WRITE"  # push prefill: the source rows of one NIXL WRITE
PUSHED_TAG = "PDSWEEP_KV_PUSHED"  # push decode: its destination blocks once every WRITE was notified
FLIP_TAG = "PDSWEEP_INJECTED_BYTE_FLIP"  # decode: one byte the flip-byte drill inverted
DIGEST_NAME = "sha256-64"  # 64 bits of SHA-256: OpenSSL's SHA-NI path, 0.7 ms/MiB vs BLAKE2b's 8 ms here (bench/)
TORCH_DIGEST_NAME = "wsum-128"  # KV on a device: pdsweep.engine.torchdigest (two 64-bit odd-weighted word sums)

_PREFILL = r" agent=(?P<agent>\S+) engine=(?P<engine>\S+) rank=(?P<rank>\d+) req=(?P<req>\S+)"
_DECODE = r" agent=(?P<agent>\S+) req=(?P<req>\S+) state=(?P<state>\S+)"
_COST = r" us=(?P<us>\d+) bytes=(?P<bytes>\d+)"
_OFFER = re.compile(
    OFFER_TAG + _PREFILL + _COST + r" split=\d+"
    r"(?: impl=(?P<impl>\S+))?(?: sample=(?P<sample>[0-9.e-]+))?(?P<out> sampled_out=1)? d=(?P<d>\S*)"
)
_LANDED = re.compile(
    LANDED_TAG + _DECODE + _COST
    + r"(?: tp_ratio=(?P<tp_ratio>-?\d+))?(?: order=(?P<order>\S*))?(?: impl=(?P<impl>\S+))? d=(?P<d>\S*)"
)  # fmt: skip
_WRITE = re.compile(WRITE_TAG + _PREFILL + r" dreq=(?P<dreq>\S+)" + _COST + r" d=(?P<d>\S*)")
_PUSHED = re.compile(PUSHED_TAG + _DECODE + _COST + r" split=(?P<split>\d+) d=(?P<d>\S*)")
_WHOLE = frozenset({"rank", "us", "bytes", "split"})  # fields read as whole numbers


def _fields(m: re.Match[str], *names: str) -> dict[str, Any]:
    """The named groups ``names`` of a matched line, :data:`_WHOLE` ones as int."""
    return {n: int(m[n]) if n in _WHOLE else m[n] for n in names}


def parse_units(field: str) -> list[tuple[int, str, int, str, int, int, str]]:
    """The ``d=`` field of an offer (or push WRITE) line: ``(group, kind, block, i, addr, len, digest)``
    per ``;``-separated ``group/kind/block/i/addr hex/len/digest``."""
    out = []
    for d in filter(None, field.split(";")):
        g, kind, b, i, addr, length, dig = d.split("/")
        out.append((int(g), kind, int(b), i, int(addr, 16), int(length), dig))
    return out


def parse_reads(
    field: str, pushed: bool = False
) -> tuple[dict[tuple[int, int], str], list[tuple[int, str, int, int, int]]]:
    """The ``d=`` field of a landed (or, ``pushed``, a PUSHED) line: ``reads`` ``{(addr, len): digest}`` per
    ``;``-separated ``addr hex/len/digest``, and ``wholes`` ``[(group, kind, block, addr, len)]`` for each
    PUSHED entry that names its block first (``group/kind/block/addr hex/len/digest``: a whole descriptor).
    ``ValueError`` on an entry of fewer than 3 fields, or of more in a landed line."""
    reads, wholes = {}, []
    for d in filter(None, field.split(";")):
        *where, addr, length, dig = d.split("/")
        if where and not pushed:
            raise ValueError(f"{LANDED_TAG} d= entry {d!r}: allowed <addr hex>/<len>/<digest>")
        reads[(int(addr, 16), int(length))] = dig
        if len(where) == 3:
            wholes.append((int(where[0]), where[1], int(where[2]), int(addr, 16), int(length)))
    return reads, wholes


def parse_order(text: str) -> dict[int, list[int]]:
    """``{group: [block, ...]}`` from a landed line's ``order=<g>:<b>,<b>|<g>:...``."""
    out = {}
    for part in filter(None, text.split("|")):
        g, _, blocks = part.partition(":")
        out[int(g)] = [int(b) for b in blocks.split(",") if b]
    return out


def parse_offers(text: str) -> list[dict[str, Any]]:
    """One dict per :data:`OFFER_TAG` line: agent, engine, rank, req, us, bytes and ``units``
    ``(group, kind, block, i, addr, len, digest)`` (``i`` a string: ``"3"`` or a part ``"3.1"``), ``impl``
    (the digest; lines before it was logged: :data:`DIGEST_NAME`), ``sample`` and ``sampled_out``."""
    return [
        {
            **_fields(m, "agent", "engine", "rank", "req", "us", "bytes"),
            "units": parse_units(m["d"]),
            "impl": m["impl"] or DIGEST_NAME,
            "sample": float(m["sample"] or 1),
            "sampled_out": bool(m["out"]),
        }
        for m in _OFFER.finditer(text)
    ]


def parse_landed(text: str) -> list[dict[str, Any]]:
    """One dict per :data:`LANDED_TAG` line: agent, req, state, us, bytes, ``reads``
    ``{(addr, len): digest}``, ``tp_ratio`` (vLLM's, decode to this prefill; None when not logged)
    and ``order`` ``{group: [prefill block ids in the request's order]}`` (the READ's
    ``remote_block_ids`` before prefix-cache trimming; empty when not logged)."""
    return [
        {
            **_fields(m, "agent", "req", "state", "us", "bytes"),
            "reads": parse_reads(m["d"])[0],
            "tp_ratio": int(m["tp_ratio"]) if m["tp_ratio"] else None,
            "order": parse_order(m["order"] or ""),
            "impl": m["impl"] or DIGEST_NAME,
        }
        for m in _LANDED.finditer(text)
    ]


def parse_writes(text: str) -> list[dict[str, Any]]:
    """One offer (:func:`parse_offers`' shape) per :data:`WRITE_TAG` line: ``agent`` decode's NIXL agent,
    ``engine``/``rank``/``req`` prefill's, ``dreq`` decode's request id, ``units`` ``(group, kind, prefill
    block, i, decode addr, len, digest of prefill's source bytes)``."""
    return [
        {**_fields(m, "agent", "engine", "rank", "req", "dreq", "us", "bytes"), "units": parse_units(m["d"])}
        for m in _WRITE.finditer(text)
    ]


def parse_pushed(text: str) -> list[dict[str, Any]]:
    """One dict per :data:`PUSHED_TAG` line: ``agent`` (decode's own), ``req`` (decode's request id),
    state, us, bytes, ``split``, ``reads`` ``{(decode addr, len): digest}`` (whole descriptors and parts)
    and ``wholes`` ``[(group, kind, decode block, addr, len)]`` (each whole descriptor of decode's blocks)."""
    out = []
    for m in _PUSHED.finditer(text):
        reads, wholes = parse_reads(m["d"], pushed=True)
        out.append({**_fields(m, "agent", "req", "state", "us", "bytes", "split"), "reads": reads, "wholes": wholes})
    return out
