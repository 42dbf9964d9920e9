"""Real NIXL KV-transfer benchmark: prefill ranks serve, decode ranks READ by a plan.

One OS process per prefill rank and per decode rank (``multiprocessing`` spawn), each
with its own ``nixl_agent`` (UCX backend) whose progress-thread delay is set
(``nixlAgentConfig.pthrDelay``, microseconds; the Python ``nixl_agent`` hard-codes 0,
which busy-spins a core: ../shared/CPU.md). Agent metadata goes through pipes.

Prefill rank ``r`` fills every page of every region with a pattern of (region,
prefill page id, byte offset in the TP1 page), restricted to the units it holds
(:meth:`geometry.Region.shard`), so a byte's value says which layer, page and prefill
rank it belongs to. Pattern bytes are 0..254; decode memory starts as 0xFF, so an
unread byte is always seen. Decode ranks execute their :class:`readplan.ReadPlan` per
request with permuted page ids (NIXL merges contiguous descriptors: CPU.md), send the
plan's notifications, and verify every byte of their cache against the pattern.

This module: :class:`BenchConfig` (one run, from the CLI flags), :func:`run_transfer_bench`,
the statistics and the CLI; the rank processes are :mod:`pdsweep.xfer.rank`, the parent
side :mod:`pdsweep.xfer.session`, the shared layout and pattern :mod:`pdsweep.xfer.memory`.

Units: bytes, seconds, GB/s = 1e9 bytes/s. Transfer time is measured in each decode
rank from the first ``make_prepped_xfer`` to the last ``DONE``; the host memcpy
baseline copies the same number of bytes with ``numpy.copyto`` in the same processes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdsweep.core.errors import GateFailed, UserError, run_main
from pdsweep.results.layout import write_json
from pdsweep.xfer.light import load_model

if TYPE_CHECKING:
    from pdsweep.sweepfile.sweep import ModelSpec
from pdsweep.plan.geometry import KVGeometry, kv_geometry
from pdsweep.plan.readplan import PLANS, MappingImpl, PlanKind, ReadPlan, UnfixedPlanAsserts, plans_for
from pdsweep.xfer.memory import check_device, make_requests
from pdsweep.xfer.rank import DEFAULT_PROGRESS_DELAY_US
from pdsweep.xfer.session import SessionOptions, TransferSession


# ---------------------------------------------------------------- public API
def _plan_summary(plan: ReadPlan, geometry: KVGeometry, blocks: int) -> dict[str, Any]:
    return {
        "decode_rank": plan.decode_rank,
        "tp_ratio": plan.tp_ratio,
        "mapping": plan.mapping.impl,
        "attention_source_ranks": list(plan.mapping.attention_ranks),
        "ssm_source_ranks": list(plan.mapping.ssm_ranks),
        "read_ranks": list(plan.transfers),
        "notify_ranks": list(plan.notify_ranks),
        "bytes_per_request_by_rank": {str(r): plan.bytes_from(r, geometry, blocks) for r in plan.transfers},
        "descriptors_per_request": plan.descriptors_per_request(geometry, blocks),
        "upstream_notes": list(plan.upstream_notes),
    }


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run (the flags of ``pdsweep bench transfer``): ``model`` (catalogue
    entry ``model_name``) at ``prefill_tp`` -> ``decode_tp``; ``blocks`` attention blocks
    of ``block_size`` tokens per request (each request also moves one SSM state page per
    SSM layer), ``requests`` per iteration; read ``plan`` (:data:`readplan.PLANS`) with
    the source-rank ``mapping``; cache memory on ``device`` (cpu | cuda); ``warmup`` +
    ``iters`` iterations; byte-exact ``verify``; NIXL ``progress_delay_us``
    (microseconds); ``timeout_s`` per answer of a rank process."""

    model_name: str
    model: ModelSpec
    prefill_tp: int
    decode_tp: int
    block_size: int = 16
    blocks: int = 64
    plan: PlanKind = "fixed"
    device: str = "cpu"
    verify: bool = True
    requests: int = 1
    iters: int = 5
    warmup: int = 1
    seed: int = 0
    progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US
    mapping: MappingImpl = "auto"
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.plan not in PLANS:
            raise ValueError(f"plan must be one of {', '.join(PLANS)}, got {self.plan!r}")
        if self.iters < 1 or self.warmup < 0:
            raise ValueError("iters must be >= 1 and warmup >= 0")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> BenchConfig:
        """The config of :func:`add_cli_args`' flags; raises ``UserError`` for an unknown
        model or a bad value."""
        model = _find_model(args.models, args.model)
        try:
            return cls(
                args.model,
                model,
                args.prefill_tp,
                args.decode_tp,
                args.block_size,
                args.blocks,
                args.plan,
                args.device,
                args.verify,
                requests=args.requests,
                iters=args.iters,
                progress_delay_us=args.progress_delay_us,
                mapping=args.mapping,
            )
        except ValueError as e:
            raise UserError(str(e)) from None

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model_name,
            "prefill_tp": self.prefill_tp,
            "decode_tp": self.decode_tp,
            "block_size": self.block_size,
            "blocks": self.blocks,
            "requests": self.requests,
            "plan": self.plan,
            "device": self.device,
            "iters": self.iters,
            "warmup": self.warmup,
            "seed": self.seed,
            "progress_delay_us": self.progress_delay_us,
        }


def run_transfer_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Run the NIXL benchmark of ``cfg`` and return a JSON-able result: ``config``,
    ``plans`` (per decode rank), ``ranks`` (per-rank stats), ``gbps`` (all decode ranks'
    bytes / median slowest-rank wall time), ``memcpy_gbps`` (same bytes, host
    ``numpy.copyto``, ranks in parallel), ``ratio``, ``transport``, ``notifications`` and
    ``verification`` ``{ok, missing, wrong, stray_bytes, checked_bytes}`` (``ok`` is None
    when ``cfg.verify`` is False). Raises ``ValueError`` (bad model geometry, TP sizes),
    ``UnfixedPlanAsserts`` (the unfixed plan refuses the pair) and ``RuntimeError`` (NIXL
    or a rank process failed)."""
    P, D = cfg.prefill_tp, cfg.decode_tp
    geometry = kv_geometry(cfg.model_name, cfg.model, cfg.block_size, (P, D))
    plans = plans_for(geometry, P, D, cfg.plan, cfg.mapping)
    reqs = make_requests(cfg.requests, cfg.blocks, cfg.seed)
    nbytes = bytes_per_rank(plans, geometry, cfg.blocks, cfg.requests)
    runs: list[list[dict[str, Any]]] = []
    opts = SessionOptions(cfg.device, cfg.progress_delay_us, cfg.timeout_s, cfg.seed)
    with TransferSession(geometry, P, D, plans, reqs, opts) as s:
        for i in range(cfg.warmup + cfg.iters):
            s.reset()
            out = s.iterate()
            if i >= cfg.warmup:
                runs.append(out)
        memcpy_s = s.memcpy(nbytes)
        checks = s.verify() if cfg.verify else None
        notifs = s.notifications()
    notifications = notification_stats(plans, P, notifs)
    return {
        "config": {
            **cfg.to_dict(),
            "mapping": plans[0].mapping.impl,
            "tp_ratio": plans[0].tp_ratio,
            "bytes_per_rank": {"prefill": geometry.rank_bytes(P), "decode": geometry.rank_bytes(D)},
        },
        "plans": [_plan_summary(p, geometry, cfg.blocks) for p in plans],
        **transfer_stats(plans, geometry, cfg.blocks, cfg.requests, runs, memcpy_s),
        "transport": s.transport,
        "notifications": notifications,
        "notified_without_read": sorted(int(r) for r, v in notifications.items() if v["received"] and not v["read"]),
        "verification": summarise_verification(checks),
    }


def notification_stats(
    plans: list[ReadPlan], prefill_tp: int, notifs: dict[int, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Per prefill rank (``"0"``, ...): notifications ``received``, whether any plan
    ``read`` from it, and ``cpu_fraction`` (CPU seconds per wall second while serving: a
    busy-spinning progress thread is ~1.0), from :meth:`TransferSession.notifications`."""
    read_ranks = {r for p in plans for r in p.transfers}
    return {
        str(r): {
            "received": sum(len(v) for v in notifs[r]["notifs"].values()),
            "read": r in read_ranks,
            "cpu_fraction": round(notifs[r]["cpu_s"] / notifs[r]["serving_s"], 3) if notifs[r]["serving_s"] else None,
        }
        for r in range(prefill_tp)
    }


def bytes_per_rank(plans: list[ReadPlan], geometry: KVGeometry, blocks: int, requests: int) -> list[int]:
    """Bytes each decode rank reads per iteration (``requests`` requests)."""
    return [sum(p.bytes_from(r, geometry, blocks) for r in p.transfers) * requests for p in plans]


def transfer_stats(
    plans: list[ReadPlan],
    geometry: KVGeometry,
    blocks: int,
    requests: int,
    runs: list[list[dict[str, Any]]],
    memcpy_s: list[float],
) -> dict[str, Any]:
    """Throughput from timed iterations (``runs[i][decode_rank]`` as returned by
    :meth:`TransferSession.iterate`) and per-rank memcpy seconds: ``gbps`` (all
    ranks' bytes / median slowest-rank wall), ``memcpy_gbps`` (same bytes / slowest
    rank's memcpy), ``ratio``, ``wall_s_median``, ``bytes_per_iteration`` and per-rank
    ``ranks``."""
    nbytes = bytes_per_rank(plans, geometry, blocks, requests)
    total = sum(nbytes)
    wall = statistics.median(max(r["wall_s"] for r in run) for run in runs)
    gbps = total / wall / 1e9 if wall > 0 else float("nan")
    memcpy_gbps = total / max(memcpy_s) / 1e9 if max(memcpy_s) > 0 else float("nan")
    ranks = []
    for d, p in enumerate(plans):
        w = statistics.median(run[d]["wall_s"] for run in runs)
        ndesc = p.descriptors_per_request(geometry, blocks)
        ranks.append(
            {
                "decode_rank": d,
                "bytes_per_iteration": nbytes[d],
                "transfers_per_request": len(p.transfers),
                "descriptors_per_request": ndesc,
                "nixl_descriptors_per_request": runs[-1][d]["nixl_descs"] / requests,
                "wall_s": [run[d]["wall_s"] for run in runs],
                "post_s_median": statistics.median(run[d]["post_s"] for run in runs),
                "gbps": nbytes[d] / w / 1e9 if w > 0 else float("nan"),
                "us_per_descriptor": w / (ndesc * requests) * 1e6 if ndesc else float("nan"),
                "memcpy_gbps": nbytes[d] / memcpy_s[d] / 1e9 if memcpy_s[d] > 0 else float("nan"),
            }
        )
    return {
        "ranks": ranks,
        "bytes_per_iteration": total,
        "wall_s_median": wall,
        "gbps": gbps,
        "memcpy_gbps": memcpy_gbps,
        "ratio": gbps / memcpy_gbps if memcpy_gbps == memcpy_gbps and memcpy_gbps else float("nan"),
    }


def summarise_verification(checks: list[dict[str, Any]] | None) -> dict[str, Any]:
    """Merge :meth:`TransferSession.verify` output: ``{ok, missing, wrong, stray_bytes,
    checked_bytes}``; ``missing``/``wrong`` entries are ``{decode_rank, layer, kind,
    prefill_rank, pages, bytes}``. ``ok`` is None when ``checks`` is None."""
    if checks is None:
        return {"ok": None, "missing": [], "wrong": [], "stray_bytes": None, "checked_bytes": 0}
    issues = [i for c in checks for i in c["issues"]]
    missing = [
        {k: i[k] for k in ("decode_rank", "layer", "kind", "prefill_rank", "pages")} | {"bytes": i["missing_bytes"]}
        for i in issues
        if i["missing_bytes"]
    ]
    wrong = [
        {k: i[k] for k in ("decode_rank", "layer", "kind", "prefill_rank", "pages")} | {"bytes": i["wrong_bytes"]}
        for i in issues
        if i["wrong_bytes"]
    ]
    stray = sum(c["stray_bytes"] for c in checks)
    return {
        "ok": not missing and not wrong and stray == 0,
        "missing": missing,
        "wrong": wrong,
        "stray_bytes": stray,
        "checked_bytes": sum(c["checked_bytes"] for c in checks),
    }


# ---------------------------------------------------------------- CLI
def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``pdsweep bench transfer``."""
    parser.add_argument("--model", required=True, help="catalogue model name, e.g. kimi-linear")
    parser.add_argument("--prefill-tp", type=int, default=1)
    parser.add_argument("--decode-tp", type=int, default=1)
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    parser.add_argument("--blocks", type=int, default=64, help="attention blocks per request (default 64)")
    parser.add_argument("--requests", type=int, default=1, help="requests per iteration (default 1)")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations (default 5)")
    parser.add_argument(
        "--plan",
        choices=PLANS,
        default="fixed",
        help="vLLM read plan: fixed (PR #49297), unfixed (its parent: refuses MLA+SSM at tp_ratio < 0 "
        "with its assert), unfixed-asserts-off (hypothetical single read)",
    )
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cache memory: cpu (DRAM) or cuda (VRAM via torch)"
    )
    parser.add_argument(
        "--verify", action=argparse.BooleanOptionalAction, default=True, help="check every destination byte"
    )
    parser.add_argument(
        "--mapping",
        choices=("auto", "vllm", "builtin"),
        default="auto",
        help="source-rank rule: vLLM's compute_tp_mapping (auto: when importable) or pdsweep's copy",
    )
    parser.add_argument(
        "--progress-delay-us",
        type=int,
        default=DEFAULT_PROGRESS_DELAY_US,
        help="NIXL progress-thread delay in microseconds (>= 1)",
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the result as JSON")
    parser.add_argument(
        "--models",
        "--sweep",
        dest="models",
        type=Path,
        metavar="FILE",
        default=None,
        help="model catalogue, or a sweep file naming one (default sweeps/models.yaml)",
    )


def _find_model(path: Path | None, name: str) -> ModelSpec:
    """The catalogue entry ``name``: validated by the pydantic schema where pydantic is installed,
    else its geometry alone (:mod:`pdsweep.xfer.light`: the lent device has no pydantic)."""
    if path is None:
        path = Path("sweeps/models.yaml")
        if not path.exists():
            path = Path(__file__).resolve().parents[2] / "sweeps" / "models.yaml"
    try:  # pydantic is optional here (the lent device has none): a lazy import, by the policy
        from pdsweep.sweepfile.sweep import load_catalogue, load_sweep
    except ImportError as e:
        if e.name != "pydantic" and not str(e.name).startswith("pydantic"):
            raise

        try:
            return load_model(path, name)  # type: ignore[return-value]  # duck-typed: what kv_geometry reads
        except ValueError as err:
            raise UserError(str(err)) from None
    import yaml

    try:
        is_sweep = "matrix" in (yaml.safe_load(Path(path).read_text()) or {})
    except (OSError, yaml.YAMLError):
        is_sweep = False
    cat = load_sweep(path).catalogue if is_sweep else load_catalogue(path)
    if name not in cat.models:
        raise UserError(f"{path}: unknown model '{name}' (allowed: {', '.join(cat.models)})")
    return cat.models[name]


def _fmt_gbps(x: float) -> str:
    return "n/a" if x != x else f"{x:.2f}"


def main(args: argparse.Namespace) -> int:
    """Run the benchmark, print a summary; returns 0 when verification passes (or is
    off). Raises ``GateFailed`` when it fails or the unfixed plan refuses (exit 1),
    ``UserError`` on bad input (exit 2); a rank process that fails raises
    ``RuntimeError`` (exit 3, with its traceback). Codes: :func:`pdsweep.core.errors.run_main`."""
    cfg = BenchConfig.from_cli_args(args)
    check_device(cfg.device)
    try:
        res = run_transfer_bench(cfg)
    except UnfixedPlanAsserts as e:  # what the unfixed build does: a failed verdict, not bad input
        print(f"refused before reading: {e}")
        raise GateFailed("bench transfer: the read plan refuses this TP pair (as the unfixed build does)") from None
    except ValueError as e:  # a TP pair or geometry the read plans cannot have
        raise UserError(str(e)) from None
    print_summary(res)
    if args.json:
        write_json(args.json, res)
        print(f"wrote {args.json}")
    v = res["verification"]
    if v["ok"] is None:
        print("verification: skipped (--no-verify)")
        return 0
    if v["ok"]:
        print(f"verification: OK, {v['checked_bytes']} bytes checked")
        return 0
    print_verification_failures(v)
    raise GateFailed(f"bench transfer: verification FAILED ({v['stray_bytes']} stray bytes)")


def print_summary(res: dict[str, Any]) -> None:
    """Config, plans, per-rank figures, throughput and notifications of a result."""
    c = res["config"]
    print(
        f"{c['model']} prefill TP {c['prefill_tp']} -> decode TP {c['decode_tp']} (tp_ratio {c['tp_ratio']}), "
        f"plan {c['plan']}, block_size {c['block_size']}, {c['blocks']} blocks x {c['requests']} request(s), "
        f"device {c['device']}, mapping {c['mapping']}"
    )
    for p in res["plans"]:
        print(
            f"  decode rank {p['decode_rank']}: reads ranks {p['read_ranks']} "
            f"(attention {p['attention_source_ranks']}, SSM {p['ssm_source_ranks']}), notifies {p['notify_ranks']}"
        )
        for note in p["upstream_notes"]:
            print(f"    note: {note}")
    for r in res["ranks"]:
        print(
            f"  decode rank {r['decode_rank']}: {r['bytes_per_iteration'] / 2**20:.2f} MiB/iter, "
            f"{r['transfers_per_request']} transfers and {r['descriptors_per_request']} descriptors per request "
            f"({r['nixl_descriptors_per_request']:.0f} after NIXL merging), "
            f"{r['us_per_descriptor']:.2f} us/descriptor, "
            f"{_fmt_gbps(r['gbps'])} GB/s"
        )
    print(
        f"transfer: {_fmt_gbps(res['gbps'])} GB/s, host memcpy {_fmt_gbps(res['memcpy_gbps'])} GB/s, "
        f"ratio {res['ratio']:.2f}x memcpy, UCX transport: {res['transport']}"
    )
    cpu = {r: n["cpu_fraction"] for r, n in res["notifications"].items()}
    print(
        f"prefill ranks: notifications received {[n['received'] for n in res['notifications'].values()]}, "
        f"CPU fraction (progress delay {c['progress_delay_us']} us) {cpu}"
    )
    if res["notified_without_read"]:
        print(f"prefill ranks notified without being read: {res['notified_without_read']}")


def print_verification_failures(v: dict[str, Any]) -> None:
    """What verification found missing or wrong, per prefill rank, then per layer."""
    print(f"verification: FAILED ({v['checked_bytes']} bytes checked, {v['stray_bytes']} stray bytes)")
    for what in ("missing", "wrong"):
        by_rank: dict[int, list[dict[str, Any]]] = {}
        for i in v[what]:
            by_rank.setdefault(i["prefill_rank"], []).append(i)
        for r, items in sorted(by_rank.items()):
            kinds = sorted({i["kind"] for i in items})
            print(
                f"  {what} from prefill rank {r}: {sum(i['bytes'] for i in items)} bytes in "
                f"{len({(i['decode_rank'], i['layer']) for i in items})} layer(s) ({', '.join(kinds)})"
            )
    for what in ("missing", "wrong"):
        for i in v[what]:
            print(
                f"  {what.upper()}: decode rank {i['decode_rank']} layer {i['layer']} ({i['kind']}) "
                f"from prefill rank {i['prefill_rank']}: {i['bytes']} bytes in {i['pages']} page(s)"
            )


def _cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdsweep.xfer.bench", description=__doc__.splitlines()[0])
    add_cli_args(parser)
    args = parser.parse_args(argv)
    return run_main(lambda: main(args))


if __name__ == "__main__":
    sys.exit(_cli())
