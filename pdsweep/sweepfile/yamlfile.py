"""Reading YAML input files with the line numbers errors need: :func:`read_yaml` (text
plus composed node tree; malformed YAML, non-UTF-8 bytes and duplicate keys are
``UserError`` naming file and line), :func:`line_of` (the line of a pydantic error
location), :func:`fmt_loc` and :func:`resolve_model` (the model class a location
reaches, for "allowed keys")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from pdsweep.core.errors import UserError


def line_of(node: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    """1-based line of the YAML node at ``loc`` (pydantic error location), or the
    deepest ancestor found."""
    line = node.start_mark.line + 1 if node is not None else None
    for key in loc:
        if isinstance(node, yaml.MappingNode):
            nxt = None
            for k, v in node.value:
                if k.value == str(key):
                    nxt, line = v, k.start_mark.line + 1
                    break
            node = nxt
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
            line = node.start_mark.line + 1
        else:
            break
        if node is None:
            break
    return line


def fmt_loc(loc: tuple[Any, ...]) -> str:
    """``a.b[2].c`` from a pydantic error location (``(top level)`` when empty)."""
    out = ""
    for k in loc:
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else str(k))
    return out or "(top level)"


def read_yaml(path: Path) -> tuple[Any, yaml.Node | None]:
    """``(data, node tree)`` of the YAML file ``path``; raises ``UserError`` naming the
    file (and line) when it cannot be read, is not UTF-8, is malformed or repeats a key."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UserError(f"{path}: cannot read: {e.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise UserError(f"{path}:{line}: not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start})") from None
    try:
        data, node = yaml.safe_load(text), yaml.compose(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        problem = getattr(e, "problem", None) or str(e)
        raise UserError(f"{where}: malformed YAML: {problem}") from None
    dups = duplicate_keys(node)
    if dups:
        raise UserError(
            "\n".join(
                f"{path}:{second}: duplicate key '{key}' (first at line {first}); YAML would silently keep the last"
                for key, first, second in dups
            )
        )
    return data, node


def duplicate_keys(node: yaml.Node | None) -> list[tuple[str, int, int]]:
    """``(key, first line, repeated line)`` for every key given twice in one mapping of
    the composed YAML tree (pyyaml keeps the last silently)."""
    out: list[tuple[str, int, int]] = []
    stack = [node] if node is not None else []
    while stack:
        n = stack.pop()
        if isinstance(n, yaml.MappingNode):
            seen: dict[str, int] = {}
            for k, v in n.value:
                key, line = str(k.value), k.start_mark.line + 1
                if isinstance(k, yaml.ScalarNode) and key in seen:
                    out.append((key, seen[key], line))
                seen.setdefault(key, line)
                stack += [k, v]
        elif isinstance(n, yaml.SequenceNode):
            stack += n.value
    return sorted(out, key=lambda x: x[2])


def resolve_model(model: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model class reached by following ``loc`` (for 'allowed keys')."""
    import typing

    cur: Any = model
    for key in loc:
        if not (isinstance(cur, type) and issubclass(cur, BaseModel)):
            if isinstance(key, str) and typing.get_origin(cur) is dict:
                cur = typing.get_args(cur)[1]
                continue
            return None
        if isinstance(key, str) and key in cur.model_fields:
            cur = cur.model_fields[key].annotation
        else:
            return None
        # unwrap Optional[X] / X | None and dict[str, X]
        args = [a for a in typing.get_args(cur) if a is not type(None)]
        if typing.get_origin(cur) is dict:
            continue
        if args and typing.get_origin(cur) is not list:
            models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
            cur = models[0] if models else cur
    return cur if isinstance(cur, type) and issubclass(cur, BaseModel) else None
