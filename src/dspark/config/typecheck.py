"""One check of a value read from a file (the cluster file's TOML, a bench report's JSON) against
the type a dataclass field declares, and the words an error message uses for that type. The
cluster file (dspark.config.validate) and the bench reports (dspark.bench.report) both validate with it;
the dashboard's snapshot (dspark.dashboard.snapshot_model) is declared the same way and its JSON
Schema generated from the declaration (`json_schema`).

The types are the few the schemas declare: str, int, float, bool, None, Any, Literal, unions of
them, list[T] and dict[str, T] (and bare list and dict), and dataclasses of those. A bool is never
a number; an int is a float."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Literal


def fits(value: Any, tp: Any, *, finite: bool = False) -> bool:
    """Whether `value` fits `tp`; with `finite`, a float must also be finite (JSON reports: a
    NaN or an infinity is a malformed figure)."""
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        return any(fits(value, a, finite=finite) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is Any:
        return True
    if origin is Literal:
        return any(value == v and type(value) is type(v) for v in typing.get_args(tp))
    if origin is list or tp is list:
        args = typing.get_args(tp)
        return isinstance(value, list) and (not args or all(fits(v, args[0], finite=finite) for v in value))
    if origin is dict:
        inner = typing.get_args(tp)[1]
        return isinstance(value, dict) and all(isinstance(k, str) and fits(v, inner, finite=finite)
                                               for k, v in value.items())
    if tp is dict:
        return isinstance(value, dict)
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return (isinstance(value, (int, float)) and not isinstance(value, bool)
                and (not finite or math.isfinite(value)))
    return isinstance(value, tp)


_TOML_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "a table"}
_JSON_WORDS = {**_TOML_WORDS, float: "a finite number", dict: "an object", type(None): "null"}
_PLURALS = {int: "whole numbers", float: "numbers", str: "strings", bool: "true or false values"}


def words(tp: Any, *, json: bool = False) -> str:
    """`tp` as an error message says it: TOML's words ("a table"; an optional field's None left
    out), or with `json` JSON's ("an object", "null", "a finite number")."""
    vocab = _JSON_WORDS if json else _TOML_WORDS
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        return " or ".join(words(a, json=json) for a in typing.get_args(tp) if json or a is not type(None))
    if origin is list or tp is list:
        args = typing.get_args(tp)
        return f"a list of {_PLURALS.get(args[0], words(args[0], json=json))}" if args else "a list"
    if origin is dict:
        return vocab[dict]
    return vocab.get(tp, str(tp))


# --- JSON Schema (draft 2020-12) from a dataclass declaration -------------------------------

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}
_NUMBER_BOUNDS = ("minimum", "maximum", "exclusiveMinimum")
_OWN_KEYS = ("doc", "key", "optional", "what")  # about()'s keys that are not JSON Schema's


def about(doc: str = "", **schema: Any) -> Any:
    """A dataclass field's description and bounds, for `json_schema`. `schema` holds JSON
    Schema's own keywords (minimum, maximum, exclusiveMinimum, minLength, minItems, maxItems;
    on a list the number bounds apply to its items) and three of ours: key= the JSON name
    where it is not a Python name, optional=True for a key that may be absent, and what= the
    words that replace "{what}" in the descriptions of a nested dataclass's fields."""
    return dataclasses.field(metadata={"doc": doc, **schema})


def json_schema(tp: Any, meta: typing.Mapping[str, Any] | None = None, what: str = "") -> dict:
    """The JSON Schema of `tp` as `fits` reads it, with the description and bounds `meta`
    (a field's about()) gives. A dataclass is an object with exactly its fields."""
    meta = dict(meta or {})
    node = _type_schema(tp, meta.get("what", what))
    doc = meta.get("doc", "").replace("{what}", what)
    bounds = {k: v for k, v in meta.items() if k not in _OWN_KEYS}
    if "items" in node:
        node["items"].update({k: bounds.pop(k) for k in _NUMBER_BOUNDS if k in bounds})
    return {**node, **({"description": doc} if doc else {}), **bounds}


def _type_schema(tp: Any, what: str) -> dict:
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        args = typing.get_args(tp)
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1 or len(rest) == len(args):
            return {"anyOf": [_type_schema(a, what) for a in args]}
        node = _type_schema(rest[0], what)
        if "enum" in node:
            node["enum"] = [*node["enum"], None]
        else:
            node["type"] = [node["type"], "null"]
        return node
    if origin is Literal:
        values = list(typing.get_args(tp))
        return {"const": values[0]} if len(values) == 1 else {"enum": values}
    if origin is list:
        return {"type": "array", "items": _type_schema(typing.get_args(tp)[0], what)}
    if origin is dict:
        return {"type": "object", "additionalProperties": _type_schema(typing.get_args(tp)[1], what)}
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        props, required = {}, []
        for f in dataclasses.fields(tp):
            key = f.metadata.get("key", f.name)
            props[key] = json_schema(hints[f.name], f.metadata, what)
            if not f.metadata.get("optional"):
                required.append(key)
        return {"type": "object", "additionalProperties": False, "required": required, "properties": props}
    if tp is Any:
        return {}
    return {"type": {list: "array", dict: "object", **_JSON_TYPES}[tp]}
