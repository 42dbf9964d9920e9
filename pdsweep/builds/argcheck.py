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

It runs in the interpreter's vLLM probe process (:mod:`pdsweep.builds.attnprobe`; the code
is :data:`pdsweep.builds.argprobe.ARGV_PROBE`), which imports vLLM once for every question
of a plan: this process never imports vLLM. The parser is built once per probe (~1 s); every
argv of a plan goes in one query, whose answer is read when needed (:func:`submit_instances`),
so vLLM parses while the plan is scheduled.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Callable, Iterable
from typing import Any

from pdsweep.builds import answers, attnprobe
from pdsweep.core.errors import UserError


def ask_vllm(args: list[list[str]], python: str | None = None) -> Callable[[], list[str | None]]:
    """Send ``args`` (serve args, model first) to the vLLM probe of ``python`` (default this
    interpreter) in one query; returns a function that waits for vLLM's verdicts, one per
    argv (its message, or None when it parses). That function raises ``UserError`` when the
    probe cannot import vLLM or died, or vLLM lacks (or cannot build) its serve parser."""
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
    python = python or sys.executable
    st = answers.store("argv", python, attnprobe.SCRIPT)
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
