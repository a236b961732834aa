"""The cluster file: one TOML description of a deployment, read and validated once at the edge.

Both nodes read the same file. This module reads it (`load`: a regular file, UTF-8, TOML, not
nested too deep) and validates it (`from_dict`: every section and key known and of its declared
type, then the cross-field checks of dspark.config.checks): every fault found is listed, each
naming its field and the fix. The fields are declared once in dspark.config.schema; files are
written by dspark.config.template (`dumps`, `template`); a caller imports each name from the
module it lives in.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import tomllib
import typing
from pathlib import Path
from typing import Any

from dspark.config.checks import MAX_DEPTH, check
from dspark.config.schema import DEFAULT_CONFIG_PATH, PLACEHOLDER, SECTIONS, Cluster, ConfigError, NodeConfig
from dspark.config.toml import drop_none, toml_value, toml_value_or_repr
from dspark.config.typecheck import fits, words

# The file itself: a regular file of at most this size, UTF-8, nested at most MAX_DEPTH deep.
MAX_FILE_BYTES = 1024 * 1024


def _node_examples(i: int) -> dict[str, Any]:
    """The hints' examples for the i-th node: its own name and address, not the first node's."""
    return {"name": f"spark-{chr(ord('a') + i % 26)}", "rank": i, "address": f"192.168.100.{10 + i % 240}",
            "agent_host": f"192.168.100.{10 + i % 240}", "role": "head" if i == 0 else "worker"}


@functools.cache
def _declared(cls: type) -> tuple[dict[str, Any], dict[str, dataclasses.Field]]:
    """A section's type hints and fields, worked out once (per node they made validation slow)."""
    return typing.get_type_hints(cls), {f.name: f for f in dataclasses.fields(cls)}


def _build(cls: type, table: Any, where: str, problems: list[str], examples: dict[str, Any] | None = None) -> Any:
    if not isinstance(table, dict):
        problems.append(f"{where}: expected a table ([{where}]), got {toml_value_or_repr(table)}")
        return None
    hints, fields = _declared(cls)
    kwargs: dict[str, Any] = {}
    for key, value in table.items():
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(fields)}"
            problems.append(f"{where}.{key}: unknown key{hint}")
            continue
        f = fields[key]
        example = (examples or {}).get(key, f.metadata.get("example"))
        if not fits(value, hints[key]):
            got = toml_value_or_repr(value)
            problems.append(f"{where}.{key}: expected {words(hints[key])}, got {got}; "
                            f"write e.g. {key} = {toml_value(example)}")
            continue
        if _has_nul(value):
            problems.append(f"{where}.{key}: contains a NUL character, which no command line, environment "
                            "or path can carry; remove it")
            continue
        if hints[key] is float and isinstance(value, int) and not -2**53 <= value <= 2**53:
            problems.append(f"{where}.{key}: a {len(str(abs(value)))}-digit number is out of range; "
                            f"write e.g. {key} = {toml_value(example)}")
            continue
        if _has_placeholder(value):
            problems.append(f"{where}.{key}: still the placeholder {PLACEHOLDER}; {f.metadata['help']} "
                            f"Write e.g. {key} = {toml_value(example)}")
            continue
        kwargs[key] = float(value) if hints[key] is float and isinstance(value, int) else value
    for name, f in fields.items():
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            if name not in table:
                problems.append(f"{where}.{name}: missing; {f.metadata['help']} "
                                f"Write e.g. {name} = "
                                f"{toml_value((examples or {}).get(name, f.metadata.get('example')))}")
    try:
        return cls(**kwargs)
    except TypeError:
        return None  # a missing required field, already reported


def _has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\0" in value
    if isinstance(value, list):
        return any(_has_nul(v) for v in value)
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    return False


def _has_placeholder(value: Any) -> bool:
    if isinstance(value, str):
        return PLACEHOLDER in value
    if isinstance(value, list):
        return any(_has_placeholder(v) for v in value)
    if isinstance(value, dict):
        return any(_has_placeholder(v) for v in value.values())
    return False


def from_dict(data: dict, source: str | None = None) -> Cluster:
    """Validate a parsed cluster file; raise ConfigError listing every fault."""
    problems: list[str] = []
    known = set(SECTIONS) | {"nodes"}
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"; did you mean [{close[0]}]?" if close else f"; known sections: {', '.join(sorted(known))}"
            problems.append(f"{key}: unknown section{hint}")
    if "model" not in data:
        problems.append("model: missing; add a [model] table with path = \"/path/to/model\"")
    parts = {name: _build(cls, data.get(name, {}), name, problems) for name, cls in SECTIONS.items()}
    raw_nodes = data.get("nodes")
    nodes: list[NodeConfig] = []
    if not isinstance(raw_nodes, list) or not raw_nodes:
        problems.append("nodes: missing; add one [[nodes]] table per node (name, rank, address)")
    else:
        for i, raw in enumerate(raw_nodes):
            node = _build(NodeConfig, raw, f"nodes[{i}]", problems, _node_examples(i))
            if node is not None:
                nodes.append(node)
    if problems:
        raise ConfigError(problems, source)
    cluster = Cluster(model=parts["model"], serving=parts["serving"], supervisor=parts["supervisor"],
                      nodes=tuple(nodes), source=source)
    problems = check(cluster)
    if problems:
        raise ConfigError(problems, source)
    return cluster


def _read_text(path: Path) -> str:
    """The file's text: a regular file (not a FIFO or a device: opened without blocking and
    refused), at most MAX_FILE_BYTES, UTF-8."""
    from dspark.files.safe_read import FileTooLarge, NotRegularFile, read_bytes  # the one guarded reader

    try:
        data = read_bytes(path, MAX_FILE_BYTES)
    except FileNotFoundError:
        raise ConfigError([f"file not found; create one with: dspark config init {path}"], str(path)) from None
    except NotRegularFile:
        raise ConfigError(["not a regular file (a directory, FIFO or device); point --config at the "
                           "cluster file itself"], str(path)) from None
    except FileTooLarge:
        raise ConfigError([f"larger than {MAX_FILE_BYTES // 1024} KiB; a cluster file is a few KiB"],
                          str(path)) from None
    except OSError as e:
        raise ConfigError([f"cannot read: {e.strerror}"], str(path)) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError([f"not UTF-8 text (byte {e.start}: {data[e.start:e.start + 1]!r}); TOML files are "
                           "UTF-8"], str(path)) from None


def _depth(value: Any, limit: int) -> int:
    if limit < 0:
        return 0
    if isinstance(value, dict):
        return 1 + max((_depth(v, limit - 1) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v, limit - 1) for v in value), default=0)
    return 0


def load(path: str | os.PathLike | None = None) -> Cluster:
    """Read and validate the cluster file ($DSPARK_CONFIG or /etc/dspark/cluster.toml by default)."""
    path = Path(path or os.environ.get("DSPARK_CONFIG") or DEFAULT_CONFIG_PATH)
    text = _read_text(path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError([f"not valid TOML: {e}"], str(path)) from None
    except RecursionError:
        raise ConfigError([f"nested too deeply (a cluster file is at most {MAX_DEPTH} levels)"], str(path)) from None
    if _depth(data, MAX_DEPTH + 1) > MAX_DEPTH:
        raise ConfigError([f"nested more than {MAX_DEPTH} levels deep; a cluster file needs 4"], str(path))
    return from_dict(data, str(path))


def to_dict(c: Cluster) -> dict:
    out: dict[str, Any] = {name: dataclasses.asdict(getattr(c, name)) for name in SECTIONS}
    out["nodes"] = [dataclasses.asdict(n) for n in c.nodes]
    return drop_none(out)
