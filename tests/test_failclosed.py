"""Issue 15, "fail closed everywhere": one section per kind of fault, each with the
reported examples and a hypothesis property that generates such inputs."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import pytest
from fixtures.make_runs import TR, case, pd, totals, write_run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdsweep.cli import main
from pdsweep.core.errors import UserError
from pdsweep.judge.gate import FAIL, PASS, gate_run
from pdsweep.judge.transfer import impossible_totals
from pdsweep.measure.accuracy import load_expected
from pdsweep.plan.expand import expand, reference_of
from pdsweep.run.feasible import cannot_pass, feasibility_warnings
from pdsweep.spec.sweep import load_sweep

REPO = Path(__file__).resolve().parent.parent
SHIPPED = sorted(p for p in (REPO / "sweeps").glob("*.yaml") if p.name != "models.yaml")

HC = [HealthCheck.function_scoped_fixture]


def write(tmp_path: Path, body: str, models: str | None = None) -> Path:
    (tmp_path / "models.yaml").write_text(models or (REPO / "sweeps" / "models.yaml").read_text())
    p = tmp_path / "s.yaml"
    p.write_text(body)
    return p


def bad(tmp_path: Path, body: str, capsys, models: str | None = None) -> str:
    """``pdsweep validate`` on ``body``: exit 2, no traceback; returns stderr."""
    assert main(["validate", str(write(tmp_path, body, models))]) == 2
    out = capsys.readouterr()
    assert "Traceback" not in out.err and out.err.startswith("error: ")
    return out.err


def good(tmp_path: Path, body: str, capsys, models: str | None = None) -> str:
    assert main(["validate", str(write(tmp_path, body, models))]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


SMALL = "name: x\nplatform: cpu\nmatrix: {model: [tiny-llama], tp: [p1d1], block_size: [32]}\n"
# a model without an expected pdsweep_arith score (trained tiny-llama has one)
UNSCORED = SMALL.replace("tiny-llama", "tiny-nemotron-h-g1")
CELL = pd("tiny-llama", 1, 1)
WHERE = f"{CELL.id}/{TR}"


# ---------------------------------------------------------------- 1. metric values that cannot be real
def gate_totals(root: Path, **t) -> tuple[str, tuple[str, ...]]:
    r = gate_run(write_run(root, "run", [case(CELL, totals(**t))])).cell(CELL.id)
    return r.verdict, r.reasons


@pytest.mark.parametrize(
    "field, value, why",
    [
        ("failed_transfers", -1, "totals.failed_transfers = -1: negative (allowed: >= 0)"),
        ("failed_notifications", -3, "totals.failed_notifications = -3: negative (allowed: >= 0)"),
        ("num_transfers", 2.5, "totals.num_transfers = 2.5: a count must be a whole number"),
        ("bytes", "300", 'totals.bytes is "300": not a finite number'),
        ("failed_transfers", True, "totals.failed_transfers is true: not a finite number"),
        ("num_transfers", 10**400, "not a finite number"),
        ("gbps_xfer", -0.5, "totals.gbps_xfer = -0.5: negative (allowed: >= 0)"),
    ],
)
def test_impossible_transfer_values_fail_the_cell(tmp_path: Path, field: str, value, why: str) -> None:
    verdict, reasons = gate_totals(tmp_path, **{field: value})
    assert verdict == FAIL
    assert any(r.startswith(f"{WHERE}: totals.{field}") and why in r for r in reasons), reasons


def test_huge_integer_in_results_is_a_verdict_not_a_traceback(tmp_path: Path) -> None:
    run = write_run(tmp_path, "run", [case(CELL)])
    path = run / CELL.id / TR
    path.write_text(path.read_text().replace('"failed_transfers": 0', '"failed_transfers": ' + "9" * 400))
    assert gate_run(run).cell(CELL.id).verdict == FAIL


COUNTS = st.sampled_from(["num_transfers", "bytes", "failed_transfers", "failed_notifications", "expired_reqs"])
BAD = st.one_of(
    st.integers(max_value=-1),
    st.floats(max_value=-1e-9, allow_nan=False, allow_infinity=False),
    st.floats(min_value=0.01, max_value=1e6).filter(lambda x: x != int(x)),
    st.text(max_size=5),
    st.booleans(),
    st.integers(min_value=2**1100, max_value=2**1200),
)


@given(COUNTS, BAD)
@settings(max_examples=60, deadline=None)
def test_property_impossible_counts_are_named(field: str, value) -> None:
    (why,) = impossible_totals({field: value}, "c/transfer.json")
    assert why.startswith(f"c/transfer.json: totals.{field}")


@given(st.integers(1, 10**6), st.integers(1, 10**12))
@settings(max_examples=20, deadline=None, suppress_health_check=HC)
def test_property_plausible_counts_pass(tmp_path: Path, n: int, nbytes: int) -> None:
    root = Path(tempfile.mkdtemp(dir=tmp_path))
    assert gate_totals(root, num_transfers=n, kv_requests=n, bytes=nbytes) == (PASS, ())
    assert json.loads((root / "run" / CELL.id / TR).read_text())["totals"]["bytes"] == nbytes


# ---------------------------------------------------------------- 2. sweeps that cannot pass
@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_sweep_can_pass_in_principle(path: Path) -> None:
    """Each PD cell not expected to fail has what each gate check needs: a reference cell
    in the plan for consistency, an expected score or a reference for every task."""
    plan = expand(load_sweep(path))
    s, ids = plan.loaded.sweep, {c.id for c in plan.cells}
    expected = load_expected()
    assert plan.pd_cells and cannot_pass(plan) == []
    for c in (c for c in plan.pd_cells if not c.expect_fail):
        ref = reference_of(c, plan.loaded).id  # the variant's `reference:` (e.g. base) where it names one
        if s.gate.require_consistency:
            assert s.eval.consistency.enabled and ref in ids, c.id
        if s.gate.require_accuracy:
            assert s.eval.tasks
            for t in s.eval.tasks:
                assert t in expected.get(c.model, {}) or ref in ids, (c.id, t)


def test_upstream_sweep_validates_without_contradiction(capsys) -> None:
    assert main(["validate", str(REPO / "sweeps" / "upstream-config-sweep.yaml")]) == 0
    assert "valid: 20 PD cells, 0 reference cells" in capsys.readouterr().out  # 20: + run_mamba_prefix_cache_test.sh


def test_consistency_without_reference_is_refused(tmp_path: Path, capsys) -> None:
    msg = bad(tmp_path, SMALL + "eval: {reference: false}\n", capsys)
    assert "gate.require_consistency is true but eval.reference is false" in msg


def test_consistency_required_but_disabled_is_refused(tmp_path: Path, capsys) -> None:
    msg = bad(tmp_path, SMALL + "eval: {consistency: {enabled: false}}\n", capsys)
    assert "gate.require_consistency is true but eval.consistency.enabled is false" in msg


def test_accuracy_without_expected_score_or_reference_is_refused(tmp_path: Path, capsys) -> None:
    msg = bad(
        tmp_path,
        UNSCORED + "eval: {reference: false, consistency: {enabled: false}}\ngate: {require_consistency: false}\n",
        capsys,
    )
    assert "model tiny-nemotron-h-g1: no expected score for task(s) pdsweep_arith" in msg


@given(st.booleans(), st.booleans(), st.booleans(), st.booleans(), st.booleans())
@settings(max_examples=32, deadline=None, suppress_health_check=HC)
def test_property_validate_refuses_exactly_the_contradictions(
    tmp_path: Path, reference: bool, probe: bool, req_con: bool, req_acc: bool, tasks: bool
) -> None:
    body = UNSCORED + (
        f"eval: {{reference: {str(reference).lower()}, tasks: {'[pdsweep_arith]' if tasks else '[]'}, "
        f"consistency: {{enabled: {str(probe).lower()}}}}}\n"
        f"gate: {{require_consistency: {str(req_con).lower()}, require_accuracy: {str(req_acc).lower()}}}\n"
    )
    root = Path(tempfile.mkdtemp(dir=tmp_path))
    plan = expand(load_sweep(write(root, body)))
    # tiny-nemotron-h-g1 has no expected score: accuracy can pass only against a reference
    contradiction = (req_con and not (probe and reference)) or (req_acc and not (tasks and reference))
    assert bool(cannot_pass(plan)) == contradiction


# ---------------------------------------------------------------- 3. validate runs every check plan/run runs
def test_unknown_lm_eval_task_is_found_at_validate(tmp_path: Path, capsys) -> None:
    msg = bad(tmp_path, SMALL + "eval: {tasks: [gsm8k, gsm9k]}\n", capsys)
    assert "eval.tasks: unknown lm-eval task(s) ['gsm9k']" in msg


def test_unknown_pdsweep_task_needs_no_lm_eval_index(tmp_path: Path, capsys) -> None:
    assert "unknown lm-eval task(s) ['pdsweep_arithm']" in bad(
        tmp_path, SMALL + "eval: {tasks: [pdsweep_arithm]}\n", capsys
    )


def test_empty_probe_lengths_are_refused(tmp_path: Path, capsys) -> None:
    assert "eval.consistency.lengths" in bad(tmp_path, SMALL + "eval: {consistency: {lengths: []}}\n", capsys)


def test_probe_length_beyond_the_context_is_found_at_validate(tmp_path: Path, capsys) -> None:
    msg = bad(tmp_path, SMALL + "eval: {consistency: {lengths: [100000]}}\n", capsys)
    assert "eval.consistency.lengths: 100000 tokens is outside 1..503" in msg and "tiny-llama.p1d1" in msg


def test_tiny_geometry_missing_names_the_real_catalogue(tmp_path: Path, capsys) -> None:
    models = (
        "models:\n  t:\n    tiny: {kind: llama}\n    architecture: LlamaForCausalLM\n"
        "    attention: gqa\n    num_layers: 2\n    platforms: {cpu: {}}\n"
    )
    msg = bad(tmp_path, "name: x\nplatform: cpu\nmatrix: {model: [t], tp: [p1d1], block_size: [32]}\n", capsys, models)
    assert msg.startswith(f"error: {tmp_path / 'models.yaml'}: models.t: tiny checkpoint needs")


def test_build_python_that_does_not_exist_is_refused(tmp_path: Path, capsys) -> None:
    msg = bad(tmp_path, SMALL.replace("matrix:", "builds: {fixed: {python: /nope/bin/python}}\nmatrix:"), capsys)
    assert "builds.fixed.python: /nope/bin/python is not an executable file" in msg


def test_build_venv_not_built_yet_is_a_warning(tmp_path: Path, capsys) -> None:
    p = write(tmp_path, SMALL.replace("matrix:", "builds: {fixed: {venv: .venv-nope}}\nmatrix:"))
    assert main(["validate", str(p)]) == 0
    assert "warning: " in capsys.readouterr().err
    assert feasibility_warnings(expand(load_sweep(p)), tasks=False)[0].endswith("until then cells of build fixed fail")


# ---------------------------------------------------------------- 4. duplicate YAML keys
def test_duplicate_key_in_a_sweep_names_both_lines(tmp_path: Path, capsys) -> None:
    msg = bad(tmp_path, "name: x\nplatform: cpu\nmatrix: {model: [tiny-llama]}\nplatform: cuda\n", capsys)
    assert f"{tmp_path / 's.yaml'}:4: duplicate key 'platform' (first at line 2)" in msg


def test_duplicate_key_in_the_catalogue_names_both_lines(tmp_path: Path, capsys) -> None:
    models = (
        (REPO / "sweeps" / "models.yaml")
        .read_text()
        .replace("  tiny-llama:\n", "  tiny-llama:\n    num_layers: 3\n", 1)
    )
    msg = bad(tmp_path, SMALL, capsys, models)
    assert f"{tmp_path / 'models.yaml'}:" in msg and "duplicate key 'num_layers' (first at line " in msg


@given(st.sampled_from(["name", "platform", "defaults", "eval"]), st.integers(0, 3))
@settings(max_examples=20, deadline=None, suppress_health_check=HC)
def test_property_any_repeated_key_is_refused(tmp_path: Path, key: str, pad: int) -> None:
    lines = [
        "name: x",
        "platform: cpu",
        "defaults: {max_num_seqs: 4}",
        "eval: {limit: 2}",
        "matrix: {model: [tiny-llama], tp: [p1d1], block_size: [32]}",
    ]
    first = next(i for i, line in enumerate(lines) if line.startswith(key + ":")) + 1
    body = "\n".join(lines + ["# pad"] * pad + [next(x for x in lines if x.startswith(key + ":"))]) + "\n"
    p = write(Path(tempfile.mkdtemp(dir=tmp_path)), body)
    with pytest.raises(UserError, match=rf":{len(lines) + pad + 1}: duplicate key '{key}' \(first at line {first}\)"):
        load_sweep(p)


# ---------------------------------------------------------------- 5. names, ids and paths
@pytest.mark.parametrize(
    "name", ["../escape", "a/b", "two\nlines", "trailing\n", "x" * 300, "has.dot", "-dash", "p2d1", "env-x"]
)
def test_unsafe_variant_names_are_refused(tmp_path: Path, capsys, name: str) -> None:
    body = SMALL.replace("matrix:", f"serve_args: {{base: [], {json.dumps(name)}: []}}\nmatrix:")
    assert "serve_args: name " in bad(tmp_path, body, capsys)


@pytest.mark.parametrize("field", ["builds", "env"])
def test_unsafe_build_and_env_names_are_refused(tmp_path: Path, capsys, field: str) -> None:
    body = SMALL.replace("matrix:", f"{field}: {{'../../etc': {{}}}}\nmatrix:")
    assert f"{field}: name '../../etc' is not safe" in bad(tmp_path, body, capsys)


def test_unsafe_model_name_is_refused(tmp_path: Path, capsys) -> None:
    models = (REPO / "sweeps" / "models.yaml").read_text().replace("  tiny-llama:\n", "  ../tiny-llama:\n", 1)
    assert "models: name '../tiny-llama' is not safe" in bad(tmp_path, SMALL, capsys, models)


def test_cell_dir_refuses_ids_outside_the_run(tmp_path: Path) -> None:
    from pdsweep.results import layout

    assert layout.cell_dir(tmp_path, "m.p1d1.b16-16.fixed") == tmp_path / "m.p1d1.b16-16.fixed"
    for cid in ("../x", "a/b", "..", "", "a..b", 7):
        with pytest.raises(UserError, match="not a safe directory name"):
            layout.cell_dir(tmp_path, cid)
    (tmp_path / "link").symlink_to(tmp_path.parent)
    with pytest.raises(UserError, match="outside the run directory"):
        layout.inside(tmp_path, tmp_path / "link" / "x")


def test_gate_of_a_run_json_with_a_hostile_cell_id_is_bad_input(tmp_path: Path) -> None:
    run = write_run(tmp_path, "run", [case(CELL)])
    index = json.loads((run / "run.json").read_text())
    index["cells"]["../../outside"] = {"kind": "pd"}
    (run / "run.json").write_text(json.dumps(index))
    with pytest.raises(UserError, match="'../../outside' is not a safe directory name"):
        gate_run(run)


def test_compare_key_drops_only_the_build_part() -> None:
    c = dataclasses.replace(pd("m.fixed", 1, 1, "fixed"), serve_args="fixed")
    assert (c.id, c.compare_key) == ("m.fixed.p1d1.b16-16.fixed.fixed", "m.fixed.p1d1.b16-16.fixed")


NAMES = st.text(st.characters(codec="utf-8"), min_size=1, max_size=80)


@given(NAMES)
@settings(max_examples=200, deadline=None)
def test_property_accepted_names_are_one_safe_path_component(name: str) -> None:
    from pdsweep.spec.guards import unsafe_name

    for model in (False, True):
        if unsafe_name(name, model) is None:
            assert "/" not in name and ".." not in name and name.strip() == name and name.isascii()
            assert (Path("/run") / name).parent == Path("/run") and len(name) <= 64
            assert model or "." not in name


# ---------------------------------------------------------------- 6. flags that define the cell
@pytest.mark.parametrize(
    "arg, axis",
    [
        ("--tensor-parallel-size", "the tp axis"),
        ("--tensor_parallel_size=2", "the tp axis"),
        ("-tp", "the tp axis"),
        ("-tp=2", "the tp axis"),
        ("--tensor-parallel", "the tp axis"),
        ("--data-parallel-size", "decode_dp"),
        ("-dp", "decode_dp"),
        ("--block-size=32", "the block_size axis"),
        ("--port", "defaults.port_base"),
        ("--host", "127.0.0.1"),
        ("--kv-transfer-config", "kv_buffer_device"),
        ("--kv-transfer-config.kv_role", "kv_role"),
        ("--config", "a --config file"),
    ],
)
def test_cell_defining_flags_are_refused_with_the_axis(tmp_path: Path, capsys, arg: str, axis: str) -> None:
    body = SMALL.replace("matrix:", f"serve_args: {{base: [], x: {{decode: [{json.dumps(arg)}, '2']}}}}\nmatrix:")
    msg = bad(tmp_path, body, capsys)
    assert "serve_args.x.decode[0]: " in msg and "defines the cell" in msg and axis in msg


@pytest.mark.parametrize(
    "var",
    [
        "VLLM_PORT",
        "VLLM_NIXL_SIDE_CHANNEL_PORT",
        "VLLM_NIXL_SIDE_CHANNEL_HOST",
        "VLLM_KV_CACHE_LAYOUT",
        "CUDA_VISIBLE_DEVICES",
    ],
)
def test_cell_defining_env_is_refused(tmp_path: Path, capsys, var: str) -> None:
    body = SMALL.replace("matrix:", f"env: {{base: {{}}, x: {{{var}: '1'}}}}\nmatrix:")
    assert f"env.x.{var}: {var} is set by pdsweep and defines the cell: use " in bad(tmp_path, body, capsys)


def test_catalogue_serve_args_cannot_set_the_block_size(tmp_path: Path, capsys) -> None:
    models = (
        (REPO / "sweeps" / "models.yaml")
        .read_text()
        .replace("  tiny-llama:\n", "  tiny-llama:\n    serve_args: [--block-size, '64']\n", 1)
    )
    assert "models.tiny-llama.serve_args[0]: '--block-size' sets --block-size" in bad(tmp_path, SMALL, capsys, models)


def test_flags_models_and_sweeps_legitimately_set_pass(tmp_path: Path, capsys) -> None:
    body = SMALL.replace(
        "matrix:",
        "serve_args: {base: [], x: [--attention-backend, CPU_ATTN, "
        "--no-enable-prefix-caching, --num-gpu-blocks-override, '512', "
        "--max-model-len, '512', --speculative-config, '{\"method\": \"mtp\"}']}\nmatrix:",
    )
    assert "valid: 1 PD cells" in good(tmp_path, body, capsys)


FLAG_CHARS = st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyz-_"), min_size=1, max_size=30)


@given(FLAG_CHARS)
@settings(max_examples=300, deadline=None)
def test_property_a_flag_vllm_would_read_as_a_reserved_one_is_refused(name: str) -> None:
    """Whatever spelling vLLM's parser maps to a reserved flag (``_`` for ``-``, ``.key``
    suffixes, ``=value``, unique prefixes) is refused; other flags pass."""
    from pdsweep.spec.guards import RESERVED_FLAGS, reserved_flag

    arg = "--" + name
    canon = "--" + name.replace("_", "-")
    hits = [
        f for f in RESERVED_FLAGS if f.startswith("--") and (canon == f or (len(canon) > 3 and f.startswith(canon)))
    ]
    assert (reserved_flag(arg) is not None) == bool(hits)
    assert (reserved_flag(arg + "=1") is not None) == bool(hits)
    assert (reserved_flag(arg + ".key") is not None) == bool(hits)


# ---------------------------------------------------------------- 7. bounds
@pytest.mark.parametrize(
    "patch, field, why",
    [
        ("defaults: {decode_dp: 9}", "defaults.decode_dp", "NIXL side-channel ports"),
        ("defaults: {port_base: 70000}", "defaults.port_base", "TCP ports end at 65535"),
        ("defaults: {prefill_tp: true}", "defaults.prefill_tp", "valid integer"),
        ("defaults: {prefill_block_size: 100000}", "defaults.prefill_block_size", "tokens per KV block"),
        ("bench: {concurrencies: [0]}", "bench.concurrencies[0]", "greater than or equal to 1"),
        ("eval: {consistency: {lengths: [-5]}}", "eval.consistency.lengths[0]", "greater than or equal to 1"),
        ("defaults: {num_decode: 12}", "defaults.num_decode", "at most 12 instances"),
    ],
)
def test_nonsense_numbers_are_refused(tmp_path: Path, capsys, patch: str, field: str, why: str) -> None:
    msg = bad(tmp_path, SMALL + patch + "\n", capsys)
    assert f"s.yaml:{SMALL.count(chr(10)) + 1}: {field}: " in msg and why in msg


def test_tp_pair_beyond_the_bound_is_refused(tmp_path: Path, capsys) -> None:
    assert "'p100d1': TP 100 is more than 64" in bad(tmp_path, SMALL.replace("p1d1", "p100d1"), capsys)


def test_negative_ssm_layers_is_refused(tmp_path: Path, capsys) -> None:
    models = (
        (REPO / "sweeps" / "models.yaml")
        .read_text()
        .replace("  tiny-llama:\n", "  tiny-llama:\n    ssm_layers: -3\n", 1)
    )
    assert "models.tiny-llama.ssm_layers: Input should be greater than or equal to 0" in bad(
        tmp_path, SMALL, capsys, models
    )


def test_gpu_count_and_port_range(capsys) -> None:
    from pdsweep.plan.schedule import GpuPool

    with pytest.raises(SystemExit) as e:
        main(["plan", str(REPO / "sweeps" / "cpu-smoke.yaml"), "--gpus", "-1"])
    assert e.value.code == 2 and "-1 GPUs: allowed 0..4096" in capsys.readouterr().err
    with pytest.raises(UserError, match="reach port 80199, past 65535"):
        GpuPool(301, 20000)
    assert GpuPool(8, 60000).port_base == 60000


@given(st.integers(-(10**6), 10**6))
@settings(max_examples=100, deadline=None)
def test_property_decode_dp_bounds(n: int) -> None:
    from pydantic import ValidationError

    from pdsweep.spec.serve import Defaults

    if 1 <= n <= 8:
        assert Defaults(decode_dp=n).decode_dp == n
    else:
        with pytest.raises(ValidationError):
            Defaults(decode_dp=n)


# ---------------------------------------------------------------- 9. no tracebacks on bad input
def test_invalid_utf8_sweep_is_bad_input(tmp_path: Path, capsys) -> None:
    p = tmp_path / "s.yaml"
    p.write_bytes(b"name: x\nplatform: cpu\ndescription: caf\xe9\nmatrix: {model: [tiny-llama]}\n")
    (tmp_path / "models.yaml").write_text((REPO / "sweeps" / "models.yaml").read_text())
    assert main(["validate", str(p)]) == 2
    assert f"error: {p}:3: not UTF-8 text (byte 0xe9 at offset 38)" in capsys.readouterr().err


@given(st.binary(min_size=1, max_size=200))
@settings(max_examples=100, deadline=None, suppress_health_check=HC)
def test_property_any_bytes_give_exit_0_or_2(tmp_path: Path, blob: bytes) -> None:
    root = Path(tempfile.mkdtemp(dir=tmp_path))
    p = root / "s.yaml"
    p.write_bytes(blob)
    (root / "models.yaml").write_text("models: {}\n")
    assert main(["validate", str(p)]) in (0, 2)


def test_internal_error_is_exit_3_with_a_traceback(monkeypatch, capsys) -> None:
    import pdsweep.plan.expand

    def boom(*a, **k):
        raise RuntimeError("a bug")

    monkeypatch.setattr(pdsweep.plan.expand, "expand", boom)
    assert main(["validate", str(REPO / "sweeps" / "cpu-smoke.yaml")]) == 3
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: a bug" in err and "internal error in pdsweep (exit 3)" in err


def _leaves(obj, path=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _leaves(v, (*path, i))
    yield path


JSON_ODD = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**30), 10**30),
    st.sampled_from([10**400, -(10**400)]),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@given(
    st.sampled_from(["cell.json", "status.json", "accuracy.json", "consistency.json", "transfer.json", "run.json"]),
    st.integers(0, 10**6),
    JSON_ODD,
)
@settings(max_examples=60, deadline=None, suppress_health_check=HC)
def test_property_odd_results_values_never_crash_gate_or_compare(
    tmp_path: Path, capsys, name: str, pick: int, value
) -> None:
    """Any leaf of any results file replaced by an odd JSON value: gate and compare give a
    verdict (0/1) or refuse the input (2), never an internal error."""
    root = Path(tempfile.mkdtemp(dir=tmp_path))
    run = write_run(root, "run", [case(CELL), case(CELL.reference())])
    path = run / name if name == "run.json" else run / CELL.id / name
    data = json.loads(path.read_text())
    leaves = [p for p in _leaves(data) if p and p != ("schema",)]
    target = leaves[pick % len(leaves)]
    cur = data
    for k in target[:-1]:
        cur = cur[k]
    cur[target[-1]] = value
    path.write_text(json.dumps(data))
    assert main(["gate", str(run), "--junit", str(root / "j.xml"), "--summary", str(root / "s.md")]) in (0, 1, 2)
    assert main(["compare", str(run), str(run), "--out", str(root)]) in (0, 1, 2)
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.timeout(60, method="thread")  # without the bound, a 10**30 decode_tp kept the gate busy for minutes
@pytest.mark.parametrize(("field", "value"), [("prefill_tp", 0), ("decode_tp", 10**30), ("decode_block_size", -1)])
def test_an_impossible_count_in_cell_json_fails_the_cell_naming_the_field(
    tmp_path: Path, capsys, field: str, value: int
) -> None:
    """Found by the property test above in CI: a 0 TP reached tp_ratio (ZeroDivisionError) and a
    10**30 one range() (OverflowError, exit 3) or kept it looping. Now the cell fails, naming the field and its bound."""
    run = write_run(tmp_path, "run", [case(CELL), case(CELL.reference())])
    path = run / CELL.id / "cell.json"
    data = json.loads(path.read_text())
    data["cell"][field] = value
    path.write_text(json.dumps(data))
    assert main(["gate", str(run)]) == 1
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    assert f"{CELL.id}/cell.json: cell is not a complete cell record: {field}: Input should be" in out.out


# ---------------------------------------------------------------- 10. outputs
@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return write_run(tmp_path, "run", [case(CELL), case(CELL.reference())])


def test_junit_and_summary_on_one_file_are_refused(run_dir: Path, tmp_path: Path, capsys) -> None:
    f = tmp_path / "out.txt"
    assert main(["gate", str(run_dir), "--junit", str(f), "--summary", str(f)]) == 2
    assert "--summary" in capsys.readouterr().err and not f.exists()


def test_read_only_output_dir_is_named_before_gating(run_dir: Path, tmp_path: Path, capsys) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        if __import__("os").access(ro, __import__("os").W_OK):
            pytest.skip("running as a user who can write anywhere")
        assert main(["gate", str(run_dir), "--junit", str(ro / "j.xml")]) == 2
        err = capsys.readouterr().err
        assert f"{ro / 'j.xml'}: cannot write" in err and ".tmp" not in err
    finally:
        ro.chmod(0o755)


def test_output_below_a_file_is_named_before_gating(run_dir: Path, tmp_path: Path, capsys) -> None:
    (tmp_path / "file").write_text("x")
    assert main(["gate", str(run_dir), "--summary", str(tmp_path / "file" / "s.md")]) == 2
    err = capsys.readouterr().err
    assert f"error: {tmp_path / 'file' / 's.md'}: cannot write: {tmp_path / 'file'} is not a writable directory" in err
    assert not (run_dir / "junit.xml").exists()  # nothing was written before the check


def test_write_failure_still_prints_the_verdict(run_dir: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    import pdsweep.results.layout

    def fail(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pdsweep.results.layout.os, "replace", fail)
    assert main(["gate", str(run_dir), "--junit", str(tmp_path / "j.xml"), "--summary", str(tmp_path / "s.md")]) == 2
    err = capsys.readouterr().err
    assert "gate: PASSED: 2 PASS" in err and "No space left" in err


def test_a_failed_report_leaves_nothing_half_written(run_dir: Path, tmp_path: Path, monkeypatch) -> None:
    import pdsweep.report.html

    out = tmp_path / "report"
    out.mkdir()

    def fail(*a, **k):
        raise RuntimeError("html failed")

    monkeypatch.setattr(pdsweep.report.html, "_html", fail)
    with pytest.raises(RuntimeError):
        pdsweep.report.html.write_report(run_dir, out)
    assert list(out.iterdir()) == []
    monkeypatch.undo()
    made = pdsweep.report.html.write_report(run_dir, out)
    assert made["markdown"] == out / "report.md" and made["html"].exists()
    assert sorted(p.name for p in out.iterdir()) == ["plots", "report.html", "report.md"]


# ---------------------------------------------------------------- 8. matrix semantics
MATRIX = "name: x\nplatform: cpu\nmatrix:\n  model: [tiny-llama, tiny-mla]\n  tp: [p1d1]\n  block_size: [32]\n"


@pytest.mark.parametrize(
    "entry, why",
    [
        ("{model: tiny-llama, tp: p1d1, prefill_tp: 2}", "include[0]: give 'tp' or 'prefill_tp'/'decode_tp', not both"),
        ("{model: tiny-llama, block_size: 32, decode_block_size: 64}", "include[0]: give 'block_size' or"),
        (
            "{model: tiny-llama, reason: flaky}",
            "include[0]: 'reason' explains an expected failure: it needs 'expect: fail'",
        ),
        ("{model: tiny-llama, ref: 'vllm#1'}", "include[0]: 'ref' explains an expected failure"),
    ],
)
def test_conflicting_include_entries_are_errors(tmp_path: Path, capsys, entry: str, why: str) -> None:
    assert why in bad(tmp_path, MATRIX + f"  include:\n    - {entry}\n", capsys)


def test_include_that_replaces_axis_cells_is_an_error(tmp_path: Path, capsys) -> None:
    msg = bad(tmp_path, MATRIX + "  include:\n    - {model: tiny-llama, num_decode: 2}\n", capsys)
    assert "matrix.include[0] sets num_decode (not an axis) on 1 product combination(s)" in msg
    assert "make num_decode an axis" in msg


def test_include_that_adds_a_cell_or_an_expectation_is_fine(tmp_path: Path, capsys) -> None:
    body = MATRIX + (
        "  include:\n    - {model: tiny-mla, tp: p1d1, expect: fail, reason: known, match: x}\n"
        "    - {model: tiny-nemotron-h, tp: p1d1, block_size: 64}\n"
    )
    assert "valid: 3 PD cells" in good(tmp_path, body, capsys)


def test_exclude_matching_nothing_warns(tmp_path: Path, capsys) -> None:
    p = write(tmp_path, MATRIX + "  exclude:\n    - {model: tiny-llama, tp: p2d1}\n")
    assert main(["validate", str(p)]) == 0
    assert "matrix.exclude[0] {'model': 'tiny-llama', 'tp': 'p2d1'} matches no combination" in capsys.readouterr().err


@given(
    st.sampled_from(["tiny-llama", "tiny-mla", "tiny-qwen3-next"]),
    st.sampled_from(
        [("num_decode", 2), ("decode_dp", 2), ("kv_buffer_device", "cpu"), ("serve_args", "base"), ("expect", "fail")]
    ),
)
@settings(max_examples=15, deadline=None, suppress_health_check=HC)
def test_property_an_include_never_silently_replaces_a_cell(tmp_path: Path, model: str, kv: tuple) -> None:
    """Either the include's cell-defining keys leave every product cell in the plan (added or
    extended with an expectation), or validate refuses it."""
    key, value = kv
    extra = ", reason: r, match: any" if key == "expect" else ""
    body = MATRIX + f"  include:\n    - {{model: {model}, {key}: {value}{extra}}}\n"
    root = Path(tempfile.mkdtemp(dir=tmp_path))
    plan = expand(load_sweep(write(root, body)))
    product = {f"{m}.p1d1.b32-32.fixed" for m in ("tiny-llama", "tiny-mla")}
    ids = {c.id for c in plan.cells} | {r.cell.id for r in plan.rejected}
    try:
        feasibility_warnings(plan, tasks=False)
    except UserError as e:
        assert "replaces those cells" in str(e) and not product <= ids
    else:
        assert product <= ids


def test_report_into_a_new_directory_and_below_a_file(run_dir: Path, tmp_path: Path, capsys) -> None:
    assert main(["report", str(run_dir), "--out", str(tmp_path / "new" / "dir")]) == 0
    assert (tmp_path / "new" / "dir" / "report.html").exists()
    (tmp_path / "file").write_text("x")
    assert main(["report", str(run_dir), "--out", str(tmp_path / "file" / "r")]) == 2
    assert "is not a writable directory" in capsys.readouterr().err
