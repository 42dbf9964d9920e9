"""sweeps/upstream-config-sweep.yaml covers every configuration of vLLM's nixl_integration
scripts (config_sweep_accuracy_test.sh, the Qwen3.5 MTP config, run_glm5next_pd_test.sh,
run_mamba_prefix_cache_test.sh), as extracted in tests/fixtures/upstream/nixl_integration.yaml."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from pdsweep.plan.blocks import flag
from pdsweep.plan.expand import expand
from pdsweep.plan.instance import Slot, instances, model_path
from pdsweep.sweepfile.sweep import load_sweep

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "upstream" / "nixl_integration.yaml"
SWEEP = REPO / "sweeps" / "upstream-config-sweep.yaml"


def pairs(args: list[str]) -> list[tuple[str, str | None]]:
    """``[--a, 1, --b, --c, x]`` -> ``[(--a, 1), (--b, None), (--c, x)]``."""
    out: list[tuple[str, str | None]] = []
    for a in args:
        if a.startswith("--"):
            out.append((a, None))
        elif out and out[-1][1] is None:
            out[-1] = (out[-1][0], a)
        else:
            raise ValueError(f"value {a!r} without a flag in {args}")
    return out


def requirements(fixture: dict) -> list[dict]:
    """One requirement per upstream configuration: model (hf id), prefill/decode TP, decode
    DP, ``vllm serve`` flags (value None: a switch), env, speculative method; ``where`` names it."""
    out = []
    for script, spec in fixture["scripts"].items():
        defaults = spec.get("defaults", {})
        for array, configs in spec.get("arrays", {}).items():
            for i, line in enumerate(configs):
                env = {**defaults, **dict(kv.split("=", 1) for kv in line.split())}
                p, d = int(env.get("PREFILLER_TP_SIZE", 1)), int(env.get("DECODER_TP_SIZE", 1))
                dp = 1
                if env.get("DP_EP"):  # decode as DP=DECODER_TP_SIZE + EP, TP 1
                    dp, d = d, 1
                args = env["VLLM_SERVE_EXTRA_ARGS"].split(",") if env.get("VLLM_SERVE_EXTRA_ARGS") else []
                if "GPU_MEMORY_UTILIZATION" in env:
                    args += ["--gpu-memory-utilization", env["GPU_MEMORY_UTILIZATION"]]
                out.append(
                    dict(
                        sweep=spec.get("sweep", SWEEP.name),
                        where=f"{script} {array}[{i}]: {line}",
                        model=env["MODEL_NAMES"],
                        tp=(p, d),
                        dp=dp,
                        flags=pairs(args),
                        env={k: v for k, v in env.items() if k.startswith("VLLM_") and k != "VLLM_SERVE_EXTRA_ARGS"},
                        spec=(env["SD_METHOD"], int(env["NUM_SPEC_TOKENS"])) if "SD_METHOD" in env else None,
                    )
                )
        if "serve" in spec:
            s = spec["serve"]
            sub = spec.get("substitutes", {})  # flag -> {upstream value: value the pinned vLLM takes}
            p, d = map(int, s["tp"][1:].split("d"))
            out.append(
                dict(
                    sweep=spec.get("sweep", SWEEP.name),
                    where=f"{script}: vllm serve {s['model']}",
                    model=s["model"],
                    tp=(p, d),
                    dp=1,
                    flags=[(f, sub.get(f, {}).get(v, v)) for f, v in pairs(s["args"])],
                    env=s.get("env", {}),
                    spec=None,
                )
            )
    return out


def _speculative(argv: list[str]) -> tuple[str, int] | None:
    v = flag(argv, "--speculative-config")
    if v is None:
        return None
    d = json.loads(v)
    return d.get("method"), d.get("num_speculative_tokens")


def covers(specs, req: dict) -> bool:
    """Every instance of the cell serves with the required flags (argparse: the last value
    wins; ``--block-size`` is pdsweep's axis), env and speculative method."""
    for s in specs:
        argv = list(s.argv)
        for name, value in req["flags"]:
            if value is None:
                if name not in argv:
                    return False
            elif flag(argv, name) != value:
                return False
        # pdsweep derives VLLM_KV_CACHE_LAYOUT per role (HND on decode; pdsweep.plan.instance.derived_env)
        env = {k: v for k, v in req["env"].items() if k != "VLLM_KV_CACHE_LAYOUT" or s.name.startswith("decode")}
        if any(s.env.get(k) != v for k, v in env.items()):
            return False
        if req["spec"] and _speculative(argv) != req["spec"]:
            return False
    return True


def uncovered(sweep_path: Path) -> list[str]:
    """``where`` of each upstream configuration assigned to ``sweep_path``'s name that no PD cell covers."""
    fixture = yaml.safe_load(FIXTURE.read_text())
    ls = load_sweep(sweep_path)
    plan = expand(ls)
    by_hf = {m.hf_id: name for name, m in ls.catalogue.models.items() if m.hf_id}
    cells = []
    for c in plan.pd_cells:
        m = ls.catalogue.models[c.model]
        slot = Slot(0, tuple(range(c.num_gpus)), ls.sweep.defaults.port_base)
        cells.append((c, instances(c, slot, ls, model_path(m, c.model), "python")))
    missing = []
    for req in requirements(fixture):
        if req["sweep"] != sweep_path.name:
            continue
        name = by_hf.get(req["model"])
        ok = name is not None and any(
            c.model == name
            and (c.prefill_tp, c.decode_tp) == req["tp"]
            and c.decode_dp == req["dp"]
            and covers(sp, req)
            for c, sp in cells
        )
        if not ok:
            missing.append(req["where"])
    return missing


def test_fixture_parses_every_upstream_configuration():
    reqs = requirements(yaml.safe_load(FIXTURE.read_text()))
    assert len(reqs) == 6 + 2 + 5 + 4 + 1 + 2
    dp = next(r for r in reqs if "dp_ep_configs[1]" in r["where"])
    assert (dp["model"], dp["tp"], dp["dp"]) == ("deepseek-ai/deepseek-vl2-tiny", (2, 1), 2)
    granite = next(r for r in reqs if "hybrid_ssm_configs[1]" in r["where"])
    assert ("--max-model-len", "8192") in granite["flags"] and ("--trust-remote-code", None) in granite["flags"]
    assert granite["env"] == {"VLLM_SSM_CONV_STATE_LAYOUT": "DS"}
    mamba = next(r for r in reqs if r["where"].startswith("run_mamba_prefix_cache_test.sh"))
    assert ("--mamba-cache-mode", "align") in mamba["flags"] and ("--block-size", "128") in mamba["flags"]


def test_upstream_config_sweep_covers_every_upstream_configuration():
    assert uncovered(SWEEP) == []
    assert uncovered(SWEEP.parent / "hybrid-mla-mamba.yaml") == []  # run_glm5next_pd_test.sh


def test_coverage_check_names_a_configuration_the_sweep_drops(tmp_path):
    text = SWEEP.read_text()
    line = "    - {model: gemma-3-4b-it, tp: p2d1, serve_args: len8k}\n"
    assert line in text
    (tmp_path / "models.yaml").write_text((SWEEP.parent / "models.yaml").read_text())
    (tmp_path / SWEEP.name).write_text(text.replace(line, ""))
    assert uncovered(tmp_path / SWEEP.name) == [
        "config_sweep_accuracy_test.sh sw_attn_configs[2]: GPU_MEMORY_UTILIZATION=0.8 "
        "MODEL_NAMES=google/gemma-3-4b-it PREFILLER_TP_SIZE=2 DECODER_TP_SIZE=1 VLLM_SERVE_EXTRA_ARGS=--max-model-len,8192"
    ]


def test_hybrid_scripts_have_their_cells(tmp_path):
    reqs = requirements(yaml.safe_load(FIXTURE.read_text()))
    assert {r["sweep"] for r in reqs if r["where"].startswith("run_glm5next")} == {"hybrid-mla-mamba.yaml"}
    mission = (SWEEP.parent / "hybrid-mla-mamba.yaml").read_text()
    line = "    - {model: glm-5.3-flash-4l, tp: p1d1, prefill_block_size: 128, decode_block_size: 128, build: fixed, serve_args: glm5next}\n"
    assert line in mission
    (tmp_path / "models.yaml").write_text((SWEEP.parent / "models.yaml").read_text())
    (tmp_path / "hybrid-mla-mamba.yaml").write_text(mission.replace(line, ""))
    assert uncovered(tmp_path / "hybrid-mla-mamba.yaml") == [
        "run_glm5next_pd_test.sh: vllm serve JaredforReal/GLM-5.3-Flash-4L"
    ]
