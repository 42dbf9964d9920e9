"""Expand a sweep matrix into named cells; reject invalid ones with the reason; derive
the exact ``vllm serve`` argv and environment of every instance.

Matrix semantics follow GitHub Actions ``strategy.matrix``: the product of the axes,
minus ``exclude`` entries (partial match), then each ``include`` entry is merged into
every combination whose *original* axis values it does not overwrite, or appended as a
new combination when it fits none.
"""

from __future__ import annotations

import fnmatch
import itertools
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from pdsweep.core.errors import UserError
from pdsweep.core.faults import READ_FAULT_ENV_VAR, read_fault_every
from pdsweep.plan import rules
from pdsweep.plan.blocks import arch_serve_args
from pdsweep.plan.cell import Cell, Rejected
from pdsweep.plan.crossnode import loopback_fields
from pdsweep.spec.axes import AXES, EXPECT_KEYS, REF_ENTRY_KEYS
from pdsweep.spec.catalogue import ModelSpec
from pdsweep.spec.sweep import LoadedSweep

MAX_INSTANCES = 12  # per cell; bounded by the per-slot port layout below
PORTS_PER_SLOT = 200
SIDE_CHANNEL_FIRST, SIDE_CHANNEL_STRIDE = 100, 8  # Slot.side_channel_port: offset in the slot, ports per instance
# KV blocks per CPU instance. VLLM_CPU_KVCACHE_SPACE=1 GiB gives a tiny model ~32k blocks
# (tiny-llama: 1,048,576 tokens), and with prefill TP > decode TP the decode handshake builds
# per-source split descriptor lists over all of them in Python
# (nixl/base_worker.py _build_local_splits_from_plan): 77 s per prefill rank on 2 cores.
# 256 blocks hold max_num_seqs x max_model_len of every cpu-smoke cell several times over.
CPU_NUM_BLOCKS = 256
# pdsweep.engine.vllm_plugin on CPU (each explained there): NIXL progress-thread delay, AMX tile
# permission, shm readers spin 10 ms (not 1 s) after an RPC, an engine holding blocks for a
# remote peer steps every 20 ms (not 1 ms), RoPE on contiguous copies of strided views,
# CPU_MLA takes logical blocks that are multiples of 16 (hybrid MLA + Mamba: 128).
CPU_PLUGIN_ENV = {
    "PDSWEEP_NIXL_PROGRESS_DELAY_US": "1000",
    "PDSWEEP_CPU_AMX_PERMISSION": "1",
    "PDSWEEP_SHM_BUSY_LOOP_S": "0.01",
    "PDSWEEP_ENGINE_IDLE_STEP_S": "0.02",
    "PDSWEEP_CPU_ROPE_STRIDES": "1",
    "PDSWEEP_CPU_MLA_LOGICAL_BLOCKS": "1",
}


@dataclass
class Plan:
    """Result of :func:`expand`. ``cells`` are valid and include reference cells."""

    loaded: LoadedSweep
    cells: list[Cell] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)

    @property
    def pd_cells(self) -> list[Cell]:
        return [c for c in self.cells if c.kind == "pd"]

    def model(self, cell: Cell) -> ModelSpec:
        return self.loaded.catalogue.models[cell.model]


def _matches(combo: dict[str, Any], entry: dict[str, Any]) -> bool:
    return all(k in combo and str(combo[k]) == str(v) for k, v in entry.items())


def matrix_combinations(matrix: Any) -> list[dict[str, Any]]:
    """GitHub-Actions matrix expansion: product, exclude, include (see module doc)."""
    axes = [(k, getattr(matrix, k)) for k in AXES if getattr(matrix, k)]
    keys = [k for k, _ in axes]
    combos = [dict(zip(keys, vals)) for vals in itertools.product(*(v for _, v in axes))]
    combos = [c for c in combos if not any(_matches(c, e) for e in matrix.exclude)]
    originals = [dict(c) for c in combos]
    extra: list[dict[str, Any]] = []
    for entry in matrix.include:
        if entry.get("kind") == "ref":
            continue  # an expectation of reference cells (apply_ref_expectations), not a cell
        merged = False
        for combo, orig in zip(combos, originals):
            if all(str(orig[k]) == str(v) for k, v in entry.items() if k in orig):
                combo.update(entry)
                merged = True
        if not merged:
            extra.append(dict(entry))
    return combos + extra


def _to_cell(combo: dict[str, Any], ls: LoadedSweep) -> Cell:
    d = ls.sweep.defaults
    v = {
        k: getattr(d, k)
        for k in (
            "prefill_tp",
            "decode_tp",
            "prefill_block_size",
            "decode_block_size",
            "num_prefill",
            "num_decode",
            "decode_dp",
            "prefill_pp",
            "kv_cache_layout",
            "kv_buffer_device",
            "build",
            "serve_args",
            "env",
            "router",
            "fault",
        )
    }
    v["kv_buffer_device"] = v["kv_buffer_device"] or ("cpu" if ls.sweep.platform == "cpu" else "cuda")
    for k, val in combo.items():
        if k == "tp":
            p, dd = str(val)[1:].split("d")
            v["prefill_tp"], v["decode_tp"] = int(p), int(dd)
        elif k == "block_size":
            v["prefill_block_size"] = v["decode_block_size"] = int(val)
        elif k in EXPECT_KEYS:
            continue
        else:
            v[k] = val
    if "model" not in combo:
        raise UserError(f"{ls.path}: matrix.include entry {combo} has no 'model' and matches no combination")
    cell = Cell(
        model=combo["model"],
        **{k: val for k, val in v.items() if k != "model"},
        platform=ls.sweep.platform,
        expect_fail=combo.get("expect") == "fail",
        expect_reason=combo.get("reason"),
        expect_ref=combo.get("ref"),
        expect_match=combo.get("match"),
        expect_vllm=combo.get("vllm"),
        expect_without=tuple(combo.get("without") or ()),
    )
    return resolve_for_plan(cell, ls)


def resolve_for_plan(cell: Cell, ls: LoadedSweep) -> Cell:
    """``cell`` with a build-conditional expectation resolved against its build's vLLM
    (:mod:`pdsweep.spec.expectations`), or kept as declared when that build is not there yet."""
    from pdsweep.spec.expectations import conditional, resolve

    if not conditional(cell):
        return cell
    from pdsweep.builds.fixprobes import probe_python
    from pdsweep.plan.builds import build_python

    try:
        python = build_python(ls, cell.build)
    except UserError:
        return replace(cell, expect_note=f"expected to fail as declared: build {cell.build} not made yet")
    return resolve(cell, *probe_python(python))


def expand(ls: LoadedSweep) -> Plan:
    """Expand ``ls`` into valid cells (PD cells, then one reference per distinct
    (model, decode TP, decode block, build, variants) when ``eval.reference``) and
    rejected cells with rule id and reason. Raises ``UserError`` on duplicate ids and on a
    budget above its ceiling (:func:`pdsweep.plan.budgets.ceiling_errors`)."""
    from pdsweep.plan.budgets import ceiling_errors

    if over := ceiling_errors(ls.sweep, ls.path):
        raise UserError("\n".join(over))
    plan = Plan(loaded=ls)
    seen: dict[str, Cell] = {}
    for combo in matrix_combinations(ls.sweep.matrix):
        cell = _to_cell(combo, ls)
        if cell.id in seen:
            raise UserError(
                f"{ls.path}: matrix: two combinations give the same cell id '{cell.id}' "
                "(an include entry duplicates a product combination?)"
            )
        seen[cell.id] = cell
        model = ls.catalogue.models[cell.model]
        if cell.num_prefill + cell.num_decode > MAX_INSTANCES:
            plan.rejected.append(Rejected(cell, "instances", f"more than {MAX_INSTANCES} instances per cell"))
            continue
        bad = rules.check(cell, model, ls)
        if not bad and cell.kind == "pd":
            from pdsweep.plan.ports import overlap

            why = overlap(cell, ls, SIDE_CHANNEL_STRIDE, PORTS_PER_SLOT, SIDE_CHANNEL_FIRST)
            bad = ("side-channel-ports", why) if why else None
        if bad:
            plan.rejected.append(Rejected(cell, *bad))
        else:
            plan.cells.append(cell)
    if ls.sweep.eval.reference:
        refs: dict[str, Cell] = {}
        for c in plan.cells:
            r = reference_of(c, ls)
            refs.setdefault(r.id, r)
        plan.cells.extend(apply_ref_expectations(list(refs.values()), ls))
    elif entries := [i for i, e in enumerate(ls.sweep.matrix.include) if e.get("kind") == "ref"]:
        raise UserError(
            f"{ls.path}: matrix.include[{entries[0]}] (kind: ref) declares an expectation of reference cells, "
            "but eval.reference is false: no reference cell runs; drop the entry or set eval.reference: true"
        )
    return plan


_REF_FIELDS = {"block_size": "decode_block_size"}  # a kind: ref entry's key -> the reference Cell's field


def apply_ref_expectations(refs: list[Cell], ls: LoadedSweep) -> list[Cell]:
    """``refs`` with the expectations of the sweep's ``kind: ref`` include entries applied
    (every key of :data:`pdsweep.spec.axes.REF_ENTRY_KEYS` an entry gives must equal the
    reference's; a later entry overrides an earlier one). A reference is final for the PD
    cells compared with it, so an engine fault that breaks the single instance itself (e.g.
    the unpatched CPU RoPE kernel) is declared on it. Raises ``UserError`` naming the entry
    when it matches no reference cell."""
    out = list(refs)
    for i, e in enumerate(ls.sweep.matrix.include):
        if e.get("kind") != "ref":
            continue
        keys = {_REF_FIELDS.get(k, k): v for k, v in e.items() if k in REF_ENTRY_KEYS}
        hits = [j for j, r in enumerate(out) if all(str(getattr(r, k)) == str(v) for k, v in keys.items())]
        if not hits:
            raise UserError(
                f"{ls.path}: matrix.include[{i}] (kind: ref) {e} matches no reference cell; the "
                f"references are: {', '.join(r.id for r in refs) or 'none (eval.reference false?)'}"
            )
        for j in hits:
            out[j] = resolve_for_plan(
                replace(
                    out[j],
                    expect_fail=True,
                    expect_reason=e.get("reason"),
                    expect_ref=e.get("ref"),
                    expect_match=e.get("match"),
                    expect_vllm=e.get("vllm"),
                    expect_without=tuple(e.get("without") or ()),
                ),
                ls,
            )
    return out


def select_cells(plan: Plan, pattern: str | None) -> list[Cell]:
    """Cells of ``plan`` matching ``pattern`` (glob on the id; None: all), plus the
    references they need."""
    if not pattern:
        return list(plan.cells)
    chosen = [c for c in plan.cells if fnmatch.fnmatch(c.id, pattern)]
    refs = (
        {reference_of(c, plan.loaded).id for c in chosen if c.kind == "pd"}
        if plan.loaded.sweep.eval.reference
        else set()
    )
    return [c for c in plan.cells if c in chosen or c.id in refs]


def reference_of(cell: Cell, ls: LoadedSweep) -> Cell:
    """The reference cell a PD ``cell`` is compared with: :meth:`Cell.reference` on the
    sweep's default build, with the serve args its variant names in ``reference`` (default:
    its own variant)."""
    v = ls.sweep.serve_variant(cell.serve_args)
    return cell.reference(ls.sweep.defaults.build, v.reference or cell.serve_args)


# ---------------------------------------------------------------- instances
@dataclass(frozen=True)
class Slot:
    """Resources of one scheduled cell: GPU ids, a private block of ports, CPU cores, and
    (placed over nodes, :mod:`pdsweep.plan.placement`) the node of each instance; ``gpus`` are
    then the node-local ids of instance 0's group, instance 1's, ... in instance order."""

    index: int
    gpus: tuple[int, ...]
    port_base: int
    cpus: tuple[int, ...] = ()
    hosts: tuple[str, ...] = ()  # per instance: the address it serves on; empty: loopback
    nodes: tuple[str, ...] = ()  # per instance: the Slurm node it runs on; empty: this host

    def host(self, k: int) -> str:
        return self.hosts[k] if self.hosts else "127.0.0.1"

    def node(self, k: int) -> str:
        return self.nodes[k] if self.nodes else ""

    def proxy_port(self) -> int:
        return self.port_base

    def http_port(self, k: int) -> int:
        return self.port_base + 1 + k

    def vllm_port(self, k: int) -> int:
        return self.port_base + 20 + 5 * k

    def side_channel_port(self, k: int) -> int:
        """Base side-channel port of instance ``k``; vLLM adds rank offsets
        (``SIDE_CHANNEL_STRIDE`` reserved; :func:`pdsweep.plan.ports.overlap` rejects more)."""
        return self.port_base + SIDE_CHANNEL_FIRST + SIDE_CHANNEL_STRIDE * k


@dataclass(frozen=True)
class InstanceSpec:
    """One ``vllm serve`` process: argv (never a shell string) and the env it adds."""

    name: str  # prefill-0, decode-1, single-0
    role: str  # prefill | decode | single
    tp: int
    port: int
    side_channel_port: int | None
    gpus: tuple[int, ...]
    argv: tuple[str, ...]
    env: dict[str, str]
    host: str = "127.0.0.1"  # address it serves on: its node's NodeAddr under Slurm
    node: str = ""  # Slurm node name ("" on the local launcher)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "argv": list(self.argv)}


def place(spec: InstanceSpec, port: int, vllm_port: int, side_channel_port: int | None) -> InstanceSpec:
    """``spec`` serving HTTP on ``port`` (argv ``--port``) with ``VLLM_PORT`` = ``vllm_port`` and,
    for a PD instance, ``VLLM_NIXL_SIDE_CHANNEL_PORT`` = ``side_channel_port`` (vLLM adds each TP
    rank's offset: ``vllm/envs.py``, ``nixl/base_worker.py``). The one function that writes an
    instance's ports: :func:`instances` uses it for the planned slot, the deploy layer to move an
    instance to the port block it really got (:func:`on_slot`, ``deploy.instances.relocate``)."""
    argv = list(spec.argv)
    argv[argv.index("--port") + 1] = str(port)
    env = {**spec.env, "VLLM_PORT": str(vllm_port)}
    if side_channel_port is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
    return replace(spec, port=port, side_channel_port=side_channel_port, argv=tuple(argv), env=env)


def on_slot(specs: list[InstanceSpec], slot: Slot) -> list[InstanceSpec]:
    """``specs`` (as :func:`instances` made them, in their order) on ``slot``'s ports."""
    out = []
    for k, s in enumerate(specs):
        side = None if s.side_channel_port is None else slot.side_channel_port(k)
        out.append(place(s, slot.http_port(k), slot.vllm_port(k), side))
    return out


def derived_env(model: ModelSpec, role: str, layout: str = "HND") -> dict[str, str]:
    """Environment vLLM needs for this model and role (never hand-written in sweeps):
    ``VLLM_SSM_CONV_STATE_LAYOUT=DS`` for SSM models (nixl/base_worker.py asserts
    ``is_conv_state_dim_first``); ``VLLM_KV_CACHE_LAYOUT`` on decode (the cell's
    ``kv_cache_layout``, upstream run_accuracy_test.sh DECODER_KV_LAYOUT) for non-MLA attention;
    for MLA only NHD is pinned: unpinned, vLLM takes its backend's first layout (CPU_MLA declares
    none: LBNHC, i.e. NHD, "Using LBNHC KV cache layout." in tiny-mla's logs), and NIXL ignores an MLA
    cache's layout (``NixlConnector.get_required_kvcache_layout`` returns None)."""
    env: dict[str, str] = {}
    if model.is_hybrid:
        env["VLLM_SSM_CONV_STATE_LAYOUT"] = "DS"
    if role == "decode" and (model.attention != "mla" or layout != "HND"):
        env["VLLM_KV_CACHE_LAYOUT"] = layout
    return env


def parallel_args(cell: Cell, model: ModelSpec, role: str) -> list[str]:
    """``vllm serve`` flags of the cell's parallelism beyond TP: prefill pipeline stages
    (``prefill_pp``; vLLM takes PP on the producer only, :mod:`pdsweep.plan.rules`
    ``pipeline-parallel``) and decode data parallel (``decode_dp``), with expert parallel for
    mixture-of-experts models only (catalogue ``moe``; upstream DP_EP runs a MoE model)."""
    if role == "prefill" and cell.prefill_pp > 1:
        return ["--pipeline-parallel-size", str(cell.prefill_pp)]
    if role == "decode" and cell.decode_dp > 1:
        return ["--data-parallel-size", str(cell.decode_dp)] + (["--enable-expert-parallel"] if model.moe else [])
    return []


def kv_transfer_config(cell: Cell, role: str, ls: LoadedSweep) -> dict[str, Any]:
    """``--kv-transfer-config`` for a NixlConnector producer (prefill) or consumer (decode),
    with the serve-args variant's ``kv_transfer_extra`` merged in (its
    ``kv_connector_extra_config`` key by key; connector, role and buffer stay pdsweep's)."""
    cfg: dict[str, Any] = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both"
        if ls.sweep.defaults.kv_role == "both"
        else {"prefill": "kv_producer", "decode": "kv_consumer"}[role],
        "kv_buffer_device": cell.kv_buffer_device,
    }
    if role == "decode" and cell.kv_cache_layout == "NHD" and ls.catalogue.models[cell.model].attention != "mla":
        # prefill's cache is LBHNC (the connector's choice): vLLM's way to read it into an LBNHC cache
        cfg["enable_permute_local_kv"] = True
    if ls.sweep.defaults.kv_lease_duration_s:
        cfg["kv_connector_extra_config"] = {"kv_lease_duration": ls.sweep.defaults.kv_lease_duration_s}
    extra = dict(ls.sweep.serve_variant(cell.serve_args).kv_transfer_extra)
    if "kv_connector_extra_config" in extra:
        extra["kv_connector_extra_config"] = {
            **cfg.get("kv_connector_extra_config", {}),
            **extra["kv_connector_extra_config"],
        }
    return {**cfg, **extra}


PUSH_CONNECTOR = "NixlPushConnector"  # vLLM kv_connector/factory.py: prefill WRITEs (nixl/push_worker.py)


def transfer_mode(argv: Sequence[str]) -> str | None:
    """``"push"`` when an instance's ``--kv-transfer-config`` names :data:`PUSH_CONNECTOR`,
    ``"pull"`` for any other connector, None without one (a single instance) or when its
    JSON cannot be read. Push: prefill initiates the NIXL WRITEs; pull: decode the READs."""
    for i, a in enumerate(argv):
        flag, eq, val = a.partition("=")
        if flag != "--kv-transfer-config":
            continue
        try:
            cfg = json.loads(val if eq else argv[i + 1])
        except (ValueError, IndexError):
            return None
        return "push" if isinstance(cfg, dict) and cfg.get("kv_connector") == PUSH_CONNECTOR else "pull"
    return None


def instances(cell: Cell, slot: Slot, ls: LoadedSweep, model_path: str, python: str) -> list[InstanceSpec]:
    """Every instance of ``cell`` on ``slot``: prefill-i, then decode-i (or single-0).

    GPUs are handed out consecutively from ``slot.gpus`` (prefill first, as upstream);
    on CPU each TP rank is bound to a core with ``VLLM_CPU_OMP_THREADS_BIND``.
    """
    s, d = ls.sweep, ls.sweep.defaults
    model = ls.catalogue.models[cell.model]
    variant = s.serve_variant(cell.serve_args)
    roles = (
        [("single", cell.decode_tp, cell.decode_block_size)]
        if cell.kind == "ref"
        else [("prefill", cell.prefill_tp, cell.prefill_block_size)] * cell.num_prefill
        + [("decode", cell.decode_tp, cell.decode_block_size)] * cell.num_decode
    )
    eager = d.enforce_eager if variant.enforce_eager is None else variant.enforce_eager
    out, gpu_i, rank_i, dec_i, counters = [], 0, 0, 0, {"prefill": 0, "decode": 0, "single": 0}
    for k, (role, tp, block) in enumerate(roles):
        name = f"{role}-{counters[role]}"
        counters[role] += 1
        dp = cell.decode_dp if role == "decode" else cell.prefill_pp if role == "prefill" else 1  # ranks per TP rank
        gpus = slot.gpus[gpu_i : gpu_i + tp * dp] if slot.gpus else ()
        gpu_i += tp * dp
        argv = [
            python,
            "-m",
            "vllm.entrypoints.cli.main",
            "serve",
            model_path,
            "--served-model-name",
            cell.model,
            "--host",
            slot.host(k),
            "--port",
            "0",  # place() below
            "--tensor-parallel-size",
            str(tp),
            "--block-size",
            str(block),
            "--max-model-len",
            str(d.max_model_len or model.max_model_len),
            "--seed",
            "0",
        ]
        if s.platform == "cuda":
            argv += ["--gpu-memory-utilization", str(d.gpu_memory_utilization)]
        if model.tiny is not None:  # our own float32 weights: serve in the catalogue dtype, not vLLM's auto
            argv += ["--dtype", model.dtype]
        if eager:
            argv.append("--enforce-eager")
        argv += parallel_args(cell, model, role)
        if d.max_num_seqs:
            argv += ["--max-num-seqs", str(d.max_num_seqs)]
        blocks = d.num_blocks or (
            cpu_num_blocks(d.max_model_len or model.max_model_len, d.max_num_seqs) if s.platform == "cpu" else None
        )
        if blocks:
            argv += ["--num-gpu-blocks-override", str(blocks)]
        if role != "single":
            argv += ["--kv-transfer-config", json.dumps(kv_transfer_config(cell, role, ls), separators=(",", ":"))]
        extra = list(model.serve_args) + arch_serve_args(model, s.platform) + list(variant.both)
        extra += list(variant.prefill if role == "prefill" else variant.decode if role == "decode" else [])
        argv = override_flags(argv, extra)
        env = {**derived_env(model, role, cell.kv_cache_layout), **model.env, **s.ucx, **s.env[cell.env]}
        env["VLLM_PORT"] = ""  # place() below: the ports keep their place in the env's order
        side = None
        if role != "single":
            side = slot.side_channel_port(k)
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = ""
            if slot.hosts:  # decode reaches prefill's side channel at the prefill node (envs.py default: localhost)
                env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = slot.host(k)
        if cell.fault != "none":  # a drill kills its own instances, never ones other cells reuse
            env["PDSWEEP_FAULT_DRILL"] = cell.fault
        if role == "decode":  # decode reads: its log names the UCX transport and each READ's rank (transfer.json)
            env.setdefault("UCX_PROTO_INFO", "y")
            env.setdefault("PDSWEEP_NIXL_READ_LOG", "1")  # pdsweep.engine.readlog, via pdsweep's vLLM plugin
            if every := read_fault_every(cell.fault):  # the READ-failure drill (pdsweep.engine.readfault)
                env[READ_FAULT_ENV_VAR] = str(every)
        if role == "prefill" and transfer_mode(argv) == "push":  # push: prefill WRITEs, so it logs them
            env.setdefault("UCX_PROTO_INFO", "y")
            env.setdefault("PDSWEEP_NIXL_WRITE_LOG", "1")  # pdsweep.engine.readlog's WRITE log
        if s.platform == "cuda":  # nvidia-smi's indices (PCI bus order): CUDA's only under PCI_BUS_ID
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        else:
            cores = slot.cpus or tuple(range(os.cpu_count() or 1))
            env["VLLM_TARGET_DEVICE"] = "cpu"
            env["VLLM_CPU_KVCACHE_SPACE"] = str(d.cpu_kvcache_space_gib)
            placed = dec_i if role == "decode" else rank_i
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind(role, tp * dp, placed, cores)
            for var, val in CPU_PLUGIN_ENV.items():  # pdsweep.engine.vllm_plugin (a sweep's env may override)
                env.setdefault(var, val)
            if role == "decode":
                dec_i += tp * dp
            else:
                rank_i += tp * dp
        spec = InstanceSpec(name, role, tp, 0, side, tuple(gpus), tuple(argv), env, slot.host(k), slot.node(k))
        out.append(place(spec, slot.http_port(k), slot.vllm_port(k), side))
    if bad := loopback_fields(out):  # pdsweep.plan.crossnode: fails the plan, not a cell at run time
        raise UserError(
            f"cell {cell.id}: loopback address on a path between hosts (its instances run on nodes "
            f"{', '.join(sorted({i.node for i in out}))} at {', '.join(sorted({i.host for i in out}))}): "
            + "; ".join(bad)
            + ". Each must be the node's reachable address (Slurm NodeAddr, scontrol show node)"
        )
    return out


def cpu_bind(role: str, ranks: int, first: int, cores: tuple[int, ...]) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` of one CPU instance: prefill (and single) ranks take
    cores from the first up, decode ranks from the last core down, each in instance order
    (``first``: ranks of its side placed before it). So a decode instance binds the same cores whatever its
    prefill's TP is, and the same decode serves every cell that pairs with it
    (:mod:`pdsweep.deploy.instances`); with 2 cores P TP1 -> core 0, D TP1 -> core 1."""
    n = len(cores)
    if role == "decode":
        return "|".join(str(cores[(n - 1 - first - r) % n]) for r in range(ranks))
    return "|".join(str(cores[(first + r) % n]) for r in range(ranks))


def planned_blocks(model: ModelSpec, platform: str, spec: InstanceSpec) -> dict[str, Any]:
    """The effective blocks of one instance from its real argv (:mod:`pdsweep.plan.blocks`); an
    ``error`` entry with vLLM's message where no kernel block fits."""
    from pdsweep.plan.blocks import effective_blocks

    try:
        return effective_blocks(model, platform, spec.tp, spec.argv).to_dict()
    except ValueError as e:
        return {"logical": None, "kernel": None, "error": str(e)}


def cpu_num_blocks(max_model_len: int, max_num_seqs: int | None) -> int:
    """KV blocks for a CPU instance: ``CPU_NUM_BLOCKS``, or enough 16-token blocks (the
    smallest a CPU backend uses) for every sequence at ``max_model_len`` plus vLLM's null
    block, when that is more (a sweep with long contexts must still be admitted)."""
    seqs = max_num_seqs or 256
    return max(CPU_NUM_BLOCKS, seqs * -(-max_model_len // 16) + 1)


def override_flags(base: list[str], extra: list[str]) -> list[str]:
    """``base + extra`` where a ``--flag`` given in ``extra`` replaces the same flag (and its
    value) in ``base``, so the argv states each flag once (vLLM's argparse would keep the
    last anyway)."""
    given = {a.split("=", 1)[0] for a in extra if a.startswith("--")}
    out, i = [], 0
    while i < len(base):
        a = base[i]
        if a.startswith("--") and a.split("=", 1)[0] in given:
            takes_value = "=" not in a and i + 1 < len(base) and not base[i + 1].startswith("--")
            i += 2 if takes_value else 1
            continue
        out.append(a)
        i += 1
    return out + extra


def model_path(model: ModelSpec, name: str, cache_dir: Path | None = None, create: bool = True) -> str:
    """Where vLLM loads ``model`` from: HF id, local path, or the generated tiny checkpoint
    (built on first use unless ``create=False``, as for dry runs)."""
    if model.tiny is not None:
        from pdsweep.tiny.checkpoints import checkpoint_dir

        return str(checkpoint_dir(name, model, cache_dir, create=create))
    return model.path or model.hf_id  # type: ignore[return-value]
