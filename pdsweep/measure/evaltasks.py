"""Which lm-eval tasks a PD deployment can serve.

lm-eval's ``loglikelihood``, ``loglikelihood_rolling`` and ``multiple_choice`` tasks score
the prompt itself: ``local-completions`` sends ``echo: true`` with ``logprobs`` and
``max_tokens: 0`` or 1 (lm-eval ``models/openai_completions.py``
``LocalCompletionsAPI._create_payload``), i.e. prompt logprobs. A kv_consumer (PD decode)
receives the prompt's KV from prefill and never computes prompt logprobs, so such requests
fail or return nothing usable (vLLM issue 50792). Only ``generate_until`` tasks can be
evaluated through the PD proxy.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from pdsweep.core.errors import UserError
from pdsweep.tiny import arith

PROMPT_LOGPROB_TYPES = ("loglikelihood", "loglikelihood_rolling", "multiple_choice")


def _types(index: dict[str, Any], name: str, seen: set[str]) -> dict[str, str]:
    """``{task: output_type}`` for a task, group or tag name of lm-eval's task index
    (groups and tags expanded); ``"unknown"`` where the index has no such name."""
    if name in seen:
        return {}
    seen.add(name)
    e = index.get(name)
    if e is None:
        return {name: "unknown"}
    kind, cfg = e.kind.name, e.cfg or {}
    if kind == "TAG":
        return {k: v for t in sorted(e.tags) for k, v in _types(index, t, seen).items()}
    if kind == "GROUP":
        out: dict[str, str] = {}
        for t in cfg.get("task") or []:
            if isinstance(t, dict):  # an inline task config inside the group
                out[str(t.get("task"))] = str(t.get("output_type") or "generate_until")
            else:
                out.update(_types(index, str(t), seen))
        return out
    return {name: str(cfg.get("output_type") or "generate_until")}  # lm-eval TaskConfig default


def output_types(tasks: list[str]) -> dict[str, dict[str, str]]:
    """``{eval task: {task: output_type}}`` from lm-eval's ``TaskManager`` index (the
    pdsweep_* tasks from their rendered YAML, lm-eval's own tasks only when named: indexing
    them takes seconds). No task is built and nothing is downloaded."""
    from lm_eval.tasks import TaskManager

    own = all(t.startswith("pdsweep_") for t in tasks)
    with tempfile.TemporaryDirectory(prefix="pdsweep-tasks-") as tmp:
        include = [str(arith.render_task(Path(tmp), n=8))] if arith.TASK_NAME in tasks else None
        index = TaskManager(include_path=include, include_defaults=not own).task_index
        return {t: _types(index, t, set()) for t in tasks}


def check_eval_tasks(ls: Any) -> None:
    """Refuse eval tasks a kv_consumer cannot serve when the sweep has PD cells (every
    sweep does): raises ``UserError`` naming the sweep file, each task and its
    output_type. No-op without ``eval.tasks``."""
    tasks = list(ls.sweep.eval.tasks)
    if not tasks:
        return
    bad = [
        (t, sub, ty)
        for t, subs in output_types(tasks).items()
        for sub, ty in subs.items()
        if ty in PROMPT_LOGPROB_TYPES
    ]
    if bad:
        lines = [
            f"{ls.path}: eval.tasks: '{t}'"
            + (f" (subtask '{sub}')" if sub != t else "")
            + f" has output_type {ty}: lm-eval sends echo + logprobs (prompt logprobs), which a PD "
            "kv_consumer cannot serve (vLLM issue 50792); PD cells need generate_until tasks "
            "(e.g. gsm8k, pdsweep_arith)"
            for t, sub, ty in bad[:10]
        ]
        if len(bad) > 10:
            lines.append(f"... and {len(bad) - 10} more subtasks")
        raise UserError("\n".join(lines))
