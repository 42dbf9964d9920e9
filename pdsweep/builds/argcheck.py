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

It runs in the interpreter's vLLM probe process (:mod:`pdsweep.builds.attnprobe`, the
``argv`` kind of :data:`ARGV_PROBE`), which has imported vLLM once for every question of a
plan: this process never imports vLLM. The parser is built once per probe (~1 s); every
argv of a plan goes in one query, whose answer is read when needed (:func:`submit_instances`),
so vLLM parses while the plan is scheduled.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Callable, Iterable
from typing import Any

from pdsweep.core.errors import UserError

# Where ``vllm/entrypoints/cli/serve.py`` imports ``make_arg_parser`` and
# ``validate_parsed_serve_args`` from, newest first: vLLM 0.34.0, then 0.32.0/0.33.0.
CLI_ARGS_MODULES = ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.launchers.cli_args")

# Code of the probe process (attnprobe._SCRIPT, which has imported importlib, contextlib, sys,
# json and its stub finder `_finder`): the "argv" kind, {"args": [[serve args]...]} ->
# {"refused": [vLLM's message or None, ...], "parser": module} or {"unavailable": why}.
ARGV_PROBE = r"""
import contextlib
CLI_ARGS_MODULES = %r
class _ArgError(Exception): pass
class _Unavailable(Exception): pass
_SERVE = {}

@contextlib.contextmanager
def _unstubbed():
    # the modules the backend probe stubbed (flashinfer, ...) are hidden while vLLM parses
    sys.meta_path.remove(_finder)
    hidden = {n: sys.modules.pop(n) for n in list(sys.modules) if n.split(".")[0] in _finder.tops}
    try: yield
    finally: sys.modules.update(hidden); sys.meta_path.insert(0, _finder)

def _serve_parser():
    if _SERVE: return _SERVE
    errors = []
    for name in CLI_ARGS_MODULES:
        try: mod = importlib.import_module(name)
        except ImportError as e: errors.append(f"{name}: {e}"); continue
        if hasattr(mod, "make_arg_parser") and hasattr(mod, "validate_parsed_serve_args"): break
        errors.append(f"{name}: no make_arg_parser/validate_parsed_serve_args")
    else: raise _Unavailable("the installed vLLM lacks its CLI parser (" + "; ".join(errors) + ")")
    try: from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError as e: raise _Unavailable(f"the installed vLLM lacks its CLI parser ({e})")
    try: parser = mod.make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    except RuntimeError as e:  # a CUDA wheel on a CPU box: DeviceConfig "Failed to infer device type"
        raise _Unavailable(f"vLLM could not build its serve parser ({name}.make_arg_parser) here ({e}); "
            "check on a node of the build's platform")
    def error(message): raise _ArgError(f"vllm serve: error: {message}")  # argparse would print usage, exit 2
    parser.error = error
    _SERVE.update(parser=parser, validate=mod.validate_parsed_serve_args, module=name)
    return _SERVE

def _check_argv(args):
    from vllm.engine.arg_utils import AsyncEngineArgs
    s = _serve_parser()
    try:
        ns = s["parser"].parse_args(args)
        if getattr(ns, "model_tag", None) is not None: ns.model = ns.model_tag  # as ServeSubcommand.cmd does
        s["validate"](ns)
        AsyncEngineArgs.from_cli_args(ns)
    except _ArgError as e: return str(e)
    except SystemExit as e: return f"vllm serve exited {e.code} while parsing"
    except Exception as e: return f"{type(e).__name__}: {e}"
    return None

def argv(q):
    with _unstubbed():
        try: return {"refused": [_check_argv(a) for a in q["args"]], "parser": _serve_parser()["module"]}
        except _Unavailable as e: return {"unavailable": str(e)}
KINDS["argv"] = argv
""" % (CLI_ARGS_MODULES,)


def ask_vllm(args: list[list[str]], python: str | None = None) -> Callable[[], list[str | None]]:
    """Send ``args`` (serve args, model first) to the vLLM probe of ``python`` (default this
    interpreter) in one query; returns a function that waits for vLLM's verdicts, one per
    argv (its message, or None when it parses). That function raises ``UserError`` when the
    probe cannot import vLLM or died, or vLLM lacks (or cannot build) its serve parser."""
    from pdsweep.builds import attnprobe

    probe = attnprobe._probe(python or sys.executable)
    n = probe.submit({"kind": "argv", "args": args})

    got: list[dict[str, Any]] = []

    def verdicts() -> list[str | None]:
        if not got:  # read once: a second call (an error path) sees the same answer
            got.append(probe.result(n))
        out = got[0]
        why = out.get("unavailable") or out.get("failed")
        if why:
            raise UserError(f"cannot check vllm serve argv: {why}; rerun with --no-check-argv to skip")
        refused = list(out["refused"])
        if len(refused) != len(args):
            raise UserError(f"cannot check vllm serve argv: the probe gave {len(refused)} verdicts for {len(args)}")
        return refused

    return verdicts


def check_argv(argv: Iterable[str], python: str | None = None) -> str | None:
    """vLLM's message for the first problem of a ``vllm serve`` argv (asked as
    :func:`normal_args`), or None when it parses. Raises ``UserError`` as :func:`ask_vllm`."""
    return ask_vllm([list(normal_args(argv))], python)()[0]


def serve_args(argv: Iterable[str]) -> list[str]:
    """The part of an instance argv after ``serve`` (model first)."""
    argv = list(argv)
    return argv[argv.index("serve") + 1 :] if "serve" in argv else argv


CHECK_PORT = "8000"  # every argv is checked with this --port value: ports are pdsweep's, checked by the plan


def normal_args(argv: Iterable[str]) -> tuple[str, ...]:
    """The serve args vLLM is asked about: :func:`serve_args` with the model replaced by an
    existing directory (see :func:`check_argv`) and the ``--port`` value by :data:`CHECK_PORT`,
    so two instances that differ only in where they run share one answer."""
    args = serve_args(argv)
    if args and not args[0].startswith("-"):
        # the model is not checked: with HF_HUB_OFFLINE EngineArgs.__post_init__ resolves a hub
        # id to a local snapshot (get_model_path), which a CPU box has not downloaded
        args = [tempfile.gettempdir(), *args[1:]]
    return tuple(CHECK_PORT if i and args[i - 1] == "--port" else a for i, a in enumerate(args))


def submit_instances(
    items: Iterable[tuple[str, str, Iterable[str]]], python: str | None = None
) -> Callable[[], list[str]]:
    """Start vLLM's check of each ``(cell_id, instance name, argv)`` by ``python`` (default this
    interpreter); returns a function that waits for it and gives ``"CELL instance NAME:
    message"`` per argv vLLM refuses. Each distinct :func:`normal_args` is asked once, of the
    answer store of that vLLM (:mod:`pdsweep.builds.answers`) first: the probe is asked (all at
    once) only for args never asked. The function raises ``UserError`` as :func:`ask_vllm`'s."""
    from pdsweep.builds import answers

    python = python or sys.executable
    st = answers.store("argv", python)
    asked = [(cell_id, name, normal_args(argv)) for cell_id, name, argv in items]
    verdicts: dict[tuple[str, ...], str | None] = {}
    new: list[tuple[str, ...]] = []
    for _, _, args in asked:
        if args not in verdicts:
            got = st.get(json.dumps(args))
            verdicts[args] = None if got is None else got["error"]
            if got is None:
                new.append(args)
    wait = ask_vllm([list(a) for a in new], python) if new else None

    def refusals() -> list[str]:
        for args, msg in zip(new, wait() if wait else []):
            st.put(json.dumps(args), {"error": msg})
            verdicts[args] = msg
        return [f"{cell_id} instance {name}: {msg}" for cell_id, name, args in asked if (msg := verdicts[args])]

    return refusals


def check_instances(items: Iterable[tuple[str, str, Iterable[str]]]) -> list[str]:
    """:func:`submit_instances`, waited for."""
    return submit_instances(items)()
