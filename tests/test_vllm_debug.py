"""pdsweep.engine.vllm_debug installs its MLA KV digest wrappers into vLLM's own classes."""

from __future__ import annotations

import pytest


def test_the_mla_kv_digest_wraps_the_four_methods_of_the_installed_vllm() -> None:
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    from pdsweep.engine.vllm_debug import install_mla_kv_digest

    methods = [
        (CPUMLAImpl, "do_kv_cache_update"),
        (CPUMLAImpl, "forward_mqa"),
        (MLAAttention, "forward_impl"),
        (MultiHeadLatentAttentionWrapper, "forward"),
    ]
    before = {name: getattr(cls, name) for cls, name in methods}
    try:
        assert install_mla_kv_digest() is True
        for cls, name in methods:
            now = getattr(cls, name)
            assert now is not before[name] and now.__qualname__.startswith("_wrap_"), name
            assert now.__closure__ and before[name] in [c.cell_contents for c in now.__closure__], name
    finally:
        for cls, name in methods:
            setattr(cls, name, before[name])
