"""Every instance argv parsed with the installed vLLM's own CLI classes (pdsweep.builds.argcheck),
and the plan table in non-TTY output (CI logs)."""

from pathlib import Path

import pytest

from pdsweep.cli import main
from pdsweep.core.errors import UserError
from pdsweep.plan.expand import expand
from pdsweep.run.dryrun import check_cells_argv
from pdsweep.sweepfile.sweep import load_sweep

pytest.importorskip("vllm.entrypoints.launchers.cli_args")

REPO = Path(__file__).resolve().parent.parent
SWEEPS = REPO / "sweeps"


def _sweep(tmp_path, variant: str) -> Path:
    (tmp_path / "models.yaml").write_text((SWEEPS / "models.yaml").read_text())
    p = tmp_path / "gpu.yaml"
    p.write_text(f"""name: gpu
platform: cuda
serve_args:
  base: []
  bad: {variant}
matrix:
  model: [qwen3-0.6b]
  tp: [p2d1]
  block_size: [128]
  serve_args: [bad]
""")
    return p


@pytest.mark.parametrize(
    "variant,message",
    [
        (
            "{decode: [--block-sise, '16']}",
            "qwen3-0.6b.p2d1.b128-128.fixed.bad instance decode-0: vllm serve: error: unrecognized arguments: --block-sise 16",
        ),
        # (--kv-transfer-config in serve_args is refused earlier, by the spec: tests/test_sweepfile_guards.py)
        (
            "{prefill: [--enable-auto-tool-choice]}",
            "qwen3-0.6b.p2d1.b128-128.fixed.bad instance prefill-0: TypeError: Error: --enable-auto-tool-choice "
            "requires --tool-call-parser",
        ),
    ],
)
def test_validate_refuses_argv_vllm_refuses(tmp_path, capsys, variant, message):
    assert main(["validate", str(_sweep(tmp_path, variant))]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert main(["validate", str(_sweep(tmp_path, variant)), "--no-check-argv"]) == 0


def test_shipped_gpu_sweeps_parse_on_cpu():
    for name in ("hybrid-mla-mamba", "upstream-config-sweep"):
        ls = load_sweep(SWEEPS / f"{name}.yaml")
        check_cells_argv(ls, expand(ls).cells)  # raises UserError on any refusal


def test_check_argv_names_every_bad_instance(tmp_path):
    ls = load_sweep(_sweep(tmp_path, "[--dtype, bf17]"))
    with pytest.raises(UserError) as e:
        check_cells_argv(ls, expand(ls).cells)
    lines = str(e.value).splitlines()
    assert "vLLM refuses 3 instance argv(s)" in lines[0]  # prefill-0, decode-0 and the reference single-0
    assert all("argument --dtype: invalid choice: 'bf17'" in x for x in lines[1:])


def test_plan_table_keeps_whole_ids_when_not_a_tty(capsys):
    assert main(["plan", str(SWEEPS / "hybrid-mla-mamba.yaml"), "--gpus", "8", "--no-check-argv"]) == 0
    out = capsys.readouterr().out
    row = next(x for x in out.splitlines() if "deepseek-v2-lite-chat.p1d1.b64-128.fixed " in x)
    # vLLM's backend (sm90: FLASH_ATTN_MLA) and the effective logical/kernel blocks per role, on the cell's row
    assert "P FLASH_ATTN_MLA 64/64 D FLASH_ATTN_MLA 128/128" in row
    assert "Local: 30, Remote: 16. Disable prefix caching with --no-enable-prefix-caching." in out  # whole reason
