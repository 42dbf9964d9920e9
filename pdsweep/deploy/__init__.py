"""Bringing a cell up and down: launchers (``launchers``: local child processes or Slurm steps),
the PD proxy (``proxy``), a cell's deployment and its readiness checks (``deployment``) and
instances shared across cells (``instances``)."""
