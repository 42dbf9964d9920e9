"""``pdsweep_arith``: an offline, deterministic arithmetic task for lm-eval.

Needs no dataset hub: pdsweep writes the questions itself as JSONL and renders a task
YAML that points lm-eval at them (``dataset_path: json`` with
``dataset_kwargs.data_files.test``), then loads it with
``TaskManager(include_path=...)``.

* Template: ``accuracy/tasks/pdsweep_arith.yaml`` (the checked-in, complete task; its
  ``data_files`` is the relative path ``.cache/pdsweep/data/arith.jsonl``, resolved by
  ``datasets`` against the working directory, so it works by hand from the repo root
  after ``python -m pdsweep.tiny.arith``).
* Per run: :func:`render_task` copies the template into ``<dir>/pdsweep_arith.yaml`` with
  an absolute path to ``<dir>/arith.jsonl`` that it writes beside it;
  ``pdsweep.measure.lmeval.run_lm_eval`` does this under ``<cell>/lm_eval/tasks/``, so every
  cell records the exact questions it was scored on.

A record is ``{"id": int, "question": "What is 17 + 25?", "answer": "42"}``; the prompt
is ``"Q: What is 17 + 25?\\nA:"``. Scoring (in the YAML): the first integer of the
generation (regex filter ``strict-match``) must equal ``answer`` (``exact_match``), so the
result key is ``exact_match,strict-match`` as for gsm8k.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

import yaml

from pdsweep.core.paths import REPO
from pdsweep.results.layout import write_text

log = logging.getLogger(__name__)

REPO_ROOT = REPO
TASK_NAME = "pdsweep_arith"
TEMPLATE = REPO_ROOT / "accuracy" / "tasks" / f"{TASK_NAME}.yaml"
DEFAULT_DATA = REPO_ROOT / ".cache" / "pdsweep" / "data" / "arith.jsonl"
DATA_FILE_NAME = "arith.jsonl"
DEFAULT_N = 200
DEFAULT_SEED = 0
FEWSHOT_SEED = 1001  # template few-shot examples: questions(3, FEWSHOT_SEED), one per operator


def _question(rng: random.Random) -> tuple[str, int]:
    """One question and its answer: ``a + b`` / ``a - b`` (a >= b) with a, b in 1..19, or
    ``a * b`` with a, b in 2..9: 361 + 190 + 64 distinct questions, a space tiny models
    learn on 2 cores in minutes (pdsweep.tiny.train)."""
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        return f"What is {a} * {b}?", a * b
    a, b = rng.randint(1, 19), rng.randint(1, 19)
    if op == "-":
        a, b = max(a, b), min(a, b)  # non-negative answers
        return f"What is {a} - {b}?", a - b
    return f"What is {a} + {b}?", a + b


def questions(n: int = DEFAULT_N, seed: int = DEFAULT_SEED) -> list[dict[str, Any]]:
    """``n`` distinct records ``{id, question, answer}`` (answer a decimal string),
    the same for the same ``(n, seed)``. Raises ``ValueError`` if ``n`` is not positive
    or larger than the number of distinct questions (615)."""
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[dict[str, Any]] = []
    for _ in range(50 * n):
        q, ans = _question(rng)
        if q in seen:
            continue
        seen.add(q)
        out.append({"id": len(out), "question": q, "answer": str(ans)})
        if len(out) == n:
            return out
    raise ValueError(f"cannot draw {n} distinct questions")


def write_dataset(path: Path, n: int = DEFAULT_N, seed: int = DEFAULT_SEED) -> Path:
    """Write :func:`questions` ``(n, seed)`` as JSONL to ``path`` (atomically; parent
    directories are created). Returns ``path``. Same arguments, same bytes."""
    return write_text(Path(path), "".join(json.dumps(r, sort_keys=True) + "\n" for r in questions(n, seed)))


def render_task(task_dir: Path, n: int = DEFAULT_N, seed: int = DEFAULT_SEED, template: Path = TEMPLATE) -> Path:
    """Write ``task_dir/arith.jsonl`` and ``task_dir/pdsweep_arith.yaml`` (the template
    with ``data_files.test`` set to the absolute data path). Returns ``task_dir``, the
    directory to give lm-eval as ``include_path``."""
    task_dir = Path(task_dir).resolve()
    data = write_dataset(task_dir / DATA_FILE_NAME, n=n, seed=seed)
    cfg = yaml.safe_load(Path(template).read_text())
    cfg["dataset_kwargs"] = {"data_files": {"test": str(data)}}
    (task_dir / f"{TASK_NAME}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    log.debug("rendered %s with %d questions (seed %d) in %s", TASK_NAME, n, seed, task_dir)
    return task_dir


if __name__ == "__main__":  # python -m pdsweep.tiny.arith [PATH]: data for the template
    import sys

    logging.basicConfig(level=logging.INFO)
    out = write_dataset(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DATA)
    log.info("wrote %s", out)
