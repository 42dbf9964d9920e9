"""Running a sweep: ``pdsweep run`` (``sweep``), the dry run (``dryrun``), settings under which no
cell can pass (``feasible``), provenance of a run (``provenance``) and progress lines
(``progress``)."""
