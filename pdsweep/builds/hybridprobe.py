"""The probe-side code of vLLM's hybrid block alignment (:func:`pdsweep.builds.attnprobe.kda_hybrid_block`):
text that :mod:`pdsweep.builds.attnprobe` puts into its probe script, run by a build's interpreter (needs
nothing of pdsweep). It calls ``Platform._align_hybrid_block_size`` and ``_check_aligned_block_size``
(vllm/platforms/interface.py) and ``select_common_block_size`` (vllm/v1/worker/utils.py) on vLLM's own
default ``VllmConfig`` with the question's cache, parallel and model fields set."""

from __future__ import annotations

# Code of the probe process (attnprobe.SCRIPT, which has defined torch, load, defaults, _VC_ERR,
# AttentionBackendEnum and KINDS): the "hybrid" kind.
HYBRID_PROBE = r"""
def backend_class(name):
    # an AttentionBackendEnum member, or a backend a model's layer returns (get_attn_backend) as module:Class
    if ":" not in name:
        return load(AttentionBackendEnum[name])
    mod, attr = name.split(":")
    import importlib
    try: return getattr(importlib.import_module(mod), attr), None
    except Exception as e: return None, f"{type(e).__name__}: {e}"

def hybrid(q):
    # vLLM's own Platform._align_hybrid_block_size (vllm/platforms/interface.py) on vLLM's default VllmConfig
    # (defaults(): every field it reads that the question does not set, use_flashinfer_replayssm included, is
    # vLLM's default) with the question's cache, parallel and model fields; the model class it resolves is
    # replaced by the two classmethods a KDA model has (Glm5NextForCausalLM / KimiLinearForCausalLM:
    # MambaStateShapeCalculator.kda_state_shape, MambaStateDtypeCalculator.kda_state_dtype): resolving the
    # real class needs the CUDA kernels; _find_non_ssm_backends answers the model's non-SSM layers' backends
    # in layer order (q["backends"]). Then select_common_block_size (vllm/v1/worker/utils.py) over the
    # backends NIXL splits blocks for (q["transfer"]: get_current_attn_backends_and_specs skips compressed
    # caches), as nixl/base_worker.py _sync_block_size_with_kernel calls it.
    import copy
    from types import SimpleNamespace as NS
    from vllm.config.vllm import set_current_vllm_config
    from vllm.platforms.cuda import CudaPlatform
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator, MambaStateDtypeCalculator
    from vllm.v1.worker.utils import select_common_block_size
    base = defaults()
    if base is None: raise RuntimeError("vLLM's default VllmConfig cannot be built here: " + "; ".join(_VC_ERR))
    classes = {}
    for name in q["backends"]:
        classes[name], err = backend_class(name)
        if classes[name] is None: raise RuntimeError(f"{name}: {err}")
    class Kda:
        @classmethod
        def get_mamba_state_shape_from_config(cls, vc):
            h = vc.model_config.hf_text_config
            return MambaStateShapeCalculator.kda_state_shape(vc.parallel_config.tensor_parallel_size,
                h.linear_num_heads, h.linear_head_dim, conv_kernel_size=h.linear_conv_kernel_dim, num_spec=0)
        @classmethod
        def get_mamba_state_dtype_from_config(cls, vc):
            c = vc.cache_config
            return MambaStateDtypeCalculator.kda_state_dtype(vc.model_config.dtype, c.mamba_cache_dtype,
                c.mamba_ssm_cache_dtype)
    hf = NS(linear_num_heads=q["ssm_heads"], linear_head_dim=q["ssm_head_dim"], linear_conv_kernel_dim=q["conv_kernel"],
        **({"index_kpool": q["index_kpool"]} if q.get("index_kpool") else {}))
    mc = NS(dtype=getattr(torch, q["dtype"]), use_mla=True, get_num_kv_heads=lambda pc: 1, is_hybrid=True,
        get_head_size=lambda: q["head_size"], architecture=q["architecture"], hf_text_config=hf, hf_config=hf)
    vc = copy.copy(base)
    cc = vc.cache_config = copy.copy(base.cache_config)
    cc.cache_dtype, cc.block_size, cc.mamba_ssm_cache_dtype = q["kv_cache_dtype"], q["block_size"], q["ssm_cache_dtype"]
    vc.parallel_config = copy.copy(base.parallel_config)
    vc.parallel_config.tensor_parallel_size = q["tp"]
    vc.model_config = mc
    ordered = [classes[n] for n in q["backends"]]
    saved = (ModelRegistry.resolve_model_cls, CudaPlatform.__dict__.get("_find_non_ssm_backends"))
    ModelRegistry.resolve_model_cls = lambda *a, **k: (Kda, q["architecture"])
    CudaPlatform._find_non_ssm_backends = classmethod(lambda cls, vc: list(ordered))
    kerr = None
    try:
        CudaPlatform._align_hybrid_block_size(vc, ordered[0])
        check = getattr(CudaPlatform, "_check_aligned_block_size", None)  # "Fail now, not at worker setup"
        if check is not None:
            try: check(vc, ordered, q["block_size"])
            except ValueError as e: kerr = str(e)
    finally:
        ModelRegistry.resolve_model_cls = saved[0]
        if saved[1] is not None: CudaPlatform._find_non_ssm_backends = saved[1]
    kernel = None
    if kerr is None:
        try:
            with set_current_vllm_config(vc):
                kernel = select_common_block_size(cc.block_size, [classes[n] for n in q["transfer"]])
        except ValueError as e: kerr = str(e)
    return {"logical": cc.block_size, "kernel": kernel, "kernel_error": kerr,
            "mamba_page_padded": cc.mamba_page_size_padded,
            "replayssm": bool(getattr(vc, "use_flashinfer_replayssm", False))}

KINDS["hybrid"] = hybrid
"""
