"""GPU-node preflight: what would make every cell of a model die at start, checked before
any server starts (``pdsweep run``; ``pdsweep plan --preflight``).

1. **Weights resolvable** per model: a local ``path``, the HF cache
   (``huggingface_hub.scan_cache_dir``), or the hub reachable and the repo not gated
   without a token (``HF_TOKEN`` / ``huggingface_hub.get_token``). The hub is a
   :class:`Hub`, injectable: tests pass a fake and never touch the network.
2. **Memory fit** per cell, instance and TP rank (the exact ``vllm serve`` argv pdsweep builds):
   ``weights / TP + KV of one max_model_len request <= GPU total x gpu_memory_utilization``,
   and vLLM's own start check ``free >= total x gpu_memory_utilization``
   (vllm/v1/worker/gpu_worker.py ``Worker.init_device``: "Free memory on device ... is less
   than desired GPU memory utilization"; the KV bound is vLLM's ``check_enough_kv_cache_memory``
   in vllm/v1/core/kv_cache_utils.py). Weights bytes: the checkpoint's
   ``model.safetensors.index.json`` ``metadata.total_size``, else the ``*.safetensors`` sizes,
   else the catalogue's ``weights_gb``, else the hub's safetensors metadata.
3. **Driver vs torch's CUDA**: the driver ``nvidia-smi`` reports against the minimum of
   the CUDA major torch was built for (:data:`MIN_DRIVER`).
   A cell whose instance does not fit is NOT-RUNNABLE with the arithmetic (:func:`memory_fit`);
   the other cells run.
4. **Usable GPUs** (:func:`pdsweep.plan.gpus.visible`): the user's ``CUDA_VISIBLE_DEVICES``;
   a GPU another process holds (listed or not by nvidia-smi) is left out with a warning;
   asking for more GPUs (``--gpus``) than are usable is an error, one line per GPU left out.

Each problem is one line (per model, instance shape or GPU); all of them together raise
one ``UserError`` (exit 2).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Protocol

from pdsweep.core.dtypes import DTYPE_BYTES
from pdsweep.core.errors import UserError
from pdsweep.plan.blocks import flag
from pdsweep.plan.geometry import kv_geometry
from pdsweep.plan.gpus import (
    CUDA_IPC_GET_ENV,
    CUDA_IPC_GET_OFF,
    Inventory,
    inventory,
    nvlink_active,
    nvlink_status,
    visible,
)
from pdsweep.plan.instance import Slot, instances, model_path
from pdsweep.run import hubcache

GIB = 1024**3

# Minimum Linux driver per CUDA major (NVIDIA CUDA Toolkit release notes, "CUDA Toolkit
# and Minimum Required Driver Version for CUDA Minor Version Compatibility").
MIN_DRIVER: dict[int, tuple[int, ...]] = {11: (450, 80, 2), 12: (525, 60, 13), 13: (580,)}


# ---------------------------------------------------------------- weights
class Hub(Protocol):
    """The two hub questions preflight asks (:class:`HfHub` asks huggingface_hub)."""

    def gated(self, repo_id: str, token: str | None) -> bool:
        """Whether the repo is gated; raises ``LookupError`` (no such repo) or ``OSError``
        (hub unreachable)."""

    def weights_bytes(self, repo_id: str, token: str | None) -> int | None:
        """Bytes of the repo's safetensors weights, or None when unknown."""


def _network_errors() -> tuple[type[BaseException], ...]:
    """What huggingface_hub raises when the hub is unreachable: ``OSError`` (requests'
    ``ConnectionError``) or its HTTP client's ``HTTPError`` (httpx, or httpx2 in
    huggingface_hub 2.x: ``huggingface_hub/utils/_http.py``)."""
    import importlib

    errs: list[type[BaseException]] = [OSError]
    for mod in ("httpx2", "httpx"):
        try:
            errs.append(importlib.import_module(mod).HTTPError)
        except (ImportError, AttributeError):
            continue
    return tuple(errs)


class HfHub:
    """:class:`Hub` over ``huggingface_hub`` (``HfApi.model_info``, ``get_safetensors_metadata``)."""

    def gated(self, repo_id: str, token: str | None) -> bool:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

        try:
            info = HfApi().model_info(repo_id, token=token, timeout=20)
        except RepositoryNotFoundError as e:
            raise LookupError(str(e).splitlines()[0]) from e
        except (HfHubHTTPError, *_network_errors()) as e:  # type: ignore[misc]  # a tuple built at run time
            raise OSError(str(e).splitlines()[0]) from e
        return bool(info.gated)

    def weights_bytes(self, repo_id: str, token: str | None) -> int | None:
        from huggingface_hub import get_safetensors_metadata
        from huggingface_hub.errors import HfHubHTTPError

        try:
            meta = get_safetensors_metadata(repo_id, token=token)
        except (HfHubHTTPError, ValueError, *_network_errors()):  # type: ignore[misc]  # a tuple built at run time  # no safetensors, or unreachable: unknown
            return None
        return sum(n * DTYPE_BYTES.get(dt, 2) for n, dt in _param_counts(meta))


def _param_counts(meta: Any) -> Iterable[tuple[int, str]]:
    for f in meta.files_metadata.values():
        for dt, n in f.parameter_count.items():
            yield n, dt


@dataclass(frozen=True)
class Weights:
    """Where a model's weights are (local directory, or ``hub:<id>``) and their bytes;
    ``error``: why vLLM could not load them (one line)."""

    where: str | None = None
    nbytes: int | None = None
    error: str | None = None


def local_bytes(path: Path) -> int | None:
    """``metadata.total_size`` of ``model.safetensors.index.json`` in ``path``, else the
    sum of its ``*.safetensors`` files, else None."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            return int(json.loads(index.read_text())["metadata"]["total_size"])
        except (ValueError, KeyError, TypeError):
            pass
    files = list(path.glob("*.safetensors"))
    return sum(f.stat().st_size for f in files) or None if files else None


def hf_cache_dir(repo_id: str) -> Path | None:
    """The newest cached snapshot of ``repo_id`` when it is complete (:mod:`pdsweep.run.hubcache`:
    every weight shard, no interrupted download), or None: a partial snapshot is not cached."""
    snap = hubcache.snapshot(repo_id)
    return snap.path if snap.complete else None


def resolve_weights(
    name: str,
    model: Any,
    hub: Hub | None = None,
    env: Mapping[str, str] | None = None,
    cache: Callable[[str], Path | None] | None = None,
) -> Weights:
    """:class:`Weights` of catalogue model ``name`` (``model``: its ``ModelSpec``). A tiny
    model is pdsweep's own (always resolvable). Never raises for a missing model: the
    reason is in ``error``."""
    env = os.environ if env is None else env
    catalogue = int(model.weights_gb * 1e9) if getattr(model, "weights_gb", None) else None
    if model.tiny is not None:
        return Weights("tiny", 0)
    if model.path:
        p = Path(model.path)
        if not p.exists():
            return Weights(error=f"model {name}: path {model.path} does not exist")
        return Weights(str(p), local_bytes(p) or catalogue)
    repo = model.hf_id
    cached = (cache or hf_cache_dir)(repo)
    if cached is not None:
        return Weights(str(cached), local_bytes(cached) or catalogue)
    if env.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return Weights(error=f"model {name}: {repo} is not in the HF cache and HF_HUB_OFFLINE is set")
    token = env.get("HF_TOKEN") or _stored_token()
    hub = hub or HfHub()
    try:
        gated = hub.gated(repo, token)
    except LookupError:
        return Weights(error=f"model {name}: {repo} does not exist on the Hugging Face hub (misnamed hf_id?)")
    except OSError as e:
        return Weights(
            error=f"model {name}: {repo} is not in the HF cache and the hub is unreachable ({e}); "
            f"download it first (`hf download {repo}`) or give its local `path:` in the catalogue"
        )
    if gated and not token:
        return Weights(
            error=f"model {name}: {repo} is gated on the hub and no HF_TOKEN is set: "
            "accept its licence on the hub and export HF_TOKEN"
        )
    return Weights(f"hub:{repo}", catalogue or hub.weights_bytes(repo, token))


def _stored_token() -> str | None:
    try:
        from huggingface_hub import get_token
    except ImportError:
        return None
    return get_token()


# ---------------------------------------------------------------- driver
def torch_cuda_version() -> str | None:
    """``torch.version.cuda`` of this interpreter's torch, read from ``torch/version.py``
    without importing torch (seconds); None for a CPU build or no torch."""
    spec = find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    f = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    m = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([\d.]+)['\"]", f.read_text() if f.is_file() else "", re.M)
    return m.group(1) if m else None


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text))


def driver_problems(driver: str | None, cuda: str | None) -> list[str]:
    """One line when ``driver`` is below :data:`MIN_DRIVER` for ``cuda``'s major (or torch
    has no CUDA, or the major is not in the table)."""
    if driver is None:
        return []
    if cuda is None:
        return [f"torch in {sys.executable} is a CPU build (torch.version.cuda is None): install the gpu extra"]
    major = _version(cuda)[0]
    need = MIN_DRIVER.get(major)
    if need is None:
        return [f"torch is built for CUDA {cuda}: no known minimum driver (pdsweep/run/preflight.py MIN_DRIVER)"]
    if _version(driver) < need:
        want = ".".join(map(str, need))
        # no CUDA 12 route: PyPI's vLLM releases carrying PR #49297 are all CUDA 13 builds (scripts/install-env.sh)
        fix = (
            "upgrade the driver (pdsweep has no install route for it: no vLLM on PyPI built for an older CUDA "
            "carries PR #49297; docs/gpu-nodes.md)"
        )
        return [
            f"NVIDIA driver {driver} is older than {want}, the minimum for CUDA {major}.x that torch is built for "
            f"(CUDA {cuda}): every vLLM instance would fail at start; {fix}"
        ]
    return []


# ---------------------------------------------------------------- memory
def kv_one_request(name: str, model: Any, tp: int, block: int, max_len: int) -> int | None:
    """Bytes per TP rank of the KV cache one ``max_len``-token request needs (attention
    blocks + SSM state, :func:`pdsweep.plan.geometry.kv_geometry`); None when the catalogue
    lacks the geometry."""
    try:
        per = kv_geometry(name, model, block, tps=(tp,)).rank_bytes(tp)
    except ValueError:
        return None
    return math.ceil(max_len / block) * per["attention_per_block"] + per["ssm_per_request"]


def node_shape(gpus: Iterable[Any]) -> str:
    """``8 x NVIDIA H100 80GB HBM3 (79.6 GiB)``: the node shape a plan was fitted to (the
    smallest GPU's memory decides)."""
    gpus = list(gpus)
    if not gpus:
        return "no GPU"
    small = min(gpus, key=lambda g: g.total_mib)
    names = " + ".join(dict.fromkeys(g.name for g in gpus))
    return f"{len(gpus)} x {names} ({small.total_mib / 1024:.1f} GiB)"


@dataclass(frozen=True)
class MemoryFit:
    """The per-cell memory fit on one node (:func:`memory_fit`)."""

    errors: list[str]  # nothing can start (vLLM's free-memory check), or weights size unknown
    warnings: list[str]  # one line per (model, instance shape) that does not fit; missing KV geometry
    unfit: dict[str, str]  # cell id -> the arithmetic of its first instance that does not fit
    shape: str | None  # node_shape() of the GPUs fitted to; None: not fitted (memory unknown)


def memory_fit(ls: Any, cells: list[Any], weights: dict[str, Weights], gpus: Iterable[Any]) -> MemoryFit:
    """Fit every instance of ``cells`` (the exact argv pdsweep builds) on ``gpus`` (the
    smallest total and the tightest free memory decide), per TP rank:
    ``weights / TP + KV(one max_model_len request) <= total x gpu_memory_utilization``
    (vLLM ``check_enough_kv_cache_memory``, vllm/v1/core/kv_cache_utils.py). A cell with an
    instance that does not fit is *unfit* (NOT-RUNNABLE with the arithmetic; the rest run),
    never an error. Errors: ``free < total x gpu_memory_utilization`` (vLLM
    ``Worker.init_device`` refuses every start) and weights of unknown size (fail closed)."""
    gpus = list(gpus)
    out = MemoryFit([], [], {}, node_shape(gpus))
    if not gpus:
        return out
    if any(g.total_mib <= 0 for g in gpus):  # nvidia-smi printed no memory.total ([N/A]): nothing to fit to
        out.warnings.append("nvidia-smi reports no memory.total for some GPU: memory fit not checked")
        return replace(out, shape=None)
    small = min(gpus, key=lambda g: g.total_mib)
    tight = min(gpus, key=lambda g: g.free_mib)
    total, free = small.total_mib * 2**20, tight.free_mib * 2**20
    errors: dict[str, None] = {}
    warnings: dict[str, None] = {}
    for c in cells:
        m = ls.catalogue.models[c.model]
        w = weights.get(c.model)
        if m.tiny is not None or w is None or w.error:
            continue
        slot = Slot(0, tuple(range(c.num_gpus)), ls.sweep.defaults.port_base)
        for spec in instances(c, slot, ls, model_path(m, c.model), "python"):
            util = float(flag(spec.argv, "--gpu-memory-utilization") or "0.9")
            block = int(flag(spec.argv, "--block-size") or "16")
            max_len = int(flag(spec.argv, "--max-model-len") or m.max_model_len)
            budget = total * util
            what = f"model {c.model} {spec.role} TP {spec.tp} (block {block}, max_model_len {max_len})"
            if free < budget:
                errors[
                    f"GPU {tight.index}: {free / GIB:.1f} GiB free < {small.total_mib / 1024:.1f} GiB x "
                    f"gpu_memory_utilization {util} = {budget / GIB:.1f} GiB: vLLM refuses to start "
                    "(lower gpu_memory_utilization or free the GPU)"
                ] = None
            if w.nbytes is None:
                errors[
                    f"model {c.model}: weights size unknown (no model.safetensors.index.json at {w.where}, no "
                    "catalogue weights_gb): add weights_gb to sweeps/models.yaml"
                ] = None
                continue
            kv = kv_one_request(c.model, m, spec.tp, block, max_len)
            if kv is None:
                warnings[f"{what}: KV geometry not in the catalogue; memory fit checked for weights only"] = None
            need = w.nbytes / spec.tp + (kv or 0)
            if need > budget:
                why = (
                    f"{what} does not fit: weights {w.nbytes / GIB:.1f} GiB / TP {spec.tp} = "
                    f"{w.nbytes / spec.tp / GIB:.1f} GiB + KV of one request {(kv or 0) / GIB:.2f} GiB = "
                    f"{need / GIB:.1f} GiB per rank > {small.total_mib / 1024:.1f} GiB ({small.name}) x "
                    f"gpu_memory_utilization {util} = {budget / GIB:.1f} GiB"
                )
                warnings[f"{why}: its cells are NOT-RUNNABLE here"] = None
                out.unfit.setdefault(c.id, why)
    out.errors.extend(errors)
    out.warnings.extend(warnings)
    return out


def known_weights(name: str, model: Any) -> Weights:
    """:func:`resolve_weights` without asking the hub (``pdsweep plan`` without
    ``--preflight``): local path, HF cache or catalogue ``weights_gb``; else unknown
    (``error`` set, so the memory fit skips the model)."""
    if getattr(model, "weights_gb", None) and model.tiny is None and not model.path and not hf_cache_dir(model.hf_id):
        return Weights(f"catalogue:{name}", int(model.weights_gb * 1e9))

    class _NoHub:
        def gated(self, repo_id: str, token: str | None) -> bool:
            raise LookupError(repo_id)

        def weights_bytes(self, repo_id: str, token: str | None) -> int | None:
            return None

    w = resolve_weights(name, model, _NoHub(), {})
    if w.error is None or model.path:
        return w
    return Weights(
        error=f"model {name}: weights size unknown without asking the hub ({model.hf_id} not in the HF cache, "
        "no catalogue weights_gb; `pdsweep plan --preflight` asks the hub)"
    )


# ---------------------------------------------------------------- the preflight
@dataclass(frozen=True)
class Preflight:
    gpu_ids: tuple[int, ...]  # the GPUs the run may use (busy ones left out)
    warnings: list[str]
    weights: dict[str, Weights]
    unfit: dict[str, str] = field(default_factory=dict)  # cell id -> why it does not fit (NOT-RUNNABLE)
    shape: str | None = None  # the node shape the cells were fitted to (node_shape)
    unfetched: tuple[str, ...] = ()  # hub models not (completely) in the HF cache: `pdsweep run` refuses them


def preflight(
    ls: Any,
    cells: list[Any],
    gpus: int | None = None,
    hub: Hub | None = None,
    inv: Inventory | None = None,
    env: dict[str, str] | None = None,
    cache: Callable[[str], Path | None] | None = None,
) -> Preflight:
    """Check ``cells`` of loaded sweep ``ls`` before anything starts; ``gpus``: ``--gpus``
    (None: every usable GPU, :func:`pdsweep.plan.gpus.visible`). Raises ``UserError``
    listing every problem, one per line. Cells whose instances do not fit the node's
    memory are returned in ``unfit`` (NOT-RUNNABLE), not refused.
    On a CPU sweep only the weights are checked (there are no GPUs to plan)."""
    models = list(dict.fromkeys(c.model for c in cells))
    weights = {n: resolve_weights(n, ls.catalogue.models[n], hub, env, cache) for n in models}
    errors = [w.error for w in weights.values() if w.error]
    # resolvable on the hub but not fetched (or partial): vLLM would download inside the startup budget;
    # `pdsweep run` refuses them (Preflight.unfetched), `pdsweep plan --preflight` warns
    unfetched = [
        f"model {n}: {w.where[4:]} is {hubcache.not_fetched(w.where[4:]) or 'not in the HF cache'}: vLLM would "
        f"download it at startup, inside the startup budget; run `pdsweep fetch {ls.path}` first (make sweep does)"
        for n, w in weights.items()
        if w.where and w.where.startswith("hub:")
    ]
    warnings: list[str] = list(unfetched)
    ids: tuple[int, ...] = tuple(range(gpus or 0))
    unfit: dict[str, str] = {}
    shape = None
    if ls.sweep.platform == "cuda":
        inv = inventory() if inv is None else inv
        if inv.error:
            errors.append(inv.error)
        if inv.gpus:
            errors += driver_problems(inv.driver, torch_cuda_version())
            usable, left_out = visible(inv, os.environ if env is None else env)
            warnings += left_out
            free = tuple(g.index for g in usable)
            if gpus is not None and gpus > len(free):
                errors += [f"--gpus {gpus}: only {len(free)} of {len(inv.gpus)} free: {x}" for x in left_out]
                if not left_out:
                    errors.append(f"--gpus {gpus}: nvidia-smi lists only {len(inv.gpus)} GPUs")
            ids = free if gpus is None else free[:gpus]
            if not free:
                errors.append(f"no usable GPU on this host ({len(inv.gpus)} listed, none free for this run)")
            fit = memory_fit(ls, cells, weights, [g for g in usable if g.index in ids])
            errors += fit.errors
            warnings += fit.warnings
            unfit, shape = fit.unfit, fit.shape
            warnings += nvlink_warning(ls, cells, os.environ if env is None else env)
    if errors:
        raise UserError(f"{ls.path}: preflight: {len(errors)} problem(s), nothing started:\n" + "\n".join(errors))
    return Preflight(ids, warnings, weights, unfit, shape, tuple(unfetched))


def nvlink_warning(ls: Any, cells: list[Any], env: Mapping[str, str], status: str | None = None) -> list[str]:
    """One warning when PD cells would READ KV between GPUs without an active NVLink
    (``status``: ``nvidia-smi nvlink --status``, queried when None) and nothing sets
    :data:`~pdsweep.plan.gpus.CUDA_IPC_GET_ENV` (the sweep's ``ucx``, a cell's ``env`` variant,
    the environment): UCX would serve the READs over tcp and the transport gate fail them."""
    if not any(c.kind == "pd" for c in cells):
        return []
    sweep = ls.sweep
    if CUDA_IPC_GET_ENV in sweep.ucx or CUDA_IPC_GET_ENV in env:
        return []
    if all(CUDA_IPC_GET_ENV in sweep.env.get(c.env, {}) for c in cells if c.kind == "pd"):
        return []
    status = nvlink_status() if status is None else status
    if status is None or nvlink_active(status):
        return []
    return [
        "no active NVLink on this host (`nvidia-smi nvlink --status` lists none): vLLM's KV READs between "
        f"GPUs would run over tcp and fail the transport gate; {CUDA_IPC_GET_OFF}"
    ]


def plan_fit(
    ls: Any, cells: list[Any], inv: Inventory | None = None, env: Mapping[str, str] | None = None
) -> Preflight:
    """What ``pdsweep plan`` (no ``--preflight``) fits cells to on a CUDA host: the usable
    GPUs (:func:`pdsweep.plan.gpus.visible`) and :func:`memory_fit` with the weights known
    without the hub (:func:`known_weights`). Never raises for the node: its problems come
    back as warnings (``run`` refuses them). No GPU listed: empty."""
    inv = inventory() if inv is None else inv
    if not inv.gpus:
        return Preflight((), [inv.error] if inv.error else [], {})
    usable, warnings = visible(inv, env)
    weights = {n: known_weights(n, ls.catalogue.models[n]) for n in dict.fromkeys(c.model for c in cells)}
    warnings += [f"{w.error}: memory fit not checked" for w in weights.values() if w.error]
    fit = memory_fit(ls, cells, weights, usable)
    return Preflight(
        tuple(g.index for g in usable), warnings + fit.errors + fit.warnings, weights, fit.unfit, fit.shape
    )
