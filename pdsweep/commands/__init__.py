"""The ``pdsweep`` subcommands, one module each: an Args dataclass (vLLM's ``benchmarks/sweep``
pattern) whose ``add_cli_args`` declares the flags, ``from_cli_args`` validates them (bad input:
``UserError``) and ``main`` runs the stage's function. :mod:`pdsweep.cli` is the table of them."""
