"""Leaves every stage uses: the error types and exit codes (``errors``), where pdsweep's files are
(``paths``), small statistics (``stats``) and reading an instance's log (``logscan``: first
exception, NIXL READ lines, transfer plans), and the fault vocabulary (``faults``: every fault
pdsweep injects, where it acts, its knobs and the failure the gate expects)."""
