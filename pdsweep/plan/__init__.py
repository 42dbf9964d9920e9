"""From a loaded sweep to cells: the matrix expanded with each cell's instances, argv and env
(``expand``), the validity rules mirroring vLLM (``rules``, ``blocks``, ``ports``, ``topology``),
KV geometry and NIXL's read plan (``geometry``, ``readplan``), time budgets (``budgets``), build
interpreters (``builds``) and where each cell runs (``schedule``, ``placement``)."""
