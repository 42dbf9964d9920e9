"""What runs inside vLLM's own processes, loaded through pdsweep's ``vllm.general_plugins``
entry point (``vllm_plugin``): the CPU fix-ups, the NIXL READ log (``readlog``), debug hooks
(``vllm_debug``) and the out-of-tree model architectures (``cpu_models``)."""
