"""Sweep files: the top-level pydantic schema, YAML loading, clear errors (the model
catalogue's schema is :mod:`pdsweep.sweepfile.catalogue`; this module loads both). The sections'
schemas: :mod:`pdsweep.sweepfile.axes` (axes, bounds, faults), :mod:`pdsweep.sweepfile.matrix`,
:mod:`pdsweep.sweepfile.serve` (builds, serve_args, defaults), :mod:`pdsweep.sweepfile.phases` (eval,
bench), :mod:`pdsweep.sweepfile.gatespec` (gate), :mod:`pdsweep.sweepfile.integrityspec` (integrity).

A sweep YAML (``sweeps/*.yaml``) names a model catalogue (``sweeps/models.yaml`` by
default), vLLM builds, named serve-arg and env variants, a ``matrix`` with
GitHub-Actions semantics (axes, ``include``, ``exclude``), and the ``eval``, ``bench``
and ``gate`` sections used by later stages.

Every problem is raised as :class:`~pdsweep.core.errors.UserError` with
``FILE:LINE: field.path: message (allowed: ...)``; the line comes from pyyaml's node
marks for the offending field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pdsweep.core.errors import UserError
from pdsweep.sweepfile import guards
from pdsweep.sweepfile.axes import BOUND_OF, BOUND_WHY
from pdsweep.sweepfile.catalogue import Catalogue, ModelSpec, NixlSupport, Platform, PlatformSupport
from pdsweep.sweepfile.catalogue import Strict as _Strict
from pdsweep.sweepfile.gatespec import GateSpec
from pdsweep.sweepfile.integrityspec import IntegritySpec
from pdsweep.sweepfile.matrix import Matrix
from pdsweep.sweepfile.phases import BenchSpec, EvalSpec
from pdsweep.sweepfile.serve import BuildSpec, Defaults, ServeArgsVariant
from pdsweep.sweepfile.yamlfile import fmt_loc, line_of, read_yaml, resolve_model


class Sweep(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # results/<name>-<time>/
    description: str | None = None
    platform: Platform = "cuda"
    models_file: str = "models.yaml"
    # a maintainer's own models: catalogue files (same schema as models_file, relative to the
    # sweep) merged over it in order: an entry adds a model or replaces one of the same name,
    # platform_limits add up (load_sweep)
    models_overlay: list[str] = []
    builds: dict[str, BuildSpec] = {"fixed": BuildSpec()}
    defaults: Defaults = Defaults()
    serve_args: dict[str, ServeArgsVariant | list[str]] = {"base": []}
    env: dict[str, dict[str, str]] = {"base": {}}
    ucx: dict[str, str] = {}
    matrix: Matrix
    eval: EvalSpec = EvalSpec()
    bench: BenchSpec = BenchSpec()
    gate: GateSpec = GateSpec()
    integrity: IntegritySpec = IntegritySpec()  # KV digests on GPU: opt-in, sampled (pdsweep.sweepfile.integrityspec)
    # a PD cell in the scope of a fix its build lacks expects that fix's failure unless its include
    # entry declares an expectation (pdsweep.plan.derived); false: only declared expectations
    derive_expectations: bool = True
    # minutes the job running this sweep (or one --shard of it) may take: validate and `plan`
    # fail when the planned makespan exceeds it (pdsweep.plan.clock)
    budget: float | None = Field(default=None, gt=0, le=10080)

    def serve_variant(self, name: str) -> ServeArgsVariant:
        v = self.serve_args[name]
        return ServeArgsVariant(both=v) if isinstance(v, list) else v


_MODELS: dict[str, type[BaseModel]] = {}  # filled below: union-member tags in error locs


class LoadedSweep(BaseModel):
    """A validated sweep with its catalogue and where both came from."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)
    sweep: Sweep
    catalogue: Catalogue
    path: Path
    catalogue_path: Path


_MODELS.update({c.__name__: c for c in (ServeArgsVariant, BuildSpec, ModelSpec, PlatformSupport, NixlSupport)})


# ---------------------------------------------------------------- loading
def _validate(model: type[BaseModel], data: Any, path: Path, node: yaml.Node | None) -> Any:
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        lines = []
        errors = e.errors()
        # a union member (e.g. ServeArgsVariant | list[str]) shows up as a loc tag; when the
        # value was a mapping, the list branch's error is noise: keep the model branch's
        tagged = {tuple(x["loc"][:i]) for x in errors for i, k in enumerate(x["loc"]) if k in _MODELS}
        for err in errors:
            raw = tuple(err["loc"])
            if any(isinstance(k, str) and "[" in k and raw[:i] in tagged for i, k in enumerate(raw)):
                continue
            tag = next((_MODELS[k] for k in raw if k in _MODELS), None)
            loc = tuple(x for x in raw if not (isinstance(x, str) and x.startswith("function-")))
            # pydantic reports union members as extra loc parts ("list[str]", ...): drop them
            member = ("str", "int", "constrained-int")
            loc = tuple(x for x in loc if not (isinstance(x, str) and ("[" in x or x in member or x in _MODELS)))
            line = line_of(node, loc)
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                parent = tag or resolve_model(model, loc[:-1])
                allowed = ", ".join(parent.model_fields) if parent else "?"
                msg = f"unknown key '{loc[-1]}' (allowed: {allowed})"
            elif err["type"] == "literal_error":
                msg = f"{msg} (got {err.get('input')!r})"
            elif err["type"] in ("less_than_equal", "greater_than_equal", "greater_than", "less_than"):
                field = next((k for k in reversed(loc) if isinstance(k, str)), "")
                why = BOUND_WHY.get(BOUND_OF.get(field, ""))
                msg = f"{msg} (got {err.get('input')!r}{'; ' + why if why else ''})"
            lines.append(f"{path}:{line}: {fmt_loc(loc)}: {msg}")
        raise UserError("\n".join(dict.fromkeys(lines))) from None


def load_catalogue(path: str | Path) -> Catalogue:
    """Load and validate a model catalogue. Raises ``UserError``."""
    path = Path(path)
    data, node = read_yaml(path)
    cat = _validate(Catalogue, data, path, node)
    _raise_all(_guard_catalogue(cat, path, node))
    return cat


def load_sweep(path: str | Path) -> LoadedSweep:
    """Load a sweep YAML and its catalogue; check every name it refers to.

    Raises ``UserError`` naming file, line, field path and the allowed values.
    """
    path = Path(path)
    data, node = read_yaml(path)
    if isinstance(data, dict) and "models" in data and "matrix" not in data:
        raise UserError(
            f"{path}: a model catalogue (top-level 'models'), not a sweep: a sweep names it with "
            f"models_file; pass a sweep (name, matrix, ...), e.g. sweeps/cpu-smoke.yaml"
        )
    sweep: Sweep = _validate(Sweep, data, path, node)
    try:
        cat_path = (path.parent / sweep.models_file).resolve()
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop (pathlib before 3.13)
        raise UserError(f"{path}: models_file {sweep.models_file!r}: cannot resolve: {e}") from None
    catalogue = load_catalogue(cat_path)
    for extra in sweep.models_overlay:
        catalogue = merge_catalogue(catalogue, load_catalogue(_overlay_path(path, extra)), path)
    # every error of the file past its schema at once: names, guards, references, lengths
    _raise_all(
        _guard_sweep(sweep, path, node)
        + _name_errors(sweep, catalogue, path, node)
        + _reference_variant_errors(sweep, path, node)
        + _model_len_errors(sweep, catalogue, path, node)
    )
    return LoadedSweep(sweep=sweep, catalogue=catalogue, path=path, catalogue_path=cat_path)


def _overlay_path(sweep_path: Path, name: str) -> Path:
    p = (sweep_path.parent / name).resolve()
    if not p.is_file():
        raise UserError(f"{sweep_path}: models_overlay: {name!r}: no such file ({p})")
    return p


def merge_catalogue(base: Catalogue, overlay: Catalogue, sweep_path: Path) -> Catalogue:
    """``overlay``'s models over ``base``'s (a name in both: the overlay's entry, whole), their
    platform limits together; validated again (``tiny.weights_from`` across the two). Raises
    ``UserError`` naming the sweep when the merged catalogue is invalid."""
    try:
        return Catalogue(
            models={**base.models, **overlay.models}, platform_limits=[*base.platform_limits, *overlay.platform_limits]
        )
    except ValidationError as e:
        raise UserError(f"{sweep_path}: models_overlay: {e.errors()[0]['msg']}") from None


def _model_len_errors(sweep: Sweep, cat: Catalogue, path: Path, node: yaml.Node | None) -> list[str]:
    """``defaults.max_model_len`` above a tiny model's own length (its checkpoint's
    ``max_position_embeddings`` is the catalogue's ``max_model_len``, pdsweep.tiny.config):
    vLLM would refuse it at startup (``ValueError: User-specified max_model_len ... is greater
    than the derived max_model_len``, vllm/config/model.py)."""
    want = sweep.defaults.max_model_len
    if want is None:
        return []
    used = list(sweep.matrix.model) + [e["model"] for e in sweep.matrix.include if isinstance(e.get("model"), str)]
    out = []
    for name in dict.fromkeys(used):
        m = cat.models.get(name)
        if m is not None and m.tiny is not None and want > m.max_model_len:
            loc = ("defaults", "max_model_len")
            out.append(
                f"{path}:{line_of(node, loc)}: {fmt_loc(loc)}: {want} is above model '{name}''s "
                f"{m.max_model_len} tokens (its checkpoint's max_position_embeddings; allowed: 1..{m.max_model_len})"
            )
    return out


def _check_names(sweep: Sweep, cat: Catalogue, path: Path, node: yaml.Node | None) -> None:
    """Raises ``UserError`` with :func:`_name_errors`."""
    _raise_all(_name_errors(sweep, cat, path, node))


def _name_errors(sweep: Sweep, cat: Catalogue, path: Path, node: yaml.Node | None) -> list[str]:
    """Every model/build/serve_args/env name used in the matrix must exist."""
    known = {
        "model": list(cat.models),
        "build": list(sweep.builds),
        "serve_args": list(sweep.serve_args),
        "env": list(sweep.env),
    }
    errors = []

    def check(field: str, value: Any, loc: tuple[Any, ...]) -> None:
        if field in known and value not in known[field]:
            errors.append(
                f"{path}:{line_of(node, loc)}: {fmt_loc(loc)}: unknown {field} '{value}' "
                f"(allowed: {', '.join(known[field])})"
            )

    m = sweep.matrix
    for field in known:
        for i, v in enumerate(getattr(m, field) or []):
            check(field, v, ("matrix", field, i))
    for kind in ("include", "exclude"):
        for i, entry in enumerate(getattr(m, kind)):
            for field, v in entry.items():
                check(field, v, ("matrix", kind, i, field))
    d = sweep.defaults
    for field in ("build", "serve_args", "env"):
        check(field, getattr(d, field), ("defaults", field))
    return errors


# ---------------------------------------------------------------- safe names, derived flags (pdsweep.sweepfile.guards)
def _raise_all(errors: list[str]) -> None:
    if errors:
        raise UserError("\n".join(dict.fromkeys(errors)))


def _guard_catalogue(cat: Catalogue, path: Path, node: yaml.Node | None) -> list[str]:
    """Model names are safe; catalogue serve_args/env set no flag pdsweep derives."""
    out = []
    for name, m in cat.models.items():
        if why := guards.unsafe_name(name, model=True):
            out.append(f"{path}:{line_of(node, ('models', name))}: models: {why}")
        out += _flag_errors(m.serve_args, ("models", name, "serve_args"), path, node)
        for arch, args in m.serve_args_by_arch.items():
            out += _flag_errors(args, ("models", name, "serve_args_by_arch", arch), path, node)
        out += _env_errors(m.env, ("models", name, "env"), path, node)
    return out


def _guard_sweep(sweep: Sweep, path: Path, node: yaml.Node | None) -> list[str]:
    """Build/variant names are safe; serve_args/env/ucx variants set no flag or variable
    pdsweep derives from the cell's axes (:mod:`pdsweep.sweepfile.guards`)."""
    out = []
    for field in ("builds", "serve_args", "env"):
        for name in getattr(sweep, field):
            if why := guards.unsafe_name(name):
                out.append(f"{path}:{line_of(node, (field, name))}: {field}: {why}")
    for name, v in sweep.serve_args.items():
        if isinstance(v, list):
            out += _flag_errors(v, ("serve_args", name), path, node)
        else:
            for role in ("both", "prefill", "decode"):
                out += _flag_errors(getattr(v, role), ("serve_args", name, role), path, node)
    for name, env in sweep.env.items():
        out += _env_errors(env, ("env", name), path, node)
    out += _env_errors(sweep.ucx, ("ucx",), path, node)
    return out


def _flag_errors(args: list[str], loc: tuple[Any, ...], path: Path, node: yaml.Node | None) -> list[str]:
    return [
        f"{path}:{line_of(node, (*loc, i))}: {fmt_loc((*loc, i))}: {why}"
        for i, a in enumerate(args)
        if (why := guards.reserved_flag(a))
    ]


def _env_errors(env: dict[str, str], loc: tuple[Any, ...], path: Path, node: yaml.Node | None) -> list[str]:
    return [
        f"{path}:{line_of(node, (*loc, k))}: {fmt_loc((*loc, k))}: {why}"
        for k in env
        if (why := guards.reserved_env(k))
    ]


def check_reference_variants(sweep: Sweep, path: Path, node: yaml.Node | None) -> None:
    """``serve_args.<variant>.reference`` must name a serve_args variant; raises ``UserError``."""
    _raise_all(_reference_variant_errors(sweep, path, node))


def _reference_variant_errors(sweep: Sweep, path: Path, node: yaml.Node | None) -> list[str]:
    errors = []
    for name in sweep.serve_args:
        ref = sweep.serve_variant(name).reference
        if ref is not None and ref not in sweep.serve_args:
            loc = ("serve_args", name, "reference")
            errors.append(
                f"{path}:{line_of(node, loc)}: {fmt_loc(loc)}: unknown serve_args '{ref}' "
                f"(allowed: {', '.join(sweep.serve_args)})"
            )
    return errors
