"""The two error kinds the CLI turns into exit codes (caught once, in ``cli.main``)."""

EXIT_OK = 0
EXIT_GATE_FAILED = 1  # gate / compare verdict: something regressed or failed
EXIT_USER_ERROR = 2  # bad input: the message says which file, field and allowed values
EXIT_INTERNAL = 3  # a bug in pdsweep: printed with its traceback
EXIT_INTERRUPTED = 130  # SIGINT/SIGTERM during `run` (finish with --resume)


class UserError(Exception):
    """Bad input. The message is printed as is, without a traceback; exit code 2."""


class GateFailed(Exception):
    """A gate or compare verdict that must fail the calling CI job; exit code 1."""
