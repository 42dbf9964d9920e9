"""vLLM builds: the unfixed baseline (PR #49297 undone per release, ``unfix``; built into a venv,
``baseline``), which fixes a build's files contain (``fixprobes``), and checking ``serve_args``
against a build's own vLLM argument parser (``argcheck``)."""
