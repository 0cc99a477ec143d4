"""Dataclasses read from YAML: each key checked against the fields' type hints (unknown keys
name the valid ones, wrong types the expected one), `key=value` overrides read for the type of
the field they set (train/config.py holds the recipe's dataclasses)."""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any, Literal

import yaml


class RecipeError(ValueError):
    """A recipe key or value that does not fit the schema."""


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unknown_key(cls: type, key: str, section: str, where: str) -> RecipeError:
    valid = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    name = f"{section}.{key}" if section else key
    scope = f"'{section}'" if section else "the recipe's top level"
    return RecipeError(
        f"{where}: unknown key '{name}'.{hint} Valid keys of {scope}: {', '.join(valid)}"
    )


def build(cls: type, raw: Any, section: str, where: str) -> Any:
    """Make `cls` from a mapping, checking keys and (recursively) value types."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RecipeError(
            f"{where}: '{section}' must be a mapping of keys, got {type(raw).__name__} {raw!r}"
        )
    hints = _hints(cls)
    kwargs = {}
    for key, value in raw.items():
        if key not in hints:
            raise _unknown_key(cls, str(key), section, where)
        name = f"{section}.{key}" if section else key
        kwargs[key] = _coerce(value, hints[key], name, where)
    try:
        return cls(**kwargs)
    except RecipeError as e:  # a cross-field check in __post_init__
        raise RecipeError(f"{where}: {e}") from e


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, name: str, where: str) -> Any:
    """Check `value` against the type hint `tp`; return it converted where that is lossless."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)

    def wrong() -> RecipeError:
        return RecipeError(
            f"{where}: '{name}' expects {_type_name(tp)}, got {type(value).__name__} {value!r}"
        )

    if dataclasses.is_dataclass(tp):
        return build(tp, value, name, where)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, name, where)
            except RecipeError:
                continue
        raise wrong()
    if origin is Literal:
        hint = ""
        if isinstance(value, bool):  # YAML 1.1 reads a bare no / off / yes / on as a bool
            words = ("yes", "on", "true") if value else ("no", "off", "false")
            value = next((w for w in words if w in args), value)
            hint = " (YAML reads a bare yes / no / on / off as a boolean: quote the word)"
        if any(a == value and type(a) is type(value) for a in args):
            return value
        raise RecipeError(
            f"{where}: '{name}' must be one of {', '.join(map(repr, args))}, got {value!r}{hint}"
        )
    if origin is list:
        # A single value for a list field is the one-element list (`data.sources=x.jsonl`).
        if value is None or isinstance(value, dict):
            raise wrong()
        items = value if isinstance(value, list) else [value]
        return [_coerce(v, args[0], f"{name}[{i}]", where) for i, v in enumerate(items)]
    if origin is tuple:  # YAML has no tuples: a list of the right length and item types
        if not isinstance(value, (list, tuple)):
            raise wrong()
        if len(args) == 2 and args[1] is Ellipsis:
            item_types = [args[0]] * len(value)
        elif len(args) == len(value):
            item_types = list(args)
        else:
            raise wrong()
        return tuple(
            _coerce(v, t, f"{name}[{i}]", where) for i, (v, t) in enumerate(zip(value, item_types))
        )
    if origin is dict:
        if not isinstance(value, dict):
            raise wrong()
        return {str(k): _coerce(v, args[1], f"{name}.{k}", where) for k, v in value.items()}
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise wrong()
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        number = _yaml11_number(value)  # max_steps: 1e3
        if number is not None and number.is_integer():
            return int(number)
        raise wrong()
    if tp is float:  # finite: YAML's .nan passes every range check, .inf most of them
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # an int past float's range
                raise wrong() from None
            if math.isfinite(number):
                return number
            raise RecipeError(f"{where}: '{name}' expects a finite float, got {value!r}")
        number = _yaml11_number(value)  # learning_rate: 3e-4
        if number is not None:
            return number
        raise wrong()
    if tp is str:
        if isinstance(value, str):
            return value
        raise wrong()
    raise RecipeError(f"{where}: '{name}' has a type the schema cannot check: {tp!r}")


def _yaml11_number(value: Any) -> float | None:
    """A number in exponent form that YAML 1.1 left a string (`3e-4`, `1e3`), else None."""
    if not isinstance(value, str) or "e" not in value.lower():
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _field_type(root: type, path: list[str]) -> Any:
    """The type hint at a dotted path from `root`, or a RecipeError naming the valid keys."""
    tp: Any = root
    for depth, key in enumerate(path):
        if not dataclasses.is_dataclass(tp):
            raise RecipeError(f"override: '{'.'.join(path[:depth])}' has no sub-keys")
        hints = _hints(tp)
        if key not in hints:
            raise _unknown_key(tp, key, ".".join(path[:depth]), "override")
        tp = hints[key]
    return tp


def _resolve_path(root: type, key: str) -> list[str]:
    """`section.key` as is; a bare `key` that names exactly one field of one section."""
    path = key.split(".")
    if len(path) > 1 or path[0] in _hints(root):
        return path
    owners = [
        section
        for section, tp in _hints(root).items()
        if dataclasses.is_dataclass(tp) and key in _hints(tp)
    ]
    if len(owners) == 1:
        return [owners[0], key]
    if len(owners) > 1:
        choices = ", ".join(f"{s}.{key}" for s in owners)
        raise RecipeError(f"override: '{key}' is ambiguous; write one of {choices}")
    raise _unknown_key(root, key, "", "override")


def _accepts_none(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in (
        typing.get_args(tp)
    )


def _accepts_str(tp: Any) -> bool:
    if tp is str:
        return True
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return str in typing.get_args(tp)
    return False


def apply_override(root: type, raw: dict[str, Any], item: str) -> None:
    """Set `raw`'s value at `item`'s `key=value` (a key of `root`'s fields), read for its type."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise RecipeError(f"override {item!r}: expected key=value (e.g. data.limit=100)")
    path = _resolve_path(root, key.strip())
    tp = _field_type(root, path)
    if text.strip().lower() in ("null", "~", "none") and _accepts_none(tp):
        value: Any = None  # YAML reads `None` as the string "None"; here it means null
    elif _accepts_str(tp) and text.strip().lower() in ("null", "~"):
        raise RecipeError(
            f"override {item!r}: '{key.strip()}' cannot be null (it takes {_type_name(tp)}): "
            "give a value, or leave the override out for the recipe's own"
        )
    elif _accepts_str(tp):
        value = text  # a string field keeps the text verbatim (no YAML surprises like 1e3)
    elif not text.strip():  # `data.limit=` read as null would mean "no limit", unsaid
        raise RecipeError(
            f"override {item!r} has no value: give one ({_type_name(tp)}), or leave the override "
            "out for the recipe's own"
        )
    else:
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise RecipeError(f"override {item!r}: value is not valid YAML: {e}") from e
    node = raw
    for part in path[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise RecipeError(f"override {item!r}: '{part}' in the recipe is not a mapping")
        node = child
    node[path[-1]] = value
