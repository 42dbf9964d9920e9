"""One ``vllm bench serve`` run of the load phase, driven in this process when it can be.

``vllm bench serve`` is ``vllm.benchmarks.serve.add_cli_args`` + ``main`` (vLLM
``entrypoints/cli/benchmark/serve.py``). A fresh interpreter per run costs ~40 s of imports on
a 2-core host, every repeat of every cell; :func:`run` parses the same argv with vLLM's own
parser and awaits ``vllm.benchmarks.serve.main_async`` here instead, so the imports are paid
once per sweep. The client does not have to be the served build's: it only speaks HTTP. A build
without ``vllm/benchmarks/serve.py`` (a stand-in, an old release) or this interpreter without
vLLM runs the subprocess as before. Both write vLLM's own result file (``--save-result``).
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import logging
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any


@dataclass(frozen=True)
class LoadRun:
    """What one run sends: ``base_url`` (the deployment), served ``model``, ``tokenizer`` path,
    prompt/answer lengths in tokens, ``num_prompts`` at ``concurrency``, the result file
    ``result_dir / result_filename``, per-request SLOs ``goodput`` (ms; ``--goodput``)."""

    base_url: str
    model: str
    tokenizer: str
    trust_remote_code: bool
    input_len: int
    output_len: int
    num_prompts: int
    concurrency: int
    result_dir: Path
    result_filename: str
    goodput: tuple[tuple[str, float], ...] = ()  # (metric, ms): --goodput

    def argv(self) -> list[str]:
        """The arguments after ``vllm bench serve``."""
        return [
            *("--backend", "openai", "--base-url", self.base_url, "--endpoint", "/v1/completions"),
            *("--model", self.model, "--tokenizer", self.tokenizer),
            *(["--trust-remote-code"] if self.trust_remote_code else []),
            *("--dataset-name", "random", "--random-input-len", str(self.input_len)),
            *("--random-output-len", str(self.output_len), "--num-prompts", str(self.num_prompts)),
            *("--max-concurrency", str(self.concurrency), "--ignore-eos", "--disable-tqdm"),
            *("--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99"),
            *("--save-result", "--result-dir", str(self.result_dir), "--result-filename", self.result_filename),
            *(["--goodput", *(f"{k}:{v:g}" for k, v in self.goodput)] if self.goodput else []),
        ]


def in_process_ok(python: str) -> bool:
    """Whether a run for the build whose interpreter is ``python`` can go in-process: that build
    has vLLM's benchmark module (so its CLI is the one parsed here) and so has this interpreter."""
    import importlib.util

    root = Path(python).parent.parent
    if not glob.glob(str(root / "lib" / "python*" / "site-packages" / "vllm" / "benchmarks" / "serve.py")):
        return False
    try:
        return importlib.util.find_spec("vllm.benchmarks.serve") is not None
    except (ImportError, ValueError):
        return False


def run(
    python: str, load: LoadRun, log_path: Path, timeout_s: float, in_process: bool | None = None
) -> tuple[int, float]:
    """Run ``load`` in-process (``in_process`` None: when :func:`in_process_ok`) or as ``python -m
    vllm.entrypoints.cli.main bench serve``, its output in ``log_path``. Returns ``(exit code,
    seconds)``; raises ``TimeoutError`` past ``timeout_s``."""
    t = time.monotonic()
    if in_process_ok(python) if in_process is None else in_process:
        rc = _in_process(load.argv(), log_path, timeout_s)
    else:
        argv = [python, "-m", "vllm.entrypoints.cli.main", "bench", "serve", *load.argv()]
        with open(log_path, "w") as logf:
            try:
                rc = subprocess.run(argv, stdout=logf, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"vllm bench serve exceeded {timeout_s:.0f} s") from None
    return rc, time.monotonic() - t


@contextlib.contextmanager
def vllm_logs_to(stream: IO[str]) -> Iterator[None]:
    """While active, records of the ``vllm`` logger (its import-time warnings, the benchmark's
    dataset notes) go to ``stream`` (the phase's log) instead of pdsweep's stderr, as they did
    when ``vllm bench serve`` was a subprocess."""
    lg = logging.getLogger("vllm")
    saved = lg.handlers[:], lg.propagate
    lg.handlers, lg.propagate = [logging.StreamHandler(stream)], False
    try:
        yield
    finally:
        lg.handlers, lg.propagate = saved


def _in_process(argv: list[str], log_path: Path, timeout_s: float) -> int:
    """vLLM's parser and ``main_async`` on ``argv``; stdout into ``log_path``. An exception is
    logged there and returned as exit code 1 (what the CLI would exit)."""
    import traceback

    with open(log_path, "w") as logf, contextlib.redirect_stdout(logf), vllm_logs_to(logf):
        print("pdsweep: vllm bench serve in-process:", " ".join(argv), flush=True)
        from vllm.benchmarks.serve import add_cli_args, main_async
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = FlexibleArgumentParser(prog="vllm bench serve")
        add_cli_args(parser)
        try:
            args = parser.parse_args(argv)
            asyncio.run(asyncio.wait_for(main_async(args), timeout_s))
        except (TimeoutError, asyncio.TimeoutError):
            raise TimeoutError(f"vllm bench serve exceeded {timeout_s:.0f} s") from None
        except (Exception, SystemExit):  # noqa: BLE001 -- the CLI's exit code, the traceback kept
            traceback.print_exc(file=logf)
            return 1
    return 0


def figures(result: dict[str, Any], load: LoadRun) -> dict[str, Any]:
    """One run's load.json entry from vLLM's result file ``result``: latencies in ms (mean,
    p50, p90, p99), ``output_tok_s`` (tokens/s), ``req_s`` (requests/s), counts."""

    def pct(metric: str) -> dict[str, Any]:
        return {
            "mean": result.get(f"mean_{metric}_ms"),
            "p50": result.get(f"p50_{metric}_ms", result.get(f"median_{metric}_ms")),
            "p90": result.get(f"p90_{metric}_ms"),
            "p99": result.get(f"p99_{metric}_ms"),
        }

    return {
        "concurrency": load.concurrency,
        "num_prompts": load.num_prompts,
        "input_len": load.input_len,
        "output_len": load.output_len,
        **{f"{m}_ms": pct(m) for m in ("ttft", "tpot", "itl", "e2el")},
        "output_tok_s": result.get("output_throughput"),
        "req_s": result.get("request_throughput"),
        "goodput_req_s": result.get("request_goodput"),  # None without --goodput
        "output_tokens": result.get("total_output_tokens"),  # 0 with every request "completed": nothing served
        "completed": result.get("completed"),
        "errors": result.get("failed", load.num_prompts - (result.get("completed") or 0)),
        "duration_s": result.get("duration"),  # vLLM's measured seconds of the run
    }


def read_result(load: LoadRun) -> dict[str, Any]:
    """vLLM's result file of ``load``; raises ``OSError``/``ValueError`` when missing or not JSON."""
    return json.loads((load.result_dir / load.result_filename).read_text())
