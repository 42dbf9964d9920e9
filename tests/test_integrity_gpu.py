"""KV integrity on GPU sweeps (issue 58, Want 5): opt-in per sweep with a sampled fraction of requests
(``integrity: {gpu, gpu_sample}``), sampled-out requests counted apart, the digest and fraction recorded
in transfer.json ``integrity``, and the default fraction's TTFT estimate (pdsweep.core.kvsample)."""

from __future__ import annotations

from pathlib import Path

from test_integrity import P0, P1, fixed_reads, landed, offer

from pdsweep.cli import main
from pdsweep.core import kvsample
from pdsweep.core.kvintegrity import integrity, integrity_reasons
from pdsweep.core.kvlines import TORCH_DIGEST_NAME
from pdsweep.plan.expand import expand
from pdsweep.plan.instance import Slot, instances
from pdsweep.sweepfile.integrityspec import IntegritySpec
from pdsweep.sweepfile.sweep import load_sweep

REPO = Path(__file__).resolve().parents[1]


def pd_envs(spec: IntegritySpec | None) -> list[dict[str, str]]:
    """The env of every instance of the first PD cell of the GPU mission sweep, with ``integrity: spec``."""
    ls = load_sweep(REPO / "sweeps" / "hybrid-mla-mamba.yaml")
    if spec is not None:
        ls = ls.model_copy(update={"sweep": ls.sweep.model_copy(update={"integrity": spec})})
    cell = next(c for c in expand(ls).cells if c.kind == "pd")
    return [s.env for s in instances(cell, Slot(0, tuple(range(8)), 20000), ls, "/m", "python")]


def test_gpu_sweeps_digest_only_when_they_opt_in_and_then_a_sampled_fraction():
    assert all("PDSWEEP_KV_DIGEST" not in e for e in pd_envs(None))  # the default: off on GPU
    on = pd_envs(IntegritySpec(gpu=True))
    assert [(e["PDSWEEP_KV_DIGEST"], e[kvsample.SAMPLE_ENV_VAR]) for e in on] == [("1", "0.25")] * len(on)
    tenth = pd_envs(IntegritySpec(gpu=True, gpu_sample=0.1))
    assert {e[kvsample.SAMPLE_ENV_VAR] for e in tenth} == {"0.1"}


def test_a_sample_outside_0_to_1_is_bad_input_naming_file_field_and_range(tmp_path: Path, capsys) -> None:
    path = tmp_path / "s.yaml"
    for bad in ("1.5", "0", "-0.1"):
        path.write_text(
            f"name: s\nplatform: cuda\nmodels_file: {REPO / 'sweeps' / 'models.yaml'}\n"
            f"integrity: {{gpu: true, gpu_sample: {bad}}}\nmatrix: {{model: [kimi-linear], tp: [p2d1]}}\n"
        )
        assert main(["validate", str(path), "--no-check-argv"]) == 2
        err = capsys.readouterr().err
        want = (
            f"{path}:4: integrity.gpu_sample: {float(bad):g} is no fraction of requests (allowed: 0 < gpu_sample <= 1)"
        )
        assert want in err and "Traceback" not in err, err


def sampled_out_reqs(fraction: float, n: int = 200) -> list[str]:
    return [f"cmpl-{i}-0" for i in range(n) if not kvsample.sampled(f"cmpl-{i}-0", fraction)]


def test_both_sides_agree_which_requests_are_sampled_and_the_fraction_holds():
    out = sampled_out_reqs(0.25, 4000)
    assert 2900 < len(out) < 3100  # ~75 % left out at 0.25
    assert sampled_out_reqs(1.0) == [] and kvsample.parse_fraction(None) == 1.0


def test_sampled_out_requests_are_counted_apart_and_the_rest_compared():
    """r1 digested on both sides (torch, sample 0.25); r2 sampled out on both (no digests): compared
    are r1's blocks only, r2 is ``sampled_out``, the digest and fraction are recorded."""
    tag = f" impl={TORCH_DIGEST_NAME} sample=0.25"
    p = (offer("p0", 0, "r1", P0) + offer("p1", 1, "r1", P1)).replace(" d=", tag + " d=")
    p += offer("p0", 0, "r2", []).replace(" d=", tag + " sampled_out=1 d=")
    d = fixed_reads().replace(" d=", f" impl={TORCH_DIGEST_NAME} d=") + landed("p0", "r2", [], state="SAMPLED_OUT")
    got = integrity(p, d)
    assert (got["compared"], got["matched"], got["sampled_out"], got["unread_requests"]) == (6, 6, 1, 0)
    assert (got["impl"], got["sample"], got["requests"]) == ([TORCH_DIGEST_NAME], 0.25, 1)
    assert integrity_reasons(got, "c/transfer.json") == []


def test_every_request_sampled_out_is_not_measured_and_fails_closed():
    p = offer("p0", 0, "r2", []).replace(" d=", " impl=wsum-128 sample=0.1 sampled_out=1 d=")
    got = integrity(p, landed("p0", "r2", [], state="SAMPLED_OUT"))
    assert got["sampled_out"] == 1
    assert integrity_reasons(got, "c/transfer.json") == [
        "c/transfer.json: integrity: not measured (all 1 request(s) sampled out (sample 0.1; allowed: one digested))"
    ]


def test_the_default_gpu_sample_keeps_the_estimated_added_ttft_under_2_percent():
    share = kvsample.ttft_share(kvsample.DEFAULT_GPU_SAMPLE, kvsample.ESTIMATED_DIGEST_GBPS)
    assert round(share, 4) == 0.0125 and share < kvsample.TTFT_SHARE_TARGET
    assert round(kvsample.fraction_for(kvsample.ESTIMATED_DIGEST_GBPS), 4) == 0.4
    assert kvsample.fraction_for(1000.0) == 1.0  # a fast device digests every request
