"""One owner of an instance's identity: the exact ``vllm serve`` argv, the environment it
adds, and the ports it listens on, for every instance of a cell (:func:`instances`) and for
an instance moved to another port block (:func:`place_block`, ``deploy.instances``).

The one port layout: a cell's *slot* (a lane of :data:`PORTS_PER_SLOT` ports from its
``port_base``) holds the PD proxy at ``port_base`` and one *block* of :data:`BLOCK_PORTS` per
instance from ``port_base + FIRST_BLOCK`` on; a pooled instance (reused across cells) gets a
block of its own elsewhere. In a block: HTTP (``--port``) at +0, ``VLLM_PORT`` at
+:data:`VLLM_PORT_OFFSET` (vLLM takes the ports after it for its own sockets:
``vllm/utils/network_utils.py`` ``get_open_port``), ``VLLM_NIXL_SIDE_CHANNEL_PORT`` at
+:data:`SIDE_CHANNEL_OFFSET` with :data:`SIDE_CHANNEL_PORTS` for vLLM's per-rank offsets
(:func:`pdsweep.plan.ports.overlap` rejects an instance that binds more).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from pdsweep.core.errors import UserError
from pdsweep.core.faults import (
    FLIP_BYTE_ENV_VAR,
    KV_DIGEST_ENV_VAR,
    READ_FAULT_ENV_VAR,
    flip_byte_every,
    read_fault_every,
)
from pdsweep.core.kvsample import SAMPLE_ENV_VAR
from pdsweep.plan.blocks import arch_serve_args, effective_blocks
from pdsweep.plan.cell import Cell
from pdsweep.plan.crossnode import loopback_fields
from pdsweep.sweepfile.catalogue import ModelSpec
from pdsweep.sweepfile.sweep import LoadedSweep
from pdsweep.tiny.checkpoints import checkpoint_dir

MAX_PORT = 65535  # the largest TCP port
PORTS_PER_SLOT = 200  # one lane: a concurrently running cell
BLOCK_PORTS = 16  # one instance
VLLM_PORT_OFFSET, SIDE_CHANNEL_OFFSET = 2, 8  # in a block
SIDE_CHANNEL_PORTS = BLOCK_PORTS - SIDE_CHANNEL_OFFSET
FIRST_BLOCK = 8  # in a slot: the proxy at +0, instance blocks from +8
MAX_INSTANCES = (PORTS_PER_SLOT - FIRST_BLOCK) // BLOCK_PORTS  # per cell: 12
# KV blocks per CPU instance. VLLM_CPU_KVCACHE_SPACE=1 GiB gives a tiny model ~32k blocks
# (tiny-llama: 1,048,576 tokens), and with prefill TP > decode TP the decode handshake builds
# per-source split descriptor lists over all of them in Python
# (nixl/base_worker.py _build_local_splits_from_plan): 77 s per prefill rank on 2 cores.
# 256 blocks hold max_num_seqs x max_model_len of every cpu-smoke cell several times over.
CPU_NUM_BLOCKS = 256
# pdsweep.engine.vllm_plugin on CPU (each explained there): NIXL progress thread polls every
# 5 ms (not a spin), AMX tile permission, shm readers spin 1 ms (not 1 s) after an RPC and
# their writers drop no wake-up (a dropped one parked a reader for 5 s), an
# engine holding blocks for a remote peer steps every 20 ms (not 1 ms), RoPE on contiguous
# copies of strided views, CPU_MLA takes logical blocks that are multiples of 16 (hybrid MLA +
# Mamba: 128). The two pollers are quiet so a KV READ does not wait for a core: slow READs
# 12.5 % vs 20 % at 1000 us / 10 ms (docs/performance.md, scripts/repro/kv_slow_reads.py).
CPU_PLUGIN_ENV = {
    "PDSWEEP_NIXL_PROGRESS_DELAY_US": "5000",
    "PDSWEEP_CPU_AMX_PERMISSION": "1",
    "PDSWEEP_SHM_BUSY_LOOP_S": "0.001",
    "PDSWEEP_ENGINE_IDLE_STEP_S": "0.02",
    "PDSWEEP_CPU_ROPE_STRIDES": "1",
    "PDSWEEP_CPU_MLA_LOGICAL_BLOCKS": "1",
}


def check_ports(first: int, count: int, what: str) -> None:
    """The one range check of pdsweep's ports: raise ``UserError`` naming ``what`` unless the
    ``count`` ports from ``first`` lie within 1..:data:`MAX_PORT`."""
    if first < 1 or first + count - 1 > MAX_PORT:
        raise UserError(f"{what}: {count} ports from {first} reach port {first + count - 1}, past {MAX_PORT}")


def ports_fit(first: int, count: int) -> bool:
    """Whether :func:`check_ports` passes (for a search over candidate blocks)."""
    return 1 <= first and first + count - 1 <= MAX_PORT


@dataclass(frozen=True)
class Slot:
    """Resources of one scheduled cell: GPU ids, a private lane of ports, CPU cores, and
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

    def block(self, k: int) -> int:
        """First port of instance ``k``'s block (the module doc's layout)."""
        return self.port_base + FIRST_BLOCK + BLOCK_PORTS * k


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


def place_block(spec: InstanceSpec, base: int) -> InstanceSpec:
    """``spec`` on the port block at ``base`` (the module doc's layout)."""
    side = None if spec.side_channel_port is None else base + SIDE_CHANNEL_OFFSET
    return place(spec, base, base + VLLM_PORT_OFFSET, side)


def on_slot(specs: list[InstanceSpec], slot: Slot) -> list[InstanceSpec]:
    """``specs`` (as :func:`instances` made them, in their order) on ``slot``'s ports."""
    return [place_block(s, slot.block(k)) for k, s in enumerate(specs)]


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


def roles(cell: Cell) -> list[tuple[str, str, int, int, int]]:
    """``(name, role, TP, block size, ranks per TP rank: decode DP or prefill PP)`` of each
    instance of ``cell`` in instance order: prefill-i, then decode-i (or single-0 for a reference)."""
    if cell.kind == "ref":
        return [("single-0", "single", cell.decode_tp, cell.decode_block_size, 1)]
    return [
        (f"prefill-{i}", "prefill", cell.prefill_tp, cell.prefill_block_size, cell.prefill_pp)
        for i in range(cell.num_prefill)
    ] + [
        (f"decode-{i}", "decode", cell.decode_tp, cell.decode_block_size, cell.decode_dp)
        for i in range(cell.num_decode)
    ]


def serve_argv(
    cell: Cell, instance: tuple[str, str, int, int, int], ls: LoadedSweep, model_path: str, python: str, host: str
) -> list[str]:
    """The ``vllm serve`` argv of one instance, ``instance`` an entry of :func:`roles`
    (``--port 0``: :func:`place` writes it); the catalogue's and the serve-args variant's flags
    replace pdsweep's (:func:`override_flags`)."""
    _, role, tp, block, _ = instance
    s, d = ls.sweep, ls.sweep.defaults
    model, variant = ls.catalogue.models[cell.model], s.serve_variant(cell.serve_args)
    max_len = d.max_model_len or model.max_model_len
    argv = [python, "-m", "vllm.entrypoints.cli.main", "serve", model_path, "--served-model-name", cell.model]
    argv += ["--host", host, "--port", "0", "--tensor-parallel-size", str(tp), "--block-size", str(block)]
    argv += ["--max-model-len", str(max_len), "--seed", "0"]
    if s.platform == "cuda":
        argv += ["--gpu-memory-utilization", str(d.gpu_memory_utilization)]
    if model.tiny is not None:  # our own float32 weights: serve in the catalogue dtype, not vLLM's auto
        argv += ["--dtype", model.dtype]
    if d.enforce_eager if variant.enforce_eager is None else variant.enforce_eager:
        argv.append("--enforce-eager")
    argv += parallel_args(cell, model, role)
    if d.max_num_seqs:
        argv += ["--max-num-seqs", str(d.max_num_seqs)]
    if blocks := d.num_blocks or (cpu_num_blocks(max_len, d.max_num_seqs) if s.platform == "cpu" else None):
        argv += ["--num-gpu-blocks-override", str(blocks)]
    if role != "single":
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config(cell, role, ls), separators=(",", ":"))]
    extra = list(model.serve_args) + arch_serve_args(model, s.platform) + list(variant.both)
    extra += list(variant.prefill if role == "prefill" else variant.decode if role == "decode" else [])
    return override_flags(argv, extra)


def serve_env(cell: Cell, role: str, ls: LoadedSweep, host: str | None) -> dict[str, str]:
    """What one instance adds to the environment, but for its GPUs or CPU cores
    (:func:`instances`); the port variables keep their place, empty until :func:`place`.
    ``host``: the prefill's address decode reaches its side channel at, on a multi-node slot."""
    s = ls.sweep
    model = ls.catalogue.models[cell.model]
    env = {**derived_env(model, role, cell.kv_cache_layout), **model.env, **s.ucx, **s.env[cell.env]}
    env["VLLM_PORT"] = ""
    if role != "single":
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = ""
        if host:  # decode reaches prefill's side channel at the prefill node (envs.py default: localhost)
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = host
    if cell.fault != "none":  # a drill kills its own instances, never ones other cells reuse
        env["PDSWEEP_FAULT_DRILL"] = cell.fault
    if role == "decode":  # decode reads: its log names the UCX transport and each READ's rank (transfer.json)
        env.setdefault("UCX_PROTO_INFO", "y")
        env.setdefault("PDSWEEP_NIXL_READ_LOG", "1")  # pdsweep.engine.readlog, via pdsweep's vLLM plugin
        if every := read_fault_every(cell.fault):  # the READ-failure drill (pdsweep.engine.readfault)
            env[READ_FAULT_ENV_VAR] = str(every)
        if every := flip_byte_every(cell.fault):  # the byte-flip drill (pdsweep.engine.kvdigest)
            env[FLIP_BYTE_ENV_VAR] = str(every)
    if role == "decode" and (level := s.serve_variant(cell.serve_args).decode_optimize):
        env["PYTHONOPTIMIZE"] = str(level)  # asserts compiled out in decode's vLLM (serve_args decode_optimize)
    push = role != "single" and kv_transfer_config(cell, role, ls).get("kv_connector") == PUSH_CONNECTOR
    # KV digests (docs/integrity.md): pull and push PD cells on CPU; pull cells on GPU where the sweep opts in
    # (push's digests read host memory only: pdsweep.engine.kvpushdigest)
    if role != "single" and (s.platform == "cpu" or (s.integrity.gpu and not push)):
        env.setdefault(KV_DIGEST_ENV_VAR, "1")  # the same for every cell: prefill instances stay shared
        if s.platform != "cpu":  # GPU: opt-in, a sampled fraction of requests (pdsweep.core.kvsample)
            env[SAMPLE_ENV_VAR] = f"{s.integrity.gpu_sample:g}"
    if role == "prefill" and push:
        env.setdefault("UCX_PROTO_INFO", "y")  # push: prefill WRITEs, so it logs them
        env.setdefault("PDSWEEP_NIXL_WRITE_LOG", "1")  # pdsweep.engine.readlog's WRITE log
    return env


def instances(cell: Cell, slot: Slot, ls: LoadedSweep, model_path: str, python: str) -> list[InstanceSpec]:
    """Every instance of ``cell`` on ``slot``: prefill-i, then decode-i (or single-0).

    GPUs are handed out consecutively from ``slot.gpus`` (prefill first, as upstream);
    on CPU each TP rank is bound to a core with ``VLLM_CPU_OMP_THREADS_BIND``. Raises
    ``UserError`` when a path between hosts would use a loopback address.
    """
    d = ls.sweep.defaults
    out, gpu_i, placed = [], 0, {"prefill": 0, "decode": 0, "single": 0}
    for k, entry in enumerate(roles(cell)):
        name, role, tp, _, dp = entry
        gpus = slot.gpus[gpu_i : gpu_i + tp * dp] if slot.gpus else ()
        gpu_i += tp * dp
        argv = serve_argv(cell, entry, ls, model_path, python, slot.host(k))
        env = serve_env(cell, role, ls, slot.host(k) if slot.hosts else None)
        if ls.sweep.platform == "cuda":  # nvidia-smi's indices (PCI bus order): CUDA's only under PCI_BUS_ID
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        else:
            env["VLLM_TARGET_DEVICE"] = "cpu"
            env["VLLM_CPU_KVCACHE_SPACE"] = str(d.cpu_kvcache_space_gib)
            side = "decode" if role == "decode" else "prefill"  # single binds like prefill
            cores = slot.cpus or tuple(range(os.cpu_count() or 1))
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind(role, tp * dp, placed[side], cores)
            for var, val in CPU_PLUGIN_ENV.items():  # pdsweep.engine.vllm_plugin (a sweep's env may override)
                env.setdefault(var, val)
            placed[side] += tp * dp
        side_port = None if role == "single" else 0
        spec = InstanceSpec(name, role, tp, 0, side_port, tuple(gpus), tuple(argv), env, slot.host(k), slot.node(k))
        out.append(place_block(spec, slot.block(k)))
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


def model_path(model: ModelSpec, name: str, cache_dir: Path | None = None) -> str:
    """Where vLLM loads ``model`` from: HF id, local path, or the tiny checkpoint's directory
    (named only: planning never builds one; the run does, :func:`pdsweep.run.prebuild.checkpoint_path`)."""
    if model.tiny is not None:
        return str(checkpoint_dir(name, model, cache_dir, create=False))
    return model.path or model.hf_id  # type: ignore[return-value]
