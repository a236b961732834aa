"""TOML as dspark writes it: values, keys and tables with None left out (TOML has no null).
Standard library only: the cluster file's schema, validator and writer all use it."""

from __future__ import annotations

from typing import Any


def toml_value(value: Any) -> str:
    """Format a value as TOML (enough for the types the config uses)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + "".join(_TOML_ESCAPES.get(ch) or (f"\\u{ord(ch):04x}" if _control(ch) else ch)
                             for ch in value) + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        if not value:
            return "{}"
        return "{ " + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


_TOML_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r", "\b": "\\b", "\f": "\\f"}


def _control(ch: str) -> bool:
    """Characters TOML does not allow as they are in a basic string."""
    return ord(ch) < 0x20 or ord(ch) == 0x7F


def toml_key(key: str) -> str:
    bare = key and all(c.isascii() and (c.isalnum() or c in "_-") for c in key)
    return key if bare else toml_value(key)


def toml_value_or_repr(value: Any) -> str:
    try:
        return toml_value(value)
    except TypeError:
        return repr(value)


def drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_none(v) for v in value]
    return value
