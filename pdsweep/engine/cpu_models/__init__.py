"""Out-of-tree vLLM architectures pdsweep registers through its plugin (pdsweep.engine.vllm_plugin),
so the CPU default can serve model shapes vLLM's CPU build has no implementation for."""

ARCHITECTURES = {
    # hybrid MLA + SSM: vLLM's own CPU-capable MLA (DeepSeek-V2 style) and Mamba2 (NemotronH) layers
    "PdsweepMlaMamba2ForCausalLM": "pdsweep.engine.cpu_models.mla_mamba2:PdsweepMlaMamba2ForCausalLM",
}
