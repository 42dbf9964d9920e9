"""The error kinds every entry point turns into exit codes, in one place: :func:`run_main`
(``pdsweep`` itself, ``python -m pdsweep.builds.baseline``, ``python -m pdsweep.xfer.bench``).
The codes are the "Exit codes" table of docs/gate.md."""

from __future__ import annotations

import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable

EXIT_OK = 0
EXIT_GATE_FAILED = 1  # a verdict: gate / compare / bench transfer verification failed or regressed
EXIT_USER_ERROR = 2  # bad input: the message says which file, field and allowed values
EXIT_INTERNAL = 3  # a bug in pdsweep (or an invariant it checks): printed with its traceback
EXIT_INTERRUPTED = 130  # SIGINT/SIGTERM (`run`: finish with --resume)


class UserError(Exception):
    """Bad input. The message is printed as is, without a traceback; exit code 2."""


class GateFailed(Exception):
    """A gate or compare verdict that must fail the calling CI job; exit code 1."""


class InternalError(RuntimeError):
    """An invariant of pdsweep does not hold (a bug, not bad input): never caught, so the
    entry point prints its traceback; exit code 3."""


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (poll reports POLLERR on its write end)."""
    import select

    try:
        p = select.poll()
        p.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in p.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def ignore_stop_signals() -> None:
    """For a process that was interrupted, has stopped what it started and now exits 130
    (main thread only; elsewhere nothing happens). Keeps CPython 3.10-3.13 from turning that
    exit into death by SIGINT (returncode -2, no traceback) in two ways:

    - A KeyboardInterrupt that left code run from source text (builtin ``exec``/``eval`` of
      a string: the methods ``dataclasses`` builds while a module imports, e.g. h11's events
      under ``httpx.Client()``) marks itself unhandled even though pdsweep caught it
      (Python/pythonrun.c ``run_eval_code_obj`` sets ``_Py_UnhandledKeyboardInterrupt``), and
      ``python -m`` then kills itself by SIGINT at exit (Modules/main.c ``Py_RunMain`` ->
      ``exit_sigint``). Evaluating any string clears the mark (``run_eval_code_obj`` resets
      it first); CPython 3.14 marks only a KeyboardInterrupt that reaches the top.
    - A second Ctrl-C landing after ``_PySignal_Fini`` (``Py_FinalizeEx``) put SIGINT back to
      ``SIG_DFL``: SIGINT and SIGTERM are ignored from here on, and ``_PySignal_Fini`` leaves
      an ignored signal ignored.

    tests/test_core_errors.py and tests/test_run_fake.py (a burst of signals) show each."""
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)
        eval("None")  # clears _Py_UnhandledKeyboardInterrupt (above); no signal can land in it now


def run_main(main: Callable[[], int | None]) -> int:
    """Call an entry point's ``main()`` and return the process exit code: its own (None:
    0), or ``UserError`` -> ``error: <message>`` on stderr, 2; ``GateFailed`` -> the
    message, 1; ``KeyboardInterrupt`` -> ``interrupted``, 130; anything else -> the
    traceback and a please-report line, 3. A reader that closed stdout early (``pdsweep
    history show | head``) is no failure: 0, the rest of the output dropped (Python's
    documented SIGPIPE recipe: stdout pointed at devnull so the exit flush cannot fail)."""
    try:
        try:
            code = int(main() or 0)
            sys.stdout.flush()  # here, not at exit: a closed pipe is caught below
            return code
        except BrokenPipeError:
            if not _stdout_closed():
                raise  # another pipe (a socket, a child): a failure, not an early reader
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            return 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except GateFailed as e:
        print(str(e), file=sys.stderr)
        return EXIT_GATE_FAILED
    except KeyboardInterrupt:
        ignore_stop_signals()
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception:  # noqa: BLE001 -- a bug in pdsweep, not bad input or a verdict: say so, with the traceback
        traceback.print_exc()
        print(
            f"internal error in pdsweep (exit {EXIT_INTERNAL}): please report it with the traceback above",
            file=sys.stderr,
        )
        return EXIT_INTERNAL
