"""Ask a build's own vLLM which attention backend a CUDA instance gets on a target GPU
architecture, and that backend's kernel block sizes, without a GPU.

What runs, in a subprocess of the build's interpreter (one per interpreter, kept for the
process; importing vLLM costs ~10 s on a 2-core box), is vLLM's own selection
(``vllm/platforms/cuda.py``): ``_get_backend_priorities(use_mla, DeviceCapability, ...)``
then, per backend in that order, ``AttentionBackendEnum.X.get_class()``
``.validate_configuration(device_capability=..., **AttentionSelectorConfig)`` as
``CudaPlatform.get_valid_backends`` / ``get_attn_backend_cls`` do, and the chosen class's
``get_supported_kernel_block_sizes()``.

A CPU build lacks the CUDA kernels, so two things are sandboxed: ``vllm._C_stable_libtorch``
(imported by ``cuda.py`` to register ops) and the kernel modules a backend imports
(``vllm_flash_attn``'s functions, ``flashinfer``) are stubbed; a backend's own
``supports_combination`` verdict and any import error are therefore *unverified here*
(reported, not used to skip it). The reasons of vLLM's generic checks
(``AttentionBackend.validate_configuration``: head size, dtype, KV cache dtype, block size,
MLA, sparse, compute capability, KV connector, ...) are pure functions of the
configuration and decide, except "kv_cache_dtype not supported" for a quantized KV dtype
(``fp8``...), which backends check against their compiled kernels
(``flash_attn_supports_kv_cache_dtype``): unverified here.
"""

from __future__ import annotations

import atexit
import json
import subprocess
import sys
import threading
from functools import lru_cache
from typing import TYPE_CHECKING, Any, TypedDict

from pdsweep.builds import answers
from pdsweep.builds.argprobe import ARGV_PROBE
from pdsweep.builds.hybridprobe import HYBRID_PROBE
from pdsweep.core.errors import UserError

if TYPE_CHECKING:  # Python 3.10 has neither in typing; annotations only (from __future__ import annotations)
    from typing_extensions import Required, Unpack

# The probe's code, run with `python -c`: needs nothing of pdsweep (an unfixed venv may lack it); answer
# stores are kept per this code (pdsweep.builds.answers.store).
SCRIPT = (
    r"""
import importlib.abc, importlib.machinery, json, os, re, sys, types
_OUT = os.fdopen(os.dup(1), "w")  # the answers; anything vLLM or argparse prints goes to stderr instead
os.dup2(2, 1)
sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
# scipy and scikit-learn are no vLLM dependency (its extras "bench" and "audio"): absent here, as where not
# installed, transformers (is_scipy_available, is_sklearn_available) skips them; ~1 s of the first answer
for _m in ("scipy", "sklearn"): sys.modules.setdefault(_m, None)
import torch
from vllm.platforms.interface import DeviceCapability
from vllm.platforms.cuda import _get_backend_priorities
from vllm.v1.attention.backend import MultipleOf
from vllm.v1.attention.backends.registry import AttentionBackendEnum
# AttentionBackend.validate_configuration's own checks: pure functions of the configuration
GENERIC = re.compile(r"^(head_size|dtype|kv_cache_dtype|block_size) not supported$|^(non-)?(MLA|sparse) not supported$"
    r"|^compute capability not supported$|^attention type .* not supported$|^(KV connector|sliding window|R-SWA"
    r"|attention sinks|non-causal attention|batch invariance|PCP|DCP) not supported$"
    r"|^FlashMLA (Dense|Sparse) is only supported on .* devices\.$")

class _Any(type):
    def __getattr__(cls, name): return _Anything
    def __call__(cls, *a, **k): return _Anything
    def __bool__(cls): return False
_Anything = _Any("_Anything", (), {})

class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    tops = set()
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.tops:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
    def create_module(self, spec):
        # a __file__, or inspect.getmodule (torch.library's register_fake walks sys.modules) raises TypeError
        # "is a built-in module" halfway through a vLLM module that has registered a custom op: imported
        # again, it fails on registering that op twice (vllm::flashinfer_concat_mla_k)
        m = types.ModuleType(spec.name); m.__path__ = []; m.__file__ = f"<pdsweep stub of {spec.name}>"
        m.__getattr__ = lambda n: _Anything; return m
    def exec_module(self, m): pass
_finder = _StubFinder(); sys.meta_path.insert(0, _finder)
STUBBED = []

def _stub(e):
    if isinstance(e, ModuleNotFoundError) and e.name and not e.name.startswith("vllm"):
        top = e.name.split(".")[0]
        if top in _finder.tops: return False
        _finder.tops.add(top); STUBBED.append(top); return True
    m = re.match(r"cannot import name '(\w+)' from '([\w.]+)'", str(e))
    if m and m.group(2) in sys.modules and not hasattr(sys.modules[m.group(2)], m.group(1)):
        setattr(sys.modules[m.group(2)], m.group(1), _Anything); STUBBED.append(".".join(m.groups()[::-1])); return True
    return False

def load(b):
    for _ in range(16):
        try: return b.get_class(), None
        except ImportError as e:
            if not _stub(e): return None, f"{type(e).__name__}: {e}"
        except Exception as e: return None, f"{type(e).__name__}: {e}"
    return None, "too many missing kernel modules"

import contextlib
@contextlib.contextmanager
def _on_target(cap):
    # vLLM's FlashMLA checks (vllm/v1/attention/ops/flashmla.py is_flashmla_dense_supported /
    # is_flashmla_sparse_supported) ask current_platform for the device's capability family and
    # whether the FlashMLA extension was compiled; answer them for the target GPU (the GPU wheel
    # ships the extension), so vLLM's own capability rule ("FlashMLA Dense is only supported on
    # Hopper devices.") decides.
    from vllm.platforms import current_platform
    plat = type(current_platform)
    saved = plat.__dict__.get("get_device_capability")
    plat.get_device_capability = classmethod(lambda c, device_id=0: cap)
    try: import vllm.v1.attention.ops.flashmla as fm
    except Exception: fm = None
    avail = getattr(fm, "_is_flashmla_available", None)
    if fm is not None and avail is not None: fm._is_flashmla_available = lambda: (True, None)
    try: yield
    finally:
        if saved is None: delattr(plat, "get_device_capability")
        else: plat.get_device_capability = saved
        if fm is not None and avail is not None: fm._is_flashmla_available = avail

def sizes(cls):
    out = {"exact": [], "multiple_of": None}
    for s in cls.get_supported_kernel_block_sizes():
        if isinstance(s, MultipleOf): out["multiple_of"] = s.base
        else: out["exact"].append(int(s))
    return out

_VC = []
def defaults():
    # vLLM's own VllmConfig defaults (as vLLM's tests' default_vllm_config fixture). A CUDA wheel on a box
    # without a GPU cannot infer the device (DeviceConfig.__post_init__: "Failed to infer device type"), so
    # the device is named: the questions are about CUDA. None (and the reason in _VC_ERR) when neither builds.
    if not _VC:
        from vllm.config import DeviceConfig, VllmConfig
        for kw in ({}, {"device_config": DeviceConfig(device="cuda")}):
            try: _VC.append(VllmConfig(**kw)); break
            except Exception as e: _VC_ERR.append(f"VllmConfig({', '.join(kw)}): {type(e).__name__}: {e}")
        else: _VC.append(None)
    return _VC[0]
_VC_ERR = []

def _config_ctx():
    # some backends' checks build CustomOps, which read get_current_vllm_config()
    from vllm.config.vllm import set_current_vllm_config
    vc = defaults()
    return set_current_vllm_config(vc) if vc is not None else contextlib.nullcontext()

def info(b, q, cap):
    cls, err = load(b)
    if cls is None: return {"name": b.name, "reasons": [], "unverified": [err], "sizes": None}
    try:
        with _on_target(cap), _config_ctx():
            r = cls.validate_configuration(head_size=q["head_size"], dtype=getattr(torch, q["dtype"]),
            kv_cache_dtype=q["kv_cache_dtype"], block_size=q["block_size"], use_mla=q["use_mla"], has_sink=False,
                use_sparse=q.get("use_sparse", False), use_mm_prefix=False, use_per_head_quant_scales=False,
                device_capability=cap, attn_type="decoder", use_kv_connector=q["use_kv_connector"])
    except Exception as e:  # vLLM's checks did not run to the end: nothing is known of this backend here
        return {"name": b.name, "reasons": [], "unverified": [f"validate_configuration raised {type(e).__name__}: {e}"
            + (f" ({'; '.join(_VC_ERR)})" if _VC_ERR else "")], "sizes": None}
    try: sz = sizes(cls)
    except Exception as e: sz = None; r = [*r, f"get_supported_kernel_block_sizes: {type(e).__name__}: {e}"]
    # a quantized KV dtype is checked against the compiled kernels (flash_attn_supports_kv_cache_dtype)
    quant = q["kv_cache_dtype"] not in ("auto", "bfloat16", "float16", "float")
    sure = lambda x: GENERIC.match(x) and not (quant and x == "kv_cache_dtype not supported")
    return {"name": b.name, "reasons": [x for x in r if sure(x)], "unverified": [x for x in r if not sure(x)],
            "sizes": sz}

def answer(q):
    cap = DeviceCapability(*q["capability"])
    if q.get("selected"):
        b = AttentionBackendEnum[q["selected"]]
        return {"priorities": [b.name], "backends": [info(b, q, cap)]}
    pr = _get_backend_priorities(q["use_mla"], cap, num_heads=q.get("num_heads"), kv_cache_dtype=q["kv_cache_dtype"],
        head_size=q["head_size"])
    return {"priorities": [b.name for b in pr], "backends": [info(b, q, cap) for b in pr]}

def ratio(q):
    # NIXL's handshake: TransferTopology.block_size_ratio (kv_connector/utils.py) on decode's kernel block
    from types import SimpleNamespace as NS
    from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology
    try: return {"ratio": TransferTopology.block_size_ratio(NS(block_size=q["local"]), q["remote"]), "error": None}
    except AssertionError as e: return {"ratio": None, "error": str(e)}

KINDS = {"select": answer, "ratio": ratio}
"""
    + HYBRID_PROBE
    + ARGV_PROBE
    + r"""
import vllm
print(json.dumps({"ready": vllm.__version__}), file=_OUT, flush=True)
for line in sys.stdin:
    try: q = json.loads(line); out = KINDS[q.pop("kind", "select")](q); out["stubbed"] = sorted(set(STUBBED))
    except Exception as e: out = {"failed": f"{type(e).__name__}: {e}"}
    print(json.dumps(out), file=_OUT, flush=True)
os._exit(0)  # EOF: every answer is flushed; skip tearing down torch and vLLM (~1.7 s the caller would wait)
"""
)


class _Probe:
    """One long-lived ``python -c SCRIPT`` answering one JSON query per line, in order.

    Started without waiting: vLLM's import (~5 s on a 2-core box) overlaps the caller's work
    until the first :meth:`submit`. Queries are pipelined: :meth:`submit` writes one and
    returns its number, :meth:`result` reads answers up to it (those of earlier queries are
    kept for their own :meth:`result`)."""

    def __init__(self, python: str) -> None:
        self.python = python
        self.lock = threading.Lock()
        self.proc = subprocess.Popen(
            [python, "-c", SCRIPT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=_env(),
        )
        self._version: str | None = None
        self.sent = self.received = 0
        self.answers: dict[int, dict[str, Any]] = {}

    def _ready(self) -> str:
        """vLLM's version, read from the probe's first line (once). Raises ``UserError`` when
        the probe could not import vLLM's code (then on every later call too)."""
        if self._version is None:
            first = self.proc.stdout.readline() if self.proc.stdout else ""
            if not first.startswith('{"ready"'):
                self.proc.kill()
                self._version = ""
            else:
                self._version = str(json.loads(first)["ready"])
        if not self._version:
            raise UserError(
                f"{self.python}: cannot import vLLM's CUDA backend selection (vllm/platforms/cuda.py) "
                "or its serve argument parser"
            )
        return self._version

    def version(self) -> str:
        with self.lock:
            return self._ready()

    def submit(self, query: dict[str, Any]) -> int:
        """Send ``query``; returns its number for :meth:`result`."""
        with self.lock:
            self._ready()
            assert self.proc.stdin
            try:
                self.proc.stdin.write(json.dumps(query) + "\n")
                self.proc.stdin.flush()
            except OSError:
                raise UserError(f"{self.python}: the vLLM probe died (query {_short(query)})") from None
            self.sent += 1
            return self.sent

    def result(self, n: int) -> dict[str, Any]:
        """The answer to query ``n`` (blocks until it comes). Raises ``UserError`` when the
        probe died before answering."""
        with self.lock:
            assert self.proc.stdout
            while self.received < n:
                line = self.proc.stdout.readline()
                if not line:
                    raise UserError(f"{self.python}: the vLLM probe died (query {n} of {self.sent})")
                self.received += 1
                self.answers[self.received] = json.loads(line)
            return self.answers.pop(n)

    def ask(self, query: dict[str, Any]) -> dict[str, Any]:
        return self.result(self.submit(query))

    def close(self) -> None:
        """End the probe: EOF on its stdin ends its loop; killed if it has not exited in 5 s."""
        if self.proc.stdin:
            try:
                self.proc.stdin.close()
            except OSError:
                pass  # it died: nothing to flush
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()


def _short(query: dict[str, Any]) -> str:
    text = json.dumps(query)
    return text if len(text) <= 300 else text[:300] + "..."


def _env() -> dict[str, str]:
    import os

    # no GPU is touched; keep vLLM quiet and off the network
    return {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}


_PROBES: dict[str, _Probe] = {}
_PROBES_LOCK = threading.Lock()


def _probe(python: str) -> _Probe:
    """The probe process of ``python`` (started, not waited for, when there is none)."""
    with _PROBES_LOCK:
        if python not in _PROBES:
            _PROBES[python] = _Probe(python)
        return _PROBES[python]


def start(python: str | None = None) -> None:
    """Start the probe process of ``python`` (default: this interpreter) now, without waiting,
    so its vLLM import overlaps the caller's work (planning calls it when an answer store is
    cold: :func:`pdsweep.builds.answers.cold`)."""
    _probe(python or sys.executable)


def close_probes() -> None:
    """End every probe process (each has imported vLLM: hundreds of MB). Called once planning
    is done (:func:`pdsweep.run.sweep.run_sweep`) and at exit; a later query starts a new one,
    and answers already given stay cached."""
    with _PROBES_LOCK:
        probes = list(_PROBES.values())
        _PROBES.clear()
    for p in probes:
        p.close()


atexit.register(close_probes)


@lru_cache(maxsize=1024)
def _ask(python: str, key: str) -> dict[str, Any]:
    """The probe's answer to ``key``, from the install's answer store
    (:mod:`pdsweep.builds.answers`) when asked before: no vLLM is imported then."""
    st = answers.store("attn", python, SCRIPT)
    if (out := st.get(key)) is None:
        out = _probe(python).ask(json.loads(key))
        if "failed" not in out:  # vLLM's answer (a refusal included), not the probe's own failure
            st.put(key, out)
    return out


def vllm_version(python: str | None = None) -> str:
    """The probed interpreter's ``vllm.__version__``."""
    return _version(python or sys.executable)


@lru_cache(maxsize=16)
def _version(python: str) -> str:
    st = answers.store("attn", python, SCRIPT)
    if (v := st.get("version")) is None:
        v = _probe(python).version()
        st.put("version", v)
    return v


class LayerQuery(TypedDict, total=False):
    """One attention layer kind as vLLM's selector sees it (``AttentionSelectorConfig``,
    vllm/v1/attention/selector.py): ``dtype`` a torch dtype name (``bfloat16``);
    ``block_size`` the user's ``--block-size`` (vLLM passes it to the selector only when the
    user set it; default None); ``selected`` the ``--attention-backend`` (default None);
    ``num_heads`` per rank (default None); ``kv_cache_dtype`` default ``auto``;
    ``use_kv_connector`` default True; ``use_sparse`` a DSA sparse MLA layer (default False)."""

    use_mla: Required[bool]
    head_size: Required[int]
    dtype: Required[str]
    kv_cache_dtype: str
    block_size: int | None
    selected: str | None
    num_heads: int | None
    use_kv_connector: bool
    use_sparse: bool


_LAYER_DEFAULTS: dict[str, Any] = {
    "kv_cache_dtype": "auto",
    "block_size": None,
    "selected": None,
    "num_heads": None,
    "use_kv_connector": True,
    "use_sparse": False,
}


def select(capability: tuple[int, int], python: str | None = None, **layer: Unpack[LayerQuery]) -> dict[str, Any]:
    """vLLM's backend choice for one attention layer kind (:class:`LayerQuery`) on
    ``capability`` (e.g. ``(9, 0)``), asked of interpreter ``python`` (default: this one).

    Returns ``{"priorities": [names], "backends": [{"name", "reasons", "unverified", "sizes":
    {"exact": [...], "multiple_of": n}}], "stubbed": [...]}``, one entry per backend in vLLM's
    priority order (only ``selected`` when given). Raises ``UserError`` when the interpreter
    cannot import vLLM's selection code, ``ValueError`` when vLLM's probe raised."""
    q = {"capability": list(capability), **_LAYER_DEFAULTS, **layer}
    out = _ask(python or sys.executable, json.dumps(q, sort_keys=True))
    if "failed" in out:
        raise ValueError(f"vLLM backend probe: {out['failed']}")
    return out


def _query(kind: str, python: str | None, **q: Any) -> dict[str, Any]:
    out = _ask(python or sys.executable, json.dumps({"kind": kind, **q}, sort_keys=True))
    if "failed" in out:
        raise ValueError(f"vLLM {kind} probe: {out['failed']}")
    return out


def kda_hybrid_block(
    layers: tuple[tuple[str, ...], tuple[str, ...], int | None],
    *,
    tp: int,
    block_size: int,
    head_size: int,
    ssm: tuple[int, int, int],
    dtypes: tuple[str, str, str],
    architecture: str,
    python: str | None = None,
) -> dict[str, Any]:
    """The logical (KV manager) and kernel block of a KDA + MLA hybrid instance, by vLLM's own code:
    ``Platform._align_hybrid_block_size`` (vllm/platforms/interface.py) raising ``block_size``
    (tokens) until one attention page holds one KDA state page
    (``MambaStateShapeCalculator.kda_state_shape`` / ``MambaStateDtypeCalculator.kda_state_dtype``,
    vllm/model_executor/layers/mamba/mamba_utils.py, as Glm5NextForCausalLM and KimiLinearForCausalLM
    call them) over vLLM's default ``VllmConfig`` (what the question does not set is vLLM's default),
    ``_check_aligned_block_size``, then ``select_common_block_size`` (vllm/v1/worker/utils.py) as NIXL's
    ``_sync_block_size_with_kernel`` calls it.

    ``layers``: ``(backends, transfer, index_kpool)`` (:class:`pdsweep.plan.hybridlayers.Layers`);
    ``head_size``: MLA ``kv_lora_rank + qk_rope_head_dim``; ``ssm``: ``(linear_num_heads,
    linear_head_dim, conv_kernel)`` from config.json; ``dtypes``: ``(model dtype, --kv-cache-dtype,
    --mamba-ssm-cache-dtype)``. Returns ``{"logical", "kernel", "kernel_error", "mamba_page_padded",
    "replayssm"}`` (tokens, tokens, vLLM's message or None, bytes, vLLM's use_flashinfer_replayssm).
    Raises ``UserError`` when vLLM cannot be imported, ``ValueError`` with the probe's error."""
    heads, head_dim, conv = ssm
    dtype, kv_dtype, ssm_dtype = dtypes
    backends, transfer, index_kpool = layers
    return _query(
        "hybrid",
        python,
        backends=list(backends),
        transfer=list(transfer),
        index_kpool=index_kpool,
        tp=tp,
        block_size=block_size,
        head_size=head_size,
        ssm_heads=heads,
        ssm_head_dim=head_dim,
        conv_kernel=conv,
        dtype=dtype,
        kv_cache_dtype=kv_dtype,
        ssm_cache_dtype=ssm_dtype,
        architecture=architecture,
    )


def block_size_ratio(local: int, remote: int, python: str | None = None) -> tuple[int | None, str | None]:
    """NIXL's ``TransferTopology.block_size_ratio`` (vllm/distributed/kv_transfer/kv_connector/utils.py)
    on the decode (``local``) and prefill (``remote``) kernel blocks (tokens), as the handshake
    calls it: ``(ratio, None)``, or ``(None, vLLM's assertion message)`` when it refuses. Raises
    ``UserError`` when vLLM cannot be imported."""
    out = _query("ratio", python, local=local, remote=remote)
    return out.get("ratio"), out.get("error")
