"""Writing cluster files: `dumps` (a cluster dict as TOML, optionally with each field's help and
source as comments) and `template`, the commented file `dspark config init` writes."""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Mapping
from typing import Any

from dspark.config.schema import NOT_SET, PLACEHOLDER, SECTIONS, NodeConfig, ServingConfig, SupervisorConfig
from dspark.config.toml import drop_none, toml_key, toml_value


def dumps(data: dict, comments: bool = False, derived: dict[str, dict[str, Any]] | None = None) -> str:
    """Write a cluster dict as TOML; with comments, each field carries its help text and source.
    `derived` (section -> field -> value) adds unset fields as commented-out lines showing the
    value they follow from the others."""
    lines: list[str] = []
    classes = dict(SECTIONS, nodes=NodeConfig)

    def table(cls: type, values: dict, unset: dict[str, Any] | None = None) -> None:
        meta: dict[str, Mapping[str, Any]] = {f.name: f.metadata for f in dataclasses.fields(cls)}
        for key, value in [*values.items(), *(unset or {}).items()]:
            if comments and meta.get(key, {}).get("help"):
                lines.append(f"# {meta[key]['help']}")
            if comments and meta.get(key, {}).get("source"):
                lines.extend(textwrap.wrap(f"Source: {meta[key]['source']}", 96, initial_indent="# ",
                                           subsequent_indent="#   ", break_on_hyphens=False))
            line = f"{toml_key(key)} = {toml_value(value)}"
            lines.append(line if key in values else f"# {line}  (unset: follows the settings above)")

    for name in ("model", "serving", "supervisor"):
        if name in data:
            lines.append(f"[{name}]")
            table(classes[name], data[name], (derived or {}).get(name) if comments else None)
            lines.append("")
    for node in data.get("nodes", []):
        lines.append("[[nodes]]")
        table(NodeConfig, node)
        lines.append("")
    return "\n".join(lines)


def template() -> str:
    """The commented template `dspark config init` writes: the seed's tested settings for
    DeepSeek V4 Flash on two GB10 nodes, with CHANGEME where only the operator knows."""
    data = {
        "model": {"path": f"/var/lib/dspark/models/{PLACEHOLDER}", "served_name": "deepseek-v4-flash",
                  "trust_remote_code": True},
        "serving": drop_none(dataclasses.asdict(ServingConfig())),
        "supervisor": dataclasses.asdict(SupervisorConfig()),
        "nodes": [
            {"name": PLACEHOLDER + "-head-hostname", "rank": 0, "role": "head", "address": PLACEHOLDER,
             "socket_ifname": PLACEHOLDER, "rdma_device": PLACEHOLDER, "gid_index": "auto",
             "api_port": 8888, "master_port": 25000, "agent_port": 8890},
            {"name": PLACEHOLDER + "-worker-hostname", "rank": 1, "role": "worker", "address": PLACEHOLDER,
             "socket_ifname": PLACEHOLDER, "rdma_device": PLACEHOLDER, "gid_index": "auto", "agent_port": 8890},
        ],
    }
    header = (
        "# dspark cluster file: one description of the deployment, the same file on every node.\n"
        "# Each process finds its own [[nodes]] entry by name (default: the host name).\n"
        "# Replace every CHANGEME; use the dedicated fabric addresses, not Wi-Fi or the LAN.\n"
        "# The head's API binds its fabric address (only the nodes reach it); to open it, set api_host =\n"
        "# \"0.0.0.0\" in its [[nodes]] entry and an API key (dspark check warns on an open API).\n"
        "# Defaults are the tested settings for DeepSeek V4 Flash on two GB10 nodes (TP=2); each serving\n"
        "# setting says where it comes from (a public measurement on GB10, or vLLM's code).\n"
        "# Left unset on purpose:\n"
        + "".join("\n".join(textwrap.wrap(note, 96, initial_indent="# - ", subsequent_indent="#   ",
                                                break_on_hyphens=False)) + "\n"
                  for note in NOT_SET)
        + "# Check it with: dspark config check\n\n"
    )
    serving = ServingConfig()
    derived = {"serving": {"cudagraph_capture_sizes": serving.capture_sizes}} if serving.capture_sizes else {}
    return header + dumps(data, comments=True, derived=derived)
