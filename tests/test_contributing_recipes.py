"""docs/contributing.md's recipes, followed: each test copies the repository's code into
``tmp_path``, makes the edits its recipe lists there (by program, at the anchors the recipe
names) and runs the check the recipe names, in a fresh interpreter over the copy. A recipe
naming a file, class or function that is gone fails here: the anchor is missing, or the
recipe no longer says what the test does."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "contributing.md"
RECIPES = ("A gate check", "A load workload", "A metric", "A fault", "A sweep axis", "A model")


def recipe(title: str) -> str:
    """The paragraph ``**TITLE.** ...`` of contributing.md, white space folded."""
    m = re.search(rf"^\*\*{re.escape(title)}\.\*\*(.*?)(?=^\*\*|^#|\Z)", DOC.read_text(), re.M | re.S)
    assert m, f"docs/contributing.md has no recipe '**{title}.**'"
    return " ".join(m.group(1).split())


def says(title: str, *snippets: str) -> None:
    text = recipe(title)
    missing = [s for s in snippets if s not in text]
    assert not missing, f"recipe '{title}' no longer says {missing}"


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    """pdsweep/, sweeps/, accuracy/ and the tests' top-level helpers and fixtures/make_runs.py, copied."""
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "pdsweep", tmp_path / "pdsweep", ignore=ignore)
    shutil.copytree(ROOT / "sweeps", tmp_path / "sweeps", ignore=ignore)
    shutil.copytree(ROOT / "accuracy", tmp_path / "accuracy", ignore=ignore)
    (tmp_path / "tests" / "fixtures").mkdir(parents=True)
    for p in (ROOT / "tests").glob("*.py"):
        shutil.copy2(p, tmp_path / "tests" / p.name)
    shutil.copy2(ROOT / "tests" / "fixtures" / "make_runs.py", tmp_path / "tests" / "fixtures" / "make_runs.py")
    return tmp_path


def edit(root: Path, rel: str, anchor: str, insert: str, after: bool = True, start: str = "") -> None:
    """Insert ``insert`` after (or before) the first ``anchor`` of file ``rel`` past ``start``."""
    path = root / rel
    assert path.is_file(), f"{rel}: no such file"
    text = path.read_text()
    base = text.index(start) if start and start in text else 0
    assert (not start or start in text) and anchor in text[base:], f"{rel}: no {start!r} ... {anchor!r}"
    i = text.index(anchor, base) + (len(anchor) if after else 0)
    path.write_text(text[:i] + insert + text[i:])


def run_py(root: Path, code: str, *argv: str) -> str:
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{root / 'tests'}"}
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *argv],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r.stdout


def test_every_file_a_recipe_names_exists() -> None:
    for title in RECIPES:
        for rel in re.findall(r"`((?:pdsweep|tests|sweeps|docs)/[\w/.-]+)`", recipe(title)):
            assert (ROOT / rel).exists(), f"recipe '{title}' names {rel}, which does not exist"


def test_gate_check_recipe(scratch: Path) -> None:
    says(
        "A gate check",
        "the `Check` protocol in `pdsweep/judge/gate.py`",
        "`files.problem(NAME)`",
        "Register it in `checks_for` in `pdsweep/judge/gate.py`",
        "`GateSpec` (`pdsweep/sweepfile/gatespec.py`)",
        "`pdsweep/results/layout.py`",
        "`CELL_FILES` (`pdsweep/judge/facts.py`",
        "`write_run` (`tests/fixtures/make_runs.py`)",
        "`gate_run`",
    )
    (scratch / "pdsweep" / "judge" / "trivial.py").write_text(
        textwrap.dedent('''
        """A new topic: a cell must have trivial.json."""
        from pdsweep.judge.facts import CellFiles
        from pdsweep.results import layout


        class TrivialCheck:
            name = "trivial"

            def applies(self, kind: str) -> bool:
                return True

            def fails(self, files: CellFiles) -> list[str]:
                return [] if files.get(layout.TRIVIAL_FILE) else [files.problem(layout.TRIVIAL_FILE)]
        ''')
    )
    edit(scratch, "pdsweep/results/layout.py", 'LOAD_FILE = "load.json"\n', 'TRIVIAL_FILE = "trivial.json"\n')
    edit(scratch, "pdsweep/judge/facts.py", "CELL_FILES = (\n", "    layout.TRIVIAL_FILE,\n")
    edit(scratch, "pdsweep/sweepfile/gatespec.py", "class GateSpec(_Strict):\n", "    require_trivial: bool = True\n")
    gate = "pdsweep/judge/gate.py"
    edit(scratch, gate, "from __future__ import annotations\n", "from pdsweep.judge.trivial import TrivialCheck\n")
    edit(scratch, gate, "    return checks\n", "    if gate.require_trivial:\n        checks.append(TrivialCheck())\n",
         after=False, start="def checks_for(")  # fmt: skip
    run_py(
        scratch,
        """
        import tempfile
        from pathlib import Path
        from fixtures.make_runs import case, pd, write_run
        from pdsweep.judge.gate import FAIL, PASS, gate_run
        from pdsweep.results import layout
        from pdsweep.sweepfile.gatespec import GateSpec

        cell = pd("tiny-llama", 1, 1)
        run = write_run(Path(tempfile.mkdtemp()), "r", [case(cell)])
        (res,) = gate_run(run).cells
        assert res.verdict == FAIL and f"{cell.id}/trivial.json: missing" in res.reasons, res
        assert gate_run(run, GateSpec(require_trivial=False)).cells[0].verdict == PASS
        layout.write_json(run / cell.id / layout.TRIVIAL_FILE, {"ok": True})
        assert gate_run(run).cells[0].verdict == PASS
        """,
    )


def test_load_workload_recipe(scratch: Path) -> None:
    says(
        "A load workload",
        "`WorkloadSpec` (`pdsweep/sweepfile/phases.py`",
        "its name in `WorkloadSpec.name` and its requests in `build` (`pdsweep/measure/workloads.py`, "
        "one `LoadRequest` per prompt)",
    )
    edit(scratch, "pdsweep/sweepfile/phases.py", "    name: Literal[", '"single", ', start="class WorkloadSpec(")
    edit(scratch, "pdsweep/measure/workloads.py", '    if name == "random":\n',
         '    if name == "single":\n        return [LoadRequest(f"{name}/0", tok.prompt(f"{name}:0", length), out_len)]\n',
         after=False, start="def build(")  # fmt: skip
    tok = next((ROOT / "fixtures" / "tiny").glob("tiny-llama-*"))
    out = run_py(
        scratch,
        """
        import sys
        sys.modules["transformers"] = None  # the tokenizers fallback: fast
        from pdsweep.measure.workloads import build
        from pdsweep.sweepfile.phases import BenchSpec, WorkloadSpec

        bench = BenchSpec.model_validate({"enabled": True, "workloads": ["single"]})
        (req,) = build(bench.workloads[0], bench, sys.argv[1], block=16, max_model_len=512, text="prose")
        print(req.id, len(req.token_ids), req.max_tokens)
        """,
        str(tok),
    )
    assert out.split() == ["single/0", "128", "16"]  # BenchSpec's input_len and output_len


def test_metric_recipe(scratch: Path) -> None:
    says(
        "A metric",
        "a constant in `pdsweep/measure/metrics.py`, summarised in `_summary`",
        "`COUNT_TOTALS` (non-negative whole numbers) or `MEASURE_TOTALS` (`pdsweep/judge/transfer.py`, "
        "checked by `impossible_totals`)",
        "`CellFacts.total` (`pdsweep/judge/facts.py`)",
    )
    metrics = "pdsweep/measure/metrics.py"
    edit(scratch, metrics, 'NIXL_FAILED_TRANSFERS = "vllm:nixl_num_failed_transfers"\n',
         'NIXL_TRIVIAL = "vllm:nixl_num_trivial"\n')  # fmt: skip
    edit(scratch, metrics, "    return {\n", '        "trivial": _int(_counter(counters, NIXL_TRIVIAL)),\n',
         start="def _summary(")  # fmt: skip
    edit(scratch, "pdsweep/judge/transfer.py", "COUNT_TOTALS = (\n", '    "trivial",\n')
    run_py(
        scratch,
        """
        from pdsweep.judge.facts import CellFacts
        from pdsweep.judge.transfer import impossible_totals
        from pdsweep.measure.metrics import parse, summarize_transfer

        text = '# TYPE vllm:nixl_num_trivial_total counter\\nvllm:nixl_num_trivial_total{engine="0"} 3.0\\n'
        totals = summarize_transfer({"decode-0": parse(text), "prefill-0": parse(text)}, wall_s=1.0)
        assert totals["trivial"] == 6, totals
        assert CellFacts(totals=totals).total("trivial") == 6
        assert impossible_totals({"trivial": 1.5}, "c/transfer.json") == [
            "c/transfer.json: totals.trivial = 1.5: a count must be a whole number"
        ]
        """,
    )


def test_fault_drill_recipe(scratch: Path) -> None:
    says(
        "A fault",
        "an env knob in `tests/fake_vllm.py` (the `FAKE_*` list in its docstring",
        "an `env:` variant of the sweep `make_sweep` writes",
        "`tests/test_run_fake.py`",
        "`SWEEP_FAULTS` there",
        "`scramble_kv_block_ids` switch of `ProxyFaults` (`pdsweep/core/faults.py`)",
    )
    edit(scratch, "tests/fake_vllm.py", "``pdsweep.core.faults.FAKE_FAULTS``):\n\n",
         "FAKE_TRIVIAL         a new knob (this test's)\n")  # fmt: skip
    edit(scratch, "tests/fake_vllm.py", "    block = os.environ.get(", '    trivial = os.environ.get("FAKE_TRIVIAL")\n',
         after=False)  # fmt: skip
    run_py(
        scratch,
        """
        import ast, re, tempfile
        from pathlib import Path
        from test_run_fake import make_sweep
        from pdsweep.core.faults import SWEEP_FAULTS, ProxyFaults
        from pdsweep.sweepfile.sweep import load_sweep

        src = Path("tests/fake_vllm.py").read_text()
        doc = set(re.findall(r"FAKE_[A-Z_]+", ast.get_docstring(ast.parse(src))))
        knobs = set(re.findall(r"[\\"'](FAKE_[A-Z_]+)[\\"']", src))
        assert "FAKE_TRIVIAL" in knobs and knobs <= doc, sorted(knobs - doc)
        tmp = Path(tempfile.mkdtemp())
        sweep = make_sweep(tmp, tmp, matrix="  model: [fake-gqa]\\n  tp: [p1d1]\\n",
                           env="  base: {}\\n  trivial: {FAKE_TRIVIAL: '1'}")
        assert load_sweep(sweep).sweep.env["trivial"] == {"FAKE_TRIVIAL": "1"}
        assert "scramble_kv_block_ids" in ProxyFaults.__dataclass_fields__
        assert "kill-prefill-during-eval" in SWEEP_FAULTS
        """,
    )


def test_model_recipe(scratch: Path) -> None:
    says(
        "A model",
        "An entry in `sweeps/models.yaml`",
        "`ModelSpec`, `pdsweep/sweepfile/catalogue.py`",
        "`pdsweep validate SWEEP`",
        "the kind's builder in `_KINDS` (`pdsweep/tiny/config.py`)",
    )
    entry = (
        "  tiny-llama-b:\n    tiny: {kind: llama, seed: 7}\n    architecture: LlamaForCausalLM\n"
        "    attention: gqa\n    num_layers: 2\n    num_attention_heads: 4\n    num_kv_heads: 2\n"
        "    attn: {head_dim: 32}\n    dtype: float32\n    max_model_len: 512\n    platforms: {cpu: {}}\n"
    )
    edit(scratch, "sweeps/models.yaml", "  tiny-llama:\n", entry, after=False)
    sweep = scratch / "sweeps" / "new-model.yaml"
    sweep.write_text("name: new-model\nplatform: cpu\nmatrix: {model: [tiny-llama-b], tp: [p1d1], block_size: [32]}\n")
    out = run_py(scratch, "from pdsweep.cli import main; raise SystemExit(main())", "validate", "--no-check-argv",
                 str(sweep))  # fmt: skip
    assert "new-model.yaml: valid: 1 PD cells, 1 reference cells, 0 rejected" in out
    run_py(
        scratch,
        """
        from pdsweep.sweepfile.sweep import load_catalogue
        from pdsweep.tiny.config import _KINDS, config_params

        m = load_catalogue("sweeps/models.yaml").models["tiny-llama-b"]
        assert m.tiny.kind in _KINDS
        p = config_params("tiny-llama-b", m)
        assert (p["num_hidden_layers"], p["num_key_value_heads"], p["head_dim"]) == (2, 2, 32), p
        """,
    )


def test_sweep_axis_recipe(scratch: Path) -> None:
    says(
        "A sweep axis",
        "Three files.",
        "`AXIS_TYPES` (`pdsweep/sweepfile/axes.py`)",
        "The `Cell` field of that name and default, and its part of the cell id in `_id_parts`",
        "(`pdsweep/plan/cell.py`",
        "`serve_env` (`pdsweep/plan/instance.py`)",
        "`tests/test_sweepfile_axes.py`",
    )
    edit(scratch, "pdsweep/sweepfile/axes.py", '    "fault": (Fault, "none"),', '\n    "kv_offload": (bool, False),',
         start="AXIS_TYPES")  # fmt: skip
    edit(scratch, "pdsweep/plan/cell.py", "    kind: str = ", "    kv_offload: bool = False\n", after=False)
    edit(scratch, "pdsweep/plan/cell.py", "        return parts\n", '        if self.kv_offload:\n            parts.append("kvoff")\n',
         after=False, start="def _id_parts(")  # fmt: skip
    edit(scratch, "pdsweep/plan/instance.py", '    if cell.fault != "none":', 'env["PDSWEEP_KV_OFFLOAD"] = "1"\n',
         after=False, start="def serve_env(")  # fmt: skip
    edit(
        scratch,
        "pdsweep/plan/instance.py",
        'env["PDSWEEP_KV_OFFLOAD"]',
        "    if cell.kv_offload:\n        ",
        after=False,
    )
    sweep = scratch / "sweeps" / "new-axis.yaml"
    sweep.write_text(
        "name: new-axis\nplatform: cpu\ndefaults: {kv_offload: false}\n"
        "matrix:\n  model: [tiny-llama]\n  tp: [p1d1]\n  block_size: [32]\n  kv_offload: [false, true]\n"
        "  exclude: [{kv_offload: true, block_size: 64}]\n"
    )
    out = run_py(scratch, "from pdsweep.cli import main; raise SystemExit(main())", "validate", "--no-check-argv",
                 str(sweep))  # fmt: skip
    assert "new-axis.yaml: valid: 2 PD cells, 2 reference cells, 0 rejected" in out
    run_py(
        scratch,
        """
        import sys
        from pdsweep.plan.expand import expand
        from pdsweep.plan.instance import Slot, instances
        from pdsweep.sweepfile.sweep import load_sweep
        from test_sweepfile_axes import test_an_axis_is_declared_once_and_every_cell_has_it

        test_an_axis_is_declared_once_and_every_cell_has_it()
        ls = load_sweep(sys.argv[1])
        pd = {c.id: c for c in expand(ls).cells if c.kind == "pd"}
        assert sorted(pd) == ["tiny-llama.p1d1.b32-32.fixed", "tiny-llama.p1d1.b32-32.fixed.kvoff"], sorted(pd)
        on = pd["tiny-llama.p1d1.b32-32.fixed.kvoff"]
        assert on.compare_key == "tiny-llama.p1d1.b32-32.kvoff"
        specs = instances(on, Slot(0, (), 20000), ls, "/m", "python")
        assert [s.env.get("PDSWEEP_KV_OFFLOAD") for s in specs] == ["1", "1"], [s.env for s in specs]
        """,
        str(sweep),
    )
