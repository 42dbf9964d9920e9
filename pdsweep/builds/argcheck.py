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


@lru_cache(maxsize=1)
def _parser() -> Any:
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError as e:
        raise UserError(
            f"cannot check vllm serve argv: the installed vLLM lacks its CLI parser ({e}); "
            "rerun with --no-check-argv to skip"
        ) from None
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))

    def error(message: str) -> NoReturn:  # argparse would print usage and exit 2
        raise _ArgError(f"vllm serve: error: {message}")

    parser.error = error  # type: ignore[method-assign]  # argparse's documented hook: override error()
    return parser


def serve_args(argv: Iterable[str]) -> list[str]:
    """The part of an instance argv after ``serve`` (model first)."""
    argv = list(argv)
    return argv[argv.index("serve") + 1 :] if "serve" in argv else argv


def check_argv(argv: Iterable[str]) -> str | None:
    """vLLM's message for the first problem of a ``vllm serve`` argv, or None when it parses."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

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


def check_instances(items: Iterable[tuple[str, str, Iterable[str]]]) -> list[str]:
    """``"CELL instance NAME: message"`` for each ``(cell_id, instance name, argv)`` vLLM refuses."""
    return [
        f"{cell_id} instance {name}: {msg}" for cell_id, name, argv in items if (msg := check_argv(argv)) is not None
    ]
