"""Accuracy stage, the evidence: lm-eval against the PD proxy (or a reference instance).

:func:`run_lm_eval` drives ``lm_eval.simple_evaluate`` with ``local-completions`` as
  upstream does (vLLM ``tests/v1/kv_connector/nixl_integration/test_accuracy.py``,
  ``test_accuracy``), saves lm-eval's results and samples under ``<cell>/lm_eval/`` and
returns per task ``{metric, value, stderr, n}``; :func:`pdsweep.judge.accuracy.judge` turns
that into the ``accuracy.json`` verdict.

``pdsweep_arith`` (:mod:`pdsweep.tiny.arith`) needs no dataset hub; any other lm-eval task
(gsm8k, ...) is loaded the usual way, so its dataset must be cached for offline use
(``HF_DATASETS_OFFLINE=1``, ``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from pdsweep.core.errors import UserError
from pdsweep.core.stats import num
from pdsweep.measure.endpoints import completions_url
from pdsweep.results import layout
from pdsweep.results.layout import write_text
from pdsweep.sweepfile.phases import EvalSpec
from pdsweep.tiny import arith

log = logging.getLogger(__name__)

# Metric reported per task: lm-eval result key "METRIC,FILTER". Tasks not listed use the
# first of FALLBACK_METRICS present, else the first numeric non-stderr key.
PRIMARY_METRIC = {"gsm8k": "exact_match,strict-match", arith.TASK_NAME: "exact_match,strict-match"}
FALLBACK_METRICS = ("exact_match,strict-match", "acc,none", "exact_match,none", "acc_norm,none")


# ---------------------------------------------------------------- lm-eval
def _stderr(x: Any) -> float | str | None:
    """lm-eval's stderr: a float, or the string ``"N/A"`` (one sample, or bootstrap off)."""
    if isinstance(x, str):
        return "N/A" if x.strip().upper() == "N/A" else None
    if isinstance(x, (int, float)) and math.isfinite(float(x)):
        return float(x)
    return None


def task_result(results: dict[str, Any], task: str) -> dict[str, Any]:
    """``{metric, value, stderr, n}`` of ``task`` from an lm-eval results dict
    (``results["results"][task]``, ``results["n-samples"][task]["effective"]``).
    ``value`` is None when missing or not finite; ``stderr`` is a float, ``"N/A"`` or
    None; ``n`` is None when lm-eval did not report it."""
    res = (results.get("results") or {}).get(task) or {}
    metric = PRIMARY_METRIC.get(task)
    if metric is None or metric not in res:
        metric = next((m for m in FALLBACK_METRICS if m in res), None)
    if metric is None:
        metric = next(
            (k for k, v in res.items() if "," in k and "_stderr" not in k and num(v) is not None),
            PRIMARY_METRIC.get(task, FALLBACK_METRICS[0]),
        )
    name, _, filt = metric.partition(",")
    n = ((results.get("n-samples") or {}).get(task) or {}).get("effective")
    return {
        "metric": metric,
        "value": num(res.get(metric)),
        "stderr": _stderr(res.get(f"{name}_stderr,{filt}")),
        "n": int(n) if isinstance(n, int) else None,
    }


def api_extra_missing() -> list[str]:
    """Packages of ``lm-eval[api]`` that ``local-completions`` imports and that are not
    installed (lm-eval's ``TemplateAPI`` refuses to start without them)."""
    from importlib.util import find_spec

    return [m for m in ("lm_eval", "aiohttp", "requests", "tenacity", "tqdm") if find_spec(m) is None]


def run_lm_eval(
    base_url: str,
    model: str,
    tokenizer: str,
    eval_spec: EvalSpec,
    out_dir: Path,
    chat: bool = False,
    trust_remote_code: bool = False,
) -> dict[str, dict[str, Any]]:
    """Evaluate ``eval_spec.tasks`` against an OpenAI-compatible server with lm-eval.

    ``base_url``: the full ``/v1/completions`` URL (a server root or ``.../v1`` also
    works; with ``chat`` the ``/v1/chat/completions`` endpoint is used, model
    ``local-chat-completions`` with ``apply_chat_template=True`` as upstream does for
    gemma-4). ``model``: the served model name; ``tokenizer``: a local tokenizer path
    (never a hub id: lm-eval would download it), loaded with ``trust_remote_code`` (the
    catalogue's; lm-eval's ``TemplateAPI`` in lm_eval/models/api_models.py passes it to
    ``AutoTokenizer.from_pretrained`` and defaults it to False). Requests are sent as text
    (``tokenized_requests=False``) with ``num_concurrent``, ``max_retries``,
    ``timeout_s``, ``max_gen_toks`` and ``seed`` from ``eval_spec``; ``limit`` and
    ``num_fewshot`` apply to every task (None: all documents / the task's default).

    Writes ``out_dir/lm_eval/results.json`` (lm-eval's full results, samples excluded),
    ``out_dir/lm_eval/samples_<task>.jsonl`` and, for ``pdsweep_arith``, the rendered
    task under ``out_dir/lm_eval/tasks/`` (its ``include_path``).

    Returns ``{task: {metric, value, stderr, n}}`` (see :func:`task_result`). Must be
    called outside a running asyncio loop (lm-eval calls ``asyncio.run``). Raises
    ``UserError`` for an unknown task; request failures after ``max_retries`` propagate
    from lm-eval.
    """
    missing = api_extra_missing()
    if missing:
        raise UserError(
            f"lm-eval's API models need the 'api' extra (missing: {', '.join(missing)}): pip install 'lm-eval[api]'"
        )
    import lm_eval

    lm_dir = Path(out_dir) / layout.LM_EVAL_DIR
    lm_dir.mkdir(parents=True, exist_ok=True)
    tm = _task_manager(eval_spec, lm_dir)

    model_args: dict[str, Any] = {
        "model": model,
        "base_url": completions_url(base_url, chat),
        "tokenizer": str(tokenizer),
        "tokenizer_backend": "huggingface",
        "trust_remote_code": trust_remote_code,
        "tokenized_requests": False,
        "num_concurrent": eval_spec.num_concurrent,
        "max_retries": eval_spec.max_retries,
        "timeout": int(math.ceil(eval_spec.timeout_s)),
        "max_gen_toks": eval_spec.max_gen_toks,
        "seed": eval_spec.seed,
    }
    log.info("lm-eval %s on %s (%s), limit=%s", eval_spec.tasks, model_args["base_url"], model, eval_spec.limit)
    try:
        results = lm_eval.simple_evaluate(
            model="local-chat-completions" if chat else "local-completions",
            model_args=model_args,
            tasks=list(eval_spec.tasks),
            num_fewshot=eval_spec.num_fewshot,
            limit=eval_spec.limit,
            task_manager=tm,
            apply_chat_template=chat,
            log_samples=True,
        )
    finally:
        _stop_tqdm_monitors()
    if results is None:  # not rank 0: cannot happen for API models
        raise RuntimeError("lm-eval returned no results")

    _write_results(lm_dir, results)
    out = {task: task_result(results, task) for task in eval_spec.tasks}
    for task, r in out.items():
        log.info("%s: %s = %s (stderr %s, n=%s)", task, r["metric"], r["value"], r["stderr"], r["n"])
    return out


def _task_manager(eval_spec: EvalSpec, lm_dir: Path) -> Any:
    """lm-eval's ``TaskManager`` for ``eval_spec.tasks``, with ``pdsweep_arith`` rendered
    under ``lm_dir/tasks``; raises ``UserError`` naming unknown tasks."""
    from lm_eval.tasks import TaskManager

    include = [str(arith.render_task(lm_dir / "tasks"))] if arith.TASK_NAME in eval_spec.tasks else []
    # lm-eval's own task index (thousands of YAMLs, seconds to scan) only when needed
    own = all(t.startswith("pdsweep_") for t in eval_spec.tasks)  # pdsweep's offline namespace
    tm = TaskManager(include_path=include or None, include_defaults=not own)
    unknown = [t for t in eval_spec.tasks if t not in tm.all_tasks]
    if unknown:
        raise UserError(f"eval.tasks: unknown lm-eval task(s) {unknown}")
    return tm


def _write_results(lm_dir: Path, results: dict[str, Any]) -> None:
    """``results.json`` (samples popped out of ``results``) and ``samples_<task>.jsonl``."""
    from lm_eval.utils import handle_non_serializable

    samples = results.pop("samples", None) or {}
    write_text(lm_dir / "results.json", json.dumps(results, indent=2, default=handle_non_serializable) + "\n")
    for task, rows in samples.items():
        write_text(
            lm_dir / f"samples_{task}.jsonl",
            "".join(json.dumps(r, default=handle_non_serializable) + "\n" for r in rows),
        )


def _stop_tqdm_monitors() -> None:
    """End the monitor threads tqdm starts for lm-eval's progress bars (one per tqdm
    class), so an evaluation leaves no thread behind."""
    try:
        from tqdm import std
    except ImportError:
        return
    todo = [std.tqdm]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        mon = cls.__dict__.get("monitor")
        if mon is not None:
            mon.exit()
            cls.monitor = None
