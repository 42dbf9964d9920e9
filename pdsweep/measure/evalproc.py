"""lm-eval in a child process with a wall-clock budget: a hung evaluation is killed
(its whole process group) and fails its cell in phase ``eval``, instead of hanging the
cell or leaving a thread behind.

Parent: :func:`run_lm_eval_bounded`. Child: ``python -m pdsweep.measure.evalproc REQUEST.json``
runs :func:`pdsweep.measure.lmeval.run_lm_eval` and writes its return value to the request's
``out`` file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdsweep.deploy.deployment import CellFailed
from pdsweep.deploy.launchers.base import own_group
from pdsweep.measure.lmeval import run_lm_eval
from pdsweep.results import layout
from pdsweep.sweepfile.phases import EvalSpec

REQUEST, RESULT, LOG = "request.json", "result.json", "lm_eval.log"


@dataclass(frozen=True)
class EvalTarget:
    """What lm-eval talks to: the completions URL ``base_url``, the served ``model`` name, the
    ``tokenizer`` (path or hub id), whether the model is a ``chat`` one and needs
    ``trust_remote_code``."""

    base_url: str
    model: str
    tokenizer: str
    chat: bool
    trust_remote_code: bool = False


def run_lm_eval_bounded(
    target: EvalTarget, eval_spec: EvalSpec, out_dir: Path, budget_s: float
) -> dict[str, dict[str, Any]]:
    """:func:`pdsweep.measure.lmeval.run_lm_eval` against ``target`` in a child process (same
    interpreter); returns its result. Raises ``CellFailed('eval')`` when it runs past
    ``budget_s`` seconds (the child's process group is killed), RuntimeError (its last output
    line) when it fails."""
    d = Path(out_dir) / layout.LM_EVAL_DIR
    d.mkdir(parents=True, exist_ok=True)
    (d / RESULT).unlink(missing_ok=True)
    (d / REQUEST).write_text(
        json.dumps(
            {
                "base_url": target.base_url,
                "model": target.model,
                "tokenizer": str(target.tokenizer),
                "eval": eval_spec.model_dump(),
                "out_dir": str(out_dir),
                "chat": target.chat,
                "trust_remote_code": target.trust_remote_code,
                "result": str(d / RESULT),
            }
        )
    )
    with open(d / LOG, "w") as logf:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdsweep.measure.evalproc", str(d / REQUEST)],
            stdout=logf,
            stderr=subprocess.STDOUT,
            **own_group(),
        )
        try:
            rc = proc.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise CellFailed(
                "eval", f"lm-eval exceeded its wall-clock budget of {budget_s:.0f} s (eval phase)"
            ) from None
        except BaseException:  # interrupted: never leave the child behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    if rc != 0 or not (d / RESULT).exists():
        lines = [x for x in (d / LOG).read_text(errors="replace").splitlines() if x.strip()]
        # a RuntimeError, as when lm-eval ran in-process: run_cell adds each dead instance's culprit
        raise RuntimeError(f"lm-eval exited with code {rc} (logs: {d / LOG}): {lines[-1] if lines else 'no output'}")
    return json.loads((d / RESULT).read_text())


def _child(request: Path) -> int:
    r = json.loads(Path(request).read_text())
    out = run_lm_eval(
        r["base_url"],
        r["model"],
        r["tokenizer"],
        EvalSpec.model_validate(r["eval"]),
        Path(r["out_dir"]),
        chat=r["chat"],
        trust_remote_code=r.get("trust_remote_code", False),
    )
    Path(r["result"]).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(_child(Path(sys.argv[1])))
