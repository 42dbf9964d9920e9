"""The light commands on a sweep of over 1000 cells (issue 40 item 3): goal < 10 s each on 2 cores.

The sweep is the maintainer sweep of issue 37 (``tests/fixtures/make_runs.py``) with a third
serve-args variant: 3 models x p1d1/p2d1/p1d2/p2d2 x P and D blocks 16/32/64/128 x
base/prefix caching/eager x fixed/unfixed = 1152 combinations on cuda, planned for one
8-GPU node.

1. ``pdsweep plan`` in-process (the CLI's ``main``, table output), median of 3 each: cold (an
   empty vLLM answer store, :mod:`pdsweep.builds.answers`: the first plan of a vLLM install,
   whose probe process imports vLLM and answers every backend, block-ratio and argv question)
   and warm (every plan after it: no vLLM imported). Both must be under 10 s; the warm plan's
   output must equal the cold one's (the store changes no answer). And the cold plan as a user
   runs it: ``python -m pdsweep plan`` in a fresh interpreter, start to exit, median of 2
   (reported beside the goal, not held to it).
2. ``pdsweep gate`` and ``pdsweep report`` of a fixture run of 1024 PD cells and their
   references (:func:`fixtures.make_runs.write_run`, every cell passing).

Figures go to ``results/bench/summary.md`` (the section per figure) and ``extra_info``.
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import pytest

from pdsweep.builds import answers, attnprobe

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))

from test_sweep_reuse import write_section  # noqa: E402

GOAL_S = 10.0
SCALE_SWEEP = """\
name: scale
description: 3 models x 4 TP layouts x P and D blocks x 3 serve-args variants x fixed/unfixed
platform: cuda
models_file: {models}
builds:
  fixed: {{description: fixed}}
  unfixed: {{venv: .venv-unfixed, description: unfixed}}
serve_args:
  base: []
  prefix: {{both: [--enable-prefix-caching]}}
  eager: {{both: [--enforce-eager]}}
matrix:
  model: [qwen3-0.6b, deepseek-v2-lite-chat, kimi-linear]
  tp: [p1d1, p2d1, p1d2, p2d2]
  prefill_block_size: [16, 32, 64, 128]
  decode_block_size: [16, 32, 64, 128]
  serve_args: [base, prefix, eager]
  build: [fixed, unfixed]
"""


@pytest.fixture(scope="module")
def scale(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("scale")
    path = root / "scale.yaml"
    path.write_text(SCALE_SWEEP.format(models=REPO / "sweeps" / "models.yaml"))
    return path


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory):
    """The answer store's directory for the module (each cold round empties it)."""
    with pytest.MonkeyPatch.context() as mp:
        root = tmp_path_factory.mktemp("answers")
        mp.setenv(answers.CACHE_ENV, str(root))
        _forget()
        yield root
        _forget()


def _forget() -> None:
    """This process forgets every vLLM answer it holds in memory (the disk store stays)."""
    answers.forget()
    attnprobe._ask.cache_clear()
    attnprobe._version.cache_clear()
    attnprobe.close_probes()


def _plan(path: Path) -> str:
    from pdsweep.cli import main

    _forget()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", str(path), "--gpus", "8"]) == 0
    return out.getvalue()


COLD: dict[str, object] = {}


def test_first_plan_of_a_vllm_install(benchmark, scale: Path, store: Path) -> None:
    def empty_store() -> None:
        _forget()
        for f in store.iterdir():
            f.unlink()

    text = benchmark.pedantic(_plan, args=(scale,), setup=empty_store, rounds=3, iterations=1)
    cold = benchmark.stats.stats.median
    answers.save_all()
    assert {f.name.split("-")[0] for f in store.iterdir()} == {"argv", "attn"}  # vLLM was asked
    COLD.update(text=text, s=cold)
    benchmark.extra_info.update(cold_s=cold, output_bytes=len(text))
    assert cold < GOAL_S, f"cold plan {cold:.1f} s, goal < {GOAL_S:.0f} s"


def test_first_plan_from_the_command_line(benchmark, scale: Path, tmp_path: Path) -> None:
    """What a user waits for: ``python -m pdsweep plan`` in a fresh interpreter on an empty
    answer store, from the interpreter's start to its exit (the probe's exit included)."""
    import os
    import subprocess

    def once() -> None:
        store = tmp_path / f"store-{os.urandom(4).hex()}"
        env = {**os.environ, answers.CACHE_ENV: str(store)}
        argv = [sys.executable, "-m", "pdsweep", "plan", str(scale), "--gpus", "8"]
        subprocess.run(argv, env=env, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    benchmark.pedantic(once, rounds=2, iterations=1)
    s = benchmark.stats.stats.median
    COLD.update(cli_s=s)
    benchmark.extra_info.update(cli_cold_s=s)
    # reported, not held to the goal: the goal is the in-process plan's; this adds the interpreter's
    # start and exit and read 8.8-10.7 s on this host on 2026-12-05 (11.0 s while the probe
    # tore vLLM down at exit)


def test_plan_of_1152_combinations(benchmark, scale: Path, store: Path) -> None:
    first = COLD.get("text") or _plan(scale)  # fills the store when run alone
    text = benchmark.pedantic(_plan, args=(scale,), rounds=3, iterations=1)
    warm = benchmark.stats.stats.median
    assert text == first  # the store changes no answer
    cold = COLD.get("s")
    benchmark.extra_info.update(cold_s=cold, warm_s=warm, output_bytes=len(text))
    write_section(
        "pdsweep plan of 1152 combinations (8 GPUs, table output)",
        [
            f"- warm answer store (every plan after the first per vLLM install): {warm:.1f} s "
            f"(goal < {GOAL_S:.0f} s: {'met' if warm < GOAL_S else 'missed'})",
            "- cold store (the first plan: one probe process imports vLLM and answers everything): "
            + (f"{cold:.1f} s (goal < {GOAL_S:.0f} s: {'met' if cold < GOAL_S else 'missed'})" if cold else "not run"),
            "- the same from the command line (a fresh interpreter, start to exit): "
            + (f"{COLD['cli_s']:.1f} s" if COLD.get("cli_s") else "not run"),
            f"- output: {len(text) / 1000:.0f} kB",
        ],
    )
    assert warm < GOAL_S


MODELS = ("tiny-llama", "tiny-mla", "tiny-nemotron-h", "tiny-qwen3-next", "qwen3-0.6b", "deepseek-v2-lite-chat")
MODELS += ("kimi-linear", "granite-4.0-h-tiny")


@pytest.fixture(scope="module")
def scale_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """1024 PD cells and their 512 references (8 models x 4 TP pairs x 4 blocks x 2 builds x 4
    serve-args variants), each passing (:func:`fixtures.make_runs.good_files`)."""
    from unittest import mock

    from fixtures.make_runs import case, pd, ref, write_run

    cells = [
        pd(m, p, d, b, blk, serve_args=v)
        for m in MODELS
        for p, d in ((1, 1), (2, 1), (1, 2), (2, 2))
        for blk in (16, 32, 64, 128)
        for b in ("fixed", "unfixed")
        for v in ("base", "prefix", "eager", "spec")
    ]
    refs = list({r.id: r for r in map(ref, cells)}.values())
    with mock.patch("os.fsync"):
        return write_run(tmp_path_factory.mktemp("run"), "scale", [case(c) for c in cells + refs], [], "scale")


@pytest.mark.parametrize("command", ["gate", "report"])
def test_gate_and_report_of_the_scale_run(benchmark, scale_run: Path, command: str, tmp_path: Path) -> None:
    from pdsweep.cli import main

    cells = len(list(p for p in scale_run.iterdir() if p.is_dir()))
    argv = [command, str(scale_run)] + (["--out", str(tmp_path)] if command == "report" else [])

    def once() -> int:
        with contextlib.redirect_stdout(io.StringIO()):
            return main(argv)

    rc = benchmark.pedantic(once, rounds=3, iterations=1)
    s = benchmark.stats.stats.median
    benchmark.extra_info.update(cells=cells, median_s=s)
    write_section(
        f"pdsweep {command} of a {cells}-cell run",
        [f"- {s:.1f} s (goal < {GOAL_S:.0f} s: {'met' if s < GOAL_S else 'missed'}), exit {rc}"],
    )
    assert rc == 0
