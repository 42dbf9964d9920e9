"""Bytes per element of every dtype spelling pdsweep reads: vLLM/torch names (``--dtype``,
``--kv-cache-dtype``, a config's ``torch_dtype`` / ``mamba_ssm_cache_dtype``) and safetensors
header names (``BF16``; huggingface_hub ``get_safetensors_metadata``). One table for all."""

DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "fp8": 1,
    "F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "I32": 4,
}  # fmt: skip
