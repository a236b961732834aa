"""One check of a value read from a file (the cluster file's TOML, a bench report's JSON) against
the type a dataclass field declares, and the words an error message uses for that type. The
cluster file (dspark.config) and the bench reports (dspark.bench.report) both validate with it.

The types are the few the two schemas declare: str, int, float, bool, None, Any, unions of them,
list[T] and dict[str, T] (and bare list and dict). A bool is never a number; an int is a float."""

from __future__ import annotations

import math
import types
import typing
from typing import Any


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
