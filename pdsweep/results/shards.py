"""The ``n`` run directories of a sharded sweep (``pdsweep run --shard i/n``, one per job)
read as one run: :func:`merged_view` writes a directory holding one run.json and plan.json
(every shard's cells, rejected and folded cells) and each cell's directory from the shard that
ran it (hard-linked files; nothing pdsweep reads may lie outside a run directory), so
``gate``, ``report`` and ``compare`` judge it as any other run.

Fail closed: every shard ``1..n`` must be given exactly once, all of one sweep file
(``sweep_sha256``) and one ``n``; a cell two shards ran is refused (the cut is disjoint by
construction, :mod:`pdsweep.plan.shards`: two copies mean the jobs cut different sweeps).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from pdsweep.core.errors import UserError
from pdsweep.results import layout

MERGED_SUFFIX = ".shards"  # the view's name: the first shard's directory name + this


def _shard_of(run_dir: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(run.json, plan.json, its ``shard``) of one shard directory; ``UserError`` naming the
    file and field when it is not a shard of a run."""
    try:
        index = layout.read_json(run_dir / layout.RUN_FILE)
    except FileNotFoundError:
        raise layout.not_a_run(run_dir) from None
    shard = index.get("shard")
    if (
        not isinstance(shard, dict)
        or not isinstance(shard.get("index"), int)
        or not isinstance(shard.get("count"), int)
    ):
        raise UserError(
            f"{run_dir / layout.RUN_FILE}: shard: missing (got {shard!r}); several run directories are read as one "
            "run only when each is a shard (`pdsweep run --shard i/n`)"
        )
    return index, layout.read_json_or_none(run_dir / layout.PLAN_FILE) or {}, shard


def _check(shards: list[tuple[Path, dict[str, Any], dict[str, Any], dict[str, Any]]]) -> int:
    """The shard count, after refusing a missing, repeated or foreign shard."""
    counts = {s["count"] for *_, s in shards}
    shas = {i.get("sweep_sha256") for _, i, _, _ in shards}
    if len(counts) != 1:
        raise UserError(f"shard.count differs across {', '.join(str(d) for d, *_ in shards)}: {sorted(counts)}")
    if len(shas) != 1:
        raise UserError("the shards ran different sweep files (sweep_sha256 differs): they are not one run")
    n = counts.pop()
    got = sorted(s["index"] for *_, s in shards)
    if got != list(range(1, n + 1)):
        missing = sorted(set(range(1, n + 1)) - set(got))
        twice = sorted({i for i in got if got.count(i) > 1})
        given = ", ".join(f"{d} = {s['index']}/{n}" for d, *_, s in shards)
        raise UserError(
            f"shards of one run: expected 1..{n} once each; missing {missing or 'none'}, repeated {twice or 'none'} "
            f"(given: {given})"
        )
    return n


def _merge_cells(shards) -> tuple[dict[str, Any], dict[str, Path]]:
    """run.json ``cells`` of every shard, and the shard directory of each cell."""
    cells: dict[str, Any] = {}
    where: dict[str, Path] = {}
    for d, index, _, _ in shards:
        for cid, entry in (index.get("cells") or {}).items():
            if cid in where:
                raise UserError(f"cell {cid} is in two shards ({where[cid]}, {d}): the jobs cut different sweeps")
            cells[cid], where[cid] = entry, d
    return cells, where


def _union(records: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for r in records:
        k = r.get(key) or (r.get("cell") or {}).get("id") if isinstance(r, dict) else None
        if k is not None:
            out.setdefault(str(k), r)
    return list(out.values())


def _link_or_copy(src: str, dst: str) -> None:
    """A hard link (the view costs no space; results are never rewritten in place), else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def merged_view(run_dirs: list[Path]) -> Path:
    """One run directory for ``run_dirs``: itself when one is given; else the view
    ``<shard 1's dir><MERGED_SUFFIX>`` next to it (rewritten on each call). Raises
    ``UserError`` (see the module doc)."""
    dirs = [Path(d) for d in run_dirs]
    if len(dirs) == 1:
        return dirs[0]
    shards = [(d, *_shard_of(d)) for d in dirs]
    n = _check(shards)
    shards.sort(key=lambda s: s[3]["index"])
    cells, where = _merge_cells(shards)
    base = dict(shards[0][1])
    finished = [i.get("finished") for _, i, _, _ in shards]
    base.update(
        name=f"{base.get('name') or shards[0][0].name}{MERGED_SUFFIX}",
        cells=cells,
        started=min(str(i.get("started")) for _, i, _, _ in shards),
        finished=None if None in finished else max(map(str, finished)),
        rejected=_union([r for _, i, _, _ in shards for r in i.get("rejected") or []], "cell_id"),
        folded={a: r for _, i, _, _ in shards for a, r in (i.get("folded") or {}).items()},
        shard={"count": n, "merged": [str(d.resolve()) for d, *_ in shards]},
        # each shard froze the expected scores of its own cells' models (pdsweep.judge.planned.frozen_problems)
        expected={m: t for _, i, _, _ in shards for m, t in (i.get("expected") or {}).items()},
    )
    plan = {
        "cells": _union([c for _, _, p, _ in shards for c in p.get("cells") or []], "id"),
        "rejected": _union([r for _, _, p, _ in shards for r in p.get("rejected") or []], "cell_id"),
        "references": {c: r for _, _, p, _ in shards for c, r in (p.get("references") or {}).items()},
    }
    first = shards[0][0].resolve()  # shard 1's directory, whatever order they were given in
    view = first.with_name(first.name + MERGED_SUFFIX)
    view.mkdir(exist_ok=True)
    for cid, d in where.items():
        dest = layout.cell_dir(view, cid)
        if dest.exists():
            shutil.rmtree(dest)
        if layout.cell_dir(d, cid).is_dir():
            shutil.copytree(d / cid, dest, symlinks=True, copy_function=_link_or_copy)
    layout.write_json(view / layout.RUN_FILE, base)
    layout.write_json(view / layout.PLAN_FILE, plan)
    return view
