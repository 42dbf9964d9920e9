"""Check every instance's ``vllm serve`` argv with the installed vLLM's own CLI classes,
offline and without creating an engine, so a GPU cell's misspelled flag, bad
``--kv-transfer-config`` JSON or invalid combination fails on a CPU box.

What runs is what ``vllm serve`` runs before it loads anything
(``vllm/entrypoints/cli/serve.py`` ``ServeSubcommand``): the parser of
``vllm.entrypoints.launchers.cli_args.make_arg_parser`` (with pydantic validation of JSON
config flags such as ``KVTransferConfig``), ``validate_parsed_serve_args``, then
``vllm.engine.arg_utils.AsyncEngineArgs.from_cli_args`` (its ``__post_init__`` checks).
``create_engine_config`` is not run: it needs the model's config (hub or disk) and a device;
the model argument itself is replaced by an existing directory for the same reason.
The parser is built once per process (~1 s; importing vLLM takes longer on a 2-core box).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable
from functools import lru_cache
from typing import Any, NoReturn

from pdsweep.core.errors import UserError


class _ArgError(Exception):
    pass


# Where ``vllm/entrypoints/cli/serve.py`` imports ``make_arg_parser`` and
# ``validate_parsed_serve_args`` from, newest first: vLLM 0.34.0, then 0.32.0/0.33.0.
CLI_ARGS_MODULES = ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.launchers.cli_args")


@lru_cache(maxsize=1)
def _cli_args() -> Any:
    """The installed vLLM's serve CLI module (:data:`CLI_ARGS_MODULES`, first importable).
    Raises ``UserError`` naming the modules tried when none is."""
    import importlib

    errors = []
    for name in CLI_ARGS_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
            continue
        if hasattr(mod, "make_arg_parser") and hasattr(mod, "validate_parsed_serve_args"):
            return mod
        errors.append(f"{name}: no make_arg_parser/validate_parsed_serve_args")
    raise UserError(
        "cannot check vllm serve argv: the installed vLLM lacks its CLI parser ("
        + "; ".join(errors)
        + "); rerun with --no-check-argv to skip"
    )


@lru_cache(maxsize=1)
def _parser() -> Any:
    make_arg_parser = _cli_args().make_arg_parser
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError as e:
        raise UserError(
            f"cannot check vllm serve argv: the installed vLLM lacks its CLI parser ({e}); "
            "rerun with --no-check-argv to skip"
        ) from None
    try:
        parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    except RuntimeError as e:  # e.g. a CUDA wheel on a CPU box: DeviceConfig "Failed to infer device type"
        raise UserError(
            f"cannot check vllm serve argv: vLLM could not build its serve parser here ({e}); "
            "rerun with --no-check-argv to skip, or check on a node of the build's platform"
        ) from None

    def error(message: str) -> NoReturn:  # argparse would print usage and exit 2
        raise _ArgError(f"vllm serve: error: {message}")

    parser.error = error  # argparse's documented hook: override error()
    return parser


def serve_args(argv: Iterable[str]) -> list[str]:
    """The part of an instance argv after ``serve`` (model first)."""
    argv = list(argv)
    return argv[argv.index("serve") + 1 :] if "serve" in argv else argv


def check_argv(argv: Iterable[str]) -> str | None:
    """vLLM's message for the first problem of a ``vllm serve`` argv, or None when it parses."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    validate_parsed_serve_args = _cli_args().validate_parsed_serve_args
    parser = _parser()
    args = serve_args(argv)
    if args and not args[0].startswith("-"):
        # the model is not checked: with HF_HUB_OFFLINE EngineArgs.__post_init__ resolves a hub
        # id to a local snapshot (get_model_path), which a CPU box has not downloaded
        args = [tempfile.gettempdir(), *args[1:]]
    try:
        ns = parser.parse_args(args)
        if getattr(ns, "model_tag", None) is not None:  # as ServeSubcommand.cmd does
            ns.model = ns.model_tag
        validate_parsed_serve_args(ns)
        AsyncEngineArgs.from_cli_args(ns)
    except _ArgError as e:
        return str(e)
    except SystemExit as e:  # a parser action that exits on its own
        return f"vllm serve exited {e.code} while parsing"
    except Exception as e:  # noqa: BLE001 - vLLM's own validation error, whatever its type
        return f"{type(e).__name__}: {e}"
    return None


CHECK_PORT = "8000"  # every argv is checked with this --port value: ports are pdsweep's, checked by the plan


def normal_args(argv: Iterable[str]) -> tuple[str, ...]:
    """The serve args vLLM is asked about: :func:`serve_args` with the model replaced by an
    existing directory (see :func:`check_argv`) and the ``--port`` value by :data:`CHECK_PORT`,
    so two instances that differ only in where they run share one answer."""
    args = serve_args(argv)
    if args and not args[0].startswith("-"):
        args = [tempfile.gettempdir(), *args[1:]]
    return tuple(CHECK_PORT if i and args[i - 1] == "--port" else a for i, a in enumerate(args))


def check_instances(items: Iterable[tuple[str, str, Iterable[str]]]) -> list[str]:
    """``"CELL instance NAME: message"`` for each ``(cell_id, instance name, argv)`` vLLM refuses.
    Each distinct :func:`normal_args` is asked once, of the answer store of this interpreter's
    vLLM (:mod:`pdsweep.builds.answers`) first: vLLM is imported only for args never asked."""
    import json
    import sys

    from pdsweep.builds import answers

    st = answers.store("argv", sys.executable)
    verdicts: dict[tuple[str, ...], str | None] = {}
    out = []
    for cell_id, name, argv in items:
        args = normal_args(argv)
        if args not in verdicts:
            key = json.dumps(args)
            got = st.get(key)
            if got is None:
                got = {"error": check_argv(["serve", *args])}
                st.put(key, got)
            verdicts[args] = got["error"]
        if (msg := verdicts[args]) is not None:
            out.append(f"{cell_id} instance {name}: {msg}")
    return out
