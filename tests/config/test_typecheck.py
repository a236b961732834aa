"""dspark.config.typecheck: the one type check the cluster file and the bench reports use, and the JSON
Schema generated from a dataclass declaration (the dashboard's snapshot schema comes from it).
The schemas are judged by jsonschema, the validator a client of the dashboard would use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import jsonschema
import pytest

from dspark.config.typecheck import about, fits, json_schema


@dataclass
class Window:
    mean: float | None = about("mean {what}, seconds", minimum=0)
    edges: list[float | None] | None = about("[low, high] of {what}", minItems=2, maxItems=2, minimum=0)


@dataclass
class Sample:
    version: Literal[1] = about()
    role: Literal["head", "worker"] = about("the node's role")
    proof: Literal["progress", "probe"] | None = about()
    name: str | None = about("a name", minLength=1)
    count: int = about(minimum=0)
    share: float = about(minimum=0, maximum=1)
    from_: str = about("where from", key="from")
    note: str = about("may be absent", optional=True)
    ttft: Window = about(what="time to first token")
    series: list[float | None] = about(minimum=0)
    tags: dict[str, int] = about()
    settings: dict = about()
    trials: list = about()
    anything: Any = about()


GOOD = {"version": 1, "role": "head", "proof": None, "name": "a", "count": 0, "share": 0.5, "from": "x",
        "ttft": {"mean": 0.2, "edges": [0.1, None]}, "series": [1.0, None], "tags": {"k": 1},
        "settings": {"a": [1]}, "trials": [{}, 2], "anything": "x"}


def validate(value) -> None:
    jsonschema.validate(value, json_schema(Sample), cls=jsonschema.Draft202012Validator)


def test_generated_schema_is_a_valid_draft_2020_12_schema():
    jsonschema.Draft202012Validator.check_schema(json_schema(Sample))


def test_a_value_of_the_declared_shape_validates_with_and_without_an_optional_key():
    validate(GOOD)
    validate({**GOOD, "note": "here"})


@pytest.mark.parametrize("broken", [
    {**GOOD, "extra": 1},                                   # a key the dataclass does not declare
    {k: v for k, v in GOOD.items() if k != "count"},        # a required key missing
    {**GOOD, "version": 2},                                 # a one-value Literal is a const
    {**GOOD, "role": "other"},                              # an enum
    {**GOOD, "proof": "guess"},
    {**GOOD, "name": ""},                                   # minLength
    {**GOOD, "count": -1},                                  # minimum on an integer
    {**GOOD, "count": 1.5},                                 # an int is not a float
    {**GOOD, "count": True},                                # a bool is not a number
    {**GOOD, "share": 1.5},                                 # maximum
    {**GOOD, "from_": "x"},                                 # the JSON key is "from", not the Python name
    {**GOOD, "ttft": {"mean": -1, "edges": None}},          # bounds in a nested dataclass
    {**GOOD, "ttft": {"mean": 1, "edges": [1, 2, 3]}},      # maxItems
    {**GOOD, "ttft": {"mean": 1, "edges": [-1, 2]}},        # a list's number bounds apply to its items
    {**GOOD, "series": [-0.5]},
    {**GOOD, "tags": {"k": "v"}},                           # dict[str, int] values
    {**GOOD, "settings": []},                               # a bare dict is an object
    {**GOOD, "trials": {}},                                 # a bare list is an array
])
def test_what_the_declaration_rules_out_the_schema_rejects(broken):
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)


def test_descriptions_and_the_what_of_the_holding_field():
    props = json_schema(Sample)["properties"]
    assert props["role"]["description"] == "the node's role"
    assert "description" not in props["count"]           # no words given: no description
    window = props["ttft"]["properties"]
    assert window["mean"]["description"] == "mean time to first token, seconds"
    assert window["edges"]["description"] == "[low, high] of time to first token"
    assert json_schema(Sample)["required"] == [k for k in props if k != "note"]


@pytest.mark.parametrize("value,tp,ok", [
    ("head", Literal["head", "worker"], True),
    ("boss", Literal["head", "worker"], False),
    (1, Literal[1], True),
    (True, Literal[1], False),                           # True == 1 in Python, not in a report
    (None, Literal["a"] | None, True),
])
def test_fits_reads_literals_as_the_schema_does(value, tp, ok):
    assert fits(value, tp) is ok
