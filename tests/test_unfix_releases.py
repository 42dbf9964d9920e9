"""pdsweep.builds.unfix against the NIXL files of every official vLLM release it supports
(tests/fixtures/vllm_releases/: the files as shipped in the PyPI wheels, hashes in
SOURCES.json). The expected conditions are read with ``ast`` from the files themselves
and compared with v0.26.0, the last release before PR #49297."""

from __future__ import annotations

import ast
import difflib
import hashlib
import json
import shutil
from pathlib import Path

import pytest

from pdsweep.builds import unfix
from pdsweep.core.errors import UserError

RELEASES_DIR = Path(__file__).parent / "fixtures" / "vllm_releases"
SOURCES = json.loads((RELEASES_DIR / "SOURCES.json").read_text())
FIXED = [v for v, s in unfix.RELEASES.items() if unfix.SHAPES[s].edits]
PRE_FIX = "0.26.0"
PUSH_WORKER = f"{unfix.NIXL_DIR}/push_worker.py"


@pytest.fixture
def site(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A copy of one release's fixture files (``request.param`` = version) as site-packages."""
    out = tmp_path / "site-packages"
    shutil.copytree(RELEASES_DIR / request.param, out, symlinks=False)
    return out


def _fn(tree: ast.Module, name: str) -> ast.FunctionDef:
    return next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)


def _ifs(fn: ast.FunctionDef) -> list[ast.If]:
    return [n for n in ast.walk(fn) if isinstance(n, ast.If)]


def pull_conditions(text: str) -> dict[str, str]:
    """The three conditions of ``_read_blocks_for_req`` PR #49297 changed, unparsed:
    the single-read assert's guard, the split-handle branch, the notify-others branch."""
    fn = _fn(ast.parse(text), "_read_blocks_for_req")
    out = {}
    for node in _ifs(fn):
        src = ast.unparse(node.test)
        body = ast.unparse(node.body[0])
        if body == "assert len(read_specs) == 1":
            out["assert"] = src
        elif "src_xfer_handles_by_tp_ratio" in ast.unparse(node.body) and "tp_ratio < 0" in src:
            out["split"] = src
        elif "send_notif" in ast.unparse(node.body) and "use_mla" in src:
            out["notify"] = src
    assert set(out) == {"assert", "split", "notify"}, out
    return out


def base_split_condition(text: str) -> str:
    """base_worker's condition for building per-source split handles: the return of
    ``_needs_split_local_xfer_handles`` (v0.29.0 on) or the ``if`` in ``add_remote_agent``."""
    tree = ast.parse(text)
    try:
        ret = next(n for n in ast.walk(_fn(tree, "_needs_split_local_xfer_handles")) if isinstance(n, ast.Return))
        return ast.unparse(ret.value)
    except StopIteration:
        pass
    ifs = [
        n
        for n in _ifs(_fn(tree, "add_remote_agent"))
        if "not in self.src_xfer_handles_by_tp_ratio" in ast.unparse(n.test)
    ]
    assert len(ifs) == 1
    return ast.unparse(ifs[0].test)


def _read(site: Path, rel: str) -> str:
    return (site / rel).read_text(encoding="utf-8")


PRE = pull_conditions(_read(RELEASES_DIR / PRE_FIX, unfix.PULL_WORKER))


def test_prefix_release_conditions_are_what_the_edits_restore() -> None:
    assert PRE == {
        "assert": "self.use_mla and tp_ratio < 0",
        "split": "tp_ratio < 0 and (not self.use_mla)",
        "notify": "self.use_mla and tp_ratio < 0 and read_specs",
    }
    assert base_split_condition(_read(RELEASES_DIR / PRE_FIX, unfix.BASE_WORKER)) == (
        "tp_ratio < 0 and (not self.use_mla) and (tp_ratio not in self.src_xfer_handles_by_tp_ratio)"
    )


def test_fixtures_are_the_released_files() -> None:
    """Every release in RELEASES has fixtures, byte-identical to its wheel's RECORD hashes."""
    assert sorted(SOURCES) == sorted(unfix.RELEASES)
    for version, src in SOURCES.items():
        assert src["wheel"].startswith(f"vllm-{version}-")
        for rel, sha in src["files"].items():
            path = RELEASES_DIR / version / rel
            assert hashlib.sha256(path.read_bytes()).hexdigest() == sha, path
        assert {unfix.PULL_WORKER, unfix.BASE_WORKER} <= set(src["files"])


@pytest.mark.parametrize("site", FIXED, indirect=True, ids=FIXED)
def test_unfix_restores_prefix_conditions(site: Path, request: pytest.FixtureRequest) -> None:
    version = request.node.callspec.params["site"]
    before = {rel: _read(site, rel) for rel in unfix.PATCHED_FILES}
    fixed = pull_conditions(before[unfix.PULL_WORKER])
    dcp = "dcp_active" in before[unfix.PULL_WORKER]  # v0.29.0 on: DCP kept out of the assert
    assert fixed == {
        "assert": "self.use_mla and tp_ratio < 0 and (not self._has_mamba)"  # the fix is present
        + (" and (not dcp_active)" if dcp else ""),
        "split": "tp_ratio < 0 and (not self.use_mla or len(read_specs) > 1)",
        "notify": "self.use_mla and tp_ratio < 0 and (len(read_specs) == 1)",
    }
    assert "len(plan.all_source_ranks) > 1" in base_split_condition(before[unfix.BASE_WORKER])

    shas = unfix.apply_unfix(site, version)

    after = {rel: _read(site, rel) for rel in unfix.PATCHED_FILES}
    assert shas == {rel: hashlib.sha256(t.encode()).hexdigest() for rel, t in after.items()}
    got = pull_conditions(after[unfix.PULL_WORKER])
    assert got == {**PRE, "assert": PRE["assert"] + (" and (not dcp_active)" if dcp else "")}
    base = base_split_condition(after[unfix.BASE_WORKER])
    assert base.startswith("tp_ratio < 0 and (not self.use_mla)") and "all_source_ranks" not in base
    for rel, text in after.items():
        compile(text, rel, "exec")
    # Exactly the edited lines changed, each inside the function it belongs to.
    changed = {
        rel: [d for d in difflib.ndiff(before[rel].splitlines(), after[rel].splitlines()) if d[0] in "+-"]
        for rel in unfix.PATCHED_FILES
    }
    assert len(changed[unfix.PULL_WORKER]) == 6 and len(changed[unfix.BASE_WORKER]) == 2


@pytest.mark.parametrize("site", FIXED, indirect=True, ids=FIXED)
def test_edits_land_in_the_intended_functions(site: Path, request: pytest.FixtureRequest) -> None:
    version = request.node.callspec.params["site"]
    before = {rel: _read(site, rel).splitlines() for rel in unfix.PATCHED_FILES}
    unfix.apply_unfix(site, version)
    for rel, where in (
        (unfix.PULL_WORKER, {"_read_blocks_for_req"}),
        (unfix.BASE_WORKER, {"add_remote_agent", "_needs_split_local_xfer_handles"}),
    ):
        after = _read(site, rel)
        lines = [i + 1 for i, (a, b) in enumerate(zip(before[rel], after.splitlines())) if a != b]
        fns = [n for n in ast.walk(ast.parse(after)) if isinstance(n, ast.FunctionDef)]
        owners = {
            min((f for f in fns if f.lineno <= ln <= f.end_lineno), key=lambda f: f.end_lineno - f.lineno).name
            for ln in lines
        }
        assert lines and owners <= where, (rel, owners)


def test_prefix_release_is_the_baseline_as_is(tmp_path: Path) -> None:
    site = tmp_path / "site-packages"
    shutil.copytree(RELEASES_DIR / PRE_FIX, site)
    before = {rel: _read(site, rel) for rel in unfix.PATCHED_FILES}
    assert unfix.is_pre_fix(PRE_FIX) and unfix.plan_unfix(site, PRE_FIX) == []
    assert unfix.apply_unfix(site, PRE_FIX) == {}
    assert {rel: _read(site, rel) for rel in unfix.PATCHED_FILES} == before
    assert not any(unfix.is_pre_fix(v) for v in FIXED)


@pytest.mark.parametrize("version", FIXED)
def test_fixed_release_claimed_as_prefix_is_refused(tmp_path: Path, version: str) -> None:
    site = tmp_path / "site-packages"
    shutil.copytree(RELEASES_DIR / version, site)
    with pytest.raises(UserError, match=r"cannot unfix vLLM 0\.26\.0 predates PR #49297, but its files lack"):
        unfix.plan_unfix(site, PRE_FIX)


@pytest.mark.parametrize(("files", "claimed"), [("0.27.0", "0.32.0"), ("0.33.0", "0.28.0"), (PRE_FIX, "0.29.0")])
def test_wrong_shape_is_refused_and_nothing_written(tmp_path: Path, files: str, claimed: str) -> None:
    site = tmp_path / "site-packages"
    shutil.copytree(RELEASES_DIR / files, site)
    before = {rel: _read(site, rel) for rel in unfix.PATCHED_FILES}
    with pytest.raises(UserError) as exc:
        unfix.apply_unfix(site, claimed)
    msg = str(exc.value)
    assert f"cannot unfix vLLM {claimed}" in msg and "nothing was written" in msg and "expected text not found" in msg
    assert f"code shape '{unfix.RELEASES[claimed]}'" in msg
    assert {rel: _read(site, rel) for rel in unfix.PATCHED_FILES} == before


@pytest.mark.parametrize("site", FIXED, indirect=True, ids=FIXED)
@pytest.mark.parametrize("k", range(4))
def test_each_missing_line_is_named(site: Path, request: pytest.FixtureRequest, k: int) -> None:
    version = request.node.callspec.params["site"]
    edit = unfix.EDITS[version][k]
    first = next(ln for ln in edit.old.splitlines() if "use_mla" in ln)
    path = site / edit.file
    path.write_text(path.read_text().replace(first, first.replace("self.use_mla", "self.is_mla")))
    before = {rel: _read(site, rel) for rel in unfix.PATCHED_FILES}
    with pytest.raises(UserError) as exc:
        unfix.apply_unfix(site, version)
    msg = str(exc.value)
    assert Path(edit.file).name in msg and first.strip() in msg and f"vLLM {version}" in msg
    assert msg.count("expected text") == 1
    assert {rel: _read(site, rel) for rel in unfix.PATCHED_FILES} == before


@pytest.mark.parametrize("site", FIXED, indirect=True, ids=FIXED)
def test_second_unfix_is_refused(site: Path, request: pytest.FixtureRequest) -> None:
    version = request.node.callspec.params["site"]
    unfix.apply_unfix(site, version)
    with pytest.raises(UserError, match=r"already unfixed\?"):
        unfix.plan_unfix(site, version)


@pytest.mark.parametrize(
    ("files", "version", "shape"),
    [
        ("0.34.0", "0.34.1.dev12+gabc", "fix-dcp"),  # a nightly of the newest release's shape
        ("0.33.0", "0.99.0+cpu", "fix-dcp"),
        ("0.28.0", "0.28.1rc1", "fix-inline"),
        (PRE_FIX, "0.25.9", "pre-fix"),
    ],
)
def test_unlisted_version_is_matched_by_shape(tmp_path: Path, files: str, version: str, shape: str) -> None:
    """A version outside RELEASES (nightly, source tree) gets the baseline of the one shape
    its files match, with a provenance line saying so."""
    site = tmp_path / "site-packages"
    shutil.copytree(RELEASES_DIR / files, site)
    assert unfix.version_key(version) not in unfix.RELEASES
    res = unfix.resolve(site, version)
    assert (res.shape.name, res.matched_by, res.location.package) == (shape, "shape", unfix.NIXL_PACKAGES[0])
    assert res.provenance.startswith(f"vLLM {version}: matched by shape '{shape}' (not a tested release")
    unfix.apply_unfix(site, version)
    got = pull_conditions(_read(site, unfix.PULL_WORKER))
    dcp = shape == "fix-dcp"
    assert got == {**PRE, "assert": PRE["assert"] + (" and (not dcp_active)" if dcp else "")}
    assert "all_source_ranks" not in base_split_condition(_read(site, unfix.BASE_WORKER))


def test_listed_release_says_release_list(tmp_path: Path) -> None:
    site = tmp_path / "site-packages"
    shutil.copytree(RELEASES_DIR / "0.34.0", site)
    res = unfix.resolve(site, "0.34.0")
    assert (res.shape.name, res.matched_by) == ("fix-dcp", "release")
    assert res.provenance == f"vLLM 0.34.0: code shape 'fix-dcp' (release list), module {unfix.NIXL_PACKAGES[0]}"


MOVED = "vllm/backends/kv_transfer/kv_connector/v1/nixl"


def _moved_tree(tmp_path: Path, shims: bool = True) -> Path:
    """0.34.0's NIXL files under vllm/backends (vLLM RFC 54653), the old modules as shims."""
    site = tmp_path / "site-packages"
    for name in ("pull_worker", "base_worker", "push_worker"):
        src = RELEASES_DIR / "0.34.0" / unfix.NIXL_DIR / f"{name}.py"
        (site / MOVED).mkdir(parents=True, exist_ok=True)
        shutil.copy(src, site / MOVED / f"{name}.py")
        if shims:
            (site / unfix.NIXL_DIR).mkdir(parents=True, exist_ok=True)
            dotted = MOVED.replace("/", ".")
            shim = f"import sys\nimport {dotted}.{name} as _m\nsys.modules[__name__] = _m\n"
            (site / unfix.NIXL_DIR / f"{name}.py").write_text(shim)
    return site


@pytest.mark.parametrize("shims", [True, False], ids=["with-shims", "moved-only"])
def test_moved_to_backends_tree_is_found_by_module_lookup(tmp_path: Path, shims: bool) -> None:
    site = _moved_tree(tmp_path, shims)
    shim_before = {rel: _read(site, rel) for rel in unfix.PATCHED_FILES} if shims else {}
    res = unfix.resolve(site, "0.35.0.dev3+g123")
    assert res.location == unfix.Location(
        "vllm.backends.kv_transfer.kv_connector.v1.nixl", f"{MOVED}/pull_worker.py", f"{MOVED}/base_worker.py"
    )
    assert res.matched_by == "shape" and res.shape.name == "fix-dcp"
    shas = unfix.apply_unfix(site, "0.35.0.dev3+g123")
    assert set(shas) == {f"{MOVED}/pull_worker.py", f"{MOVED}/base_worker.py"}
    assert pull_conditions(_read(site, f"{MOVED}/pull_worker.py"))["split"] == PRE["split"]
    assert {rel: _read(site, rel) for rel in shim_before} == shim_before  # shims untouched


def test_changed_fix_lines_are_refused_naming_the_shapes_tried(tmp_path: Path) -> None:
    site = tmp_path / "site-packages"
    shutil.copytree(RELEASES_DIR / "0.34.0", site)
    path = site / unfix.PULL_WORKER
    path.write_text(path.read_text().replace("len(read_specs) > 1", "len(read_specs) >= 2"))
    before = {rel: _read(site, rel) for rel in unfix.PATCHED_FILES}
    with pytest.raises(UserError) as exc:
        unfix.apply_unfix(site, "0.34.1.dev12+gabc")
    msg = str(exc.value)
    assert "cannot unfix vLLM '0.34.1.dev12+gabc': not a tested release" in msg
    assert "no known code shape matches" in msg and "nothing was written" in msg
    for name in unfix.SHAPES:
        assert f"shape '{name}' in {unfix.NIXL_PACKAGES[0]}: first problem:" in msg
    assert "len(read_specs) > 1" in msg  # fix-dcp's first missing line is the changed one
    assert {rel: _read(site, rel) for rel in unfix.PATCHED_FILES} == before


def test_several_matching_shapes_are_refused(tmp_path: Path) -> None:
    site = _moved_tree(tmp_path, shims=False)
    shutil.copytree(RELEASES_DIR / "0.34.0" / "vllm", site / "vllm", dirs_exist_ok=True)  # both layouts, both fixed
    with pytest.raises(UserError, match=r"2 code shapes match \(must be exactly one\)") as exc:
        unfix.plan_unfix(site, "0.34.1.dev1")
    assert str(exc.value).count("all its lines found") == 2


def test_no_nixl_package_names_the_modules_tried(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no NIXL connector package") as exc:
        unfix.plan_unfix(tmp_path, "0.34.1.dev1")
    assert all(p in str(exc.value) for p in unfix.NIXL_PACKAGES)


@pytest.mark.parametrize("site", FIXED, indirect=True, ids=FIXED)
def test_push_worker_needs_the_split_handles_the_revert_removes(site: Path, request: pytest.FixtureRequest) -> None:
    """Why the plan rejects unfixed push cells at prefill TP < decode TP (rule unfixed-scope):
    push_worker.py is not edited and still indexes per-source split handles for MLA with several
    source ranks when prefill's (the local side's) tp_ratio < 0, which the unfixed base_worker
    never builds for MLA. At prefill TP >= decode TP that branch is not taken."""
    version = request.node.callspec.params["site"]
    fn = _fn(ast.parse(_read(site, PUSH_WORKER)), "_xfer_blocks_for_req")
    uses = [ast.unparse(n.test) for n in _ifs(fn) if "src_xfer_handles_by_tp_ratio" in ast.unparse(n.body)]
    assert uses == ["tp_ratio < 0 and (not self.use_mla or len(plan.all_source_ranks) > 1)"]
    unfix.apply_unfix(site, version)
    assert "use_mla or" not in base_split_condition(_read(site, unfix.BASE_WORKER))
    assert _read(site, PUSH_WORKER) == _read(RELEASES_DIR / version, PUSH_WORKER)  # not edited


@pytest.mark.parametrize("version", FIXED)
def test_dcp_pull_paths_postdate_the_fix(version: str) -> None:
    """Why the plan rejects unfixed DCP cells: NIXL's DCP handling (``dcp_active``) exists
    only from v0.29.0, after the fix, and the restored notify condition fires after the
    several reads DCP makes for pure MLA."""
    pull = _read(RELEASES_DIR / version, unfix.PULL_WORKER)
    assert ("dcp_active" in pull) == (unfix.RELEASES[version] == "fix-dcp")
    assert "dcp_active" not in _read(RELEASES_DIR / PRE_FIX, unfix.PULL_WORKER)
    assert "dcp" not in _read(RELEASES_DIR / PRE_FIX, unfix.BASE_WORKER)


def test_gpu_constraints_pin_a_release_the_unfix_table_knows() -> None:
    """constraints/gpu.txt (what `make install` installs on a GPU node) pins a vLLM release
    with an entry in unfix.RELEASES, NIXL files in the fixtures and a place in the gpu
    extra's range; bumping vLLM is that line plus a release here."""
    import re

    from packaging.specifiers import SpecifierSet

    repo = RELEASES_DIR.parents[2]
    pins = dict(re.findall(r"^([a-z0-9-]+)==(\S+)", (repo / "constraints" / "gpu.txt").read_text(), re.M))
    vllm = pins["vllm"]
    assert vllm in unfix.RELEASES and (RELEASES_DIR / vllm / unfix.NIXL_DIR).is_dir()
    spec = SpecifierSet(re.search(r'^gpu = \["vllm([^"]+)"', (repo / "pyproject.toml").read_text(), re.M)[1])
    assert vllm in spec and all(v in spec for v in unfix.RELEASES) and "0.34.1" not in spec
    assert pins["nixl-cu13"] == pins["nixl-cu12"]  # one NIXL version, the backend by CUDA major (device check: cu12)
    assert "nixl" not in pins  # the meta package: 1.5.2 needs backends PyPI lacks


@pytest.mark.parametrize("site", ["0.32.0"], indirect=True, ids=["0.32.0"])
def test_undo_of_one_edit_changes_only_its_condition(site: Path) -> None:
    """``--undo N`` (partially unfixed builds for ``pdsweep bisect``): only edit N's lines move."""
    before = pull_conditions(_read(site, unfix.PULL_WORKER))
    shas = unfix.apply_unfix(site, "0.32.0", undo=(2,))
    after = pull_conditions(_read(site, unfix.PULL_WORKER))
    assert set(shas) == {unfix.PULL_WORKER}  # base_worker (edit 4) untouched
    assert after == {**before, "split": PRE["split"]}
    with pytest.raises(unfix.UserError, match=r"--undo 5: allowed edit numbers 1..4, each once"):
        unfix.select_edits(unfix.shape_for("0.32.0"), (5,))
    with pytest.raises(unfix.UserError, match="predates PR #49297"):
        unfix.select_edits(unfix.SHAPES["pre-fix"], (1,))
