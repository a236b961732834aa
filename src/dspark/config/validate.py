"""The cluster file: one TOML description of a deployment, validated once at the edge.

Both nodes read the same file. This module reads it (`load`) and validates it (`from_dict`,
`check`): every fault found is listed, each naming its field and the fix. The fields are
declared once in dspark.config.schema; files are written by dspark.config.template (`dumps`,
`template`); a caller imports each name from the module it lives in.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import ipaddress
import math
import os
import re
import tomllib
import typing
import unicodedata
from pathlib import Path
from typing import Any

from dspark.config.flags import DSPARK_FLAGS
from dspark.config.schema import (
    DEFAULT_CONFIG_PATH,
    PLACEHOLDER,
    SECTIONS,
    Cluster,
    ConfigError,
    ModelConfig,
    NodeConfig,
    ServingConfig,
)
from dspark.config.toml import drop_none, toml_key, toml_value, toml_value_or_repr
from dspark.config.typecheck import fits, words

# The file itself: a regular file of at most this size, UTF-8, nested at most this deep.
MAX_FILE_BYTES = 1024 * 1024
MAX_DEPTH = 8
# The modalities vLLM's --limit-mm-per-prompt takes (config/multimodal.py MultiModalDummyOptionsBuiltins,
# 0.28.0 and 0.32.0).
MODALITIES = ("image", "video", "audio")
# Environment names: what a POSIX shell can assign and systemd's Environment= accepts.
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# The longest single argument dspark puts on vLLM's command line (a path is at most 4096 bytes).
MAX_ARG_CHARS = 4096
# What a host name may be (RFC 1123 labels, 253 characters at most).
_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


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


def check(c: Cluster) -> list[str]:
    """Contradictions between fields: each returned line names the fields and the fix."""
    p: list[str] = []
    s, sup = c.serving, c.supervisor
    p += check_ranges(c)
    if s.gpu_memory_utilization is None and s.kv_cache_memory_bytes is None:
        p.append("serving: set gpu_memory_utilization or kv_cache_memory_bytes")
    if s.block_size is not None and s.block_size >= 1 and s.block_size & (s.block_size - 1):
        p.append(f"serving.block_size: must be a power of two, got {s.block_size}")
    if (s.long_prefill_token_threshold or 0) > s.max_model_len:
        # vLLM's SchedulerConfig refuses it at start-up.
        p.append(f"serving.long_prefill_token_threshold: {s.long_prefill_token_threshold} is above "
                 f"max_model_len ({s.max_model_len}), which vLLM refuses; lower it (e.g. 1024)")
    if s.cudagraph_capture_sizes is not None:
        if not s.cudagraph_capture_sizes:
            p.append("serving.cudagraph_capture_sizes: must list at least one size, e.g. "
                     "cudagraph_capture_sizes = [6, 12, 18, 24, 30, 36]")
        elif s.max_cudagraph_capture_size is not None \
                and s.max_cudagraph_capture_size != max(s.cudagraph_capture_sizes):
            # vLLM raises when both are given and disagree.
            p.append(f"serving.max_cudagraph_capture_size: {s.max_cudagraph_capture_size} differs from the "
                     f"largest of cudagraph_capture_sizes ({max(s.cudagraph_capture_sizes)}); set one of them")
    p += _graph_coverage_problems(s)
    if s.limit_mm_per_prompt is not None:
        for modality in s.limit_mm_per_prompt:
            if modality not in MODALITIES:  # the counts' range: check_ranges
                p.append(f"serving.limit_mm_per_prompt.{toml_key(modality)}: not a modality vLLM limits; "
                         f"use one of {', '.join(MODALITIES)}, e.g. limit_mm_per_prompt = {{image = 4}}")
    if s.speculative_config is not None:
        n = s.speculative_config.get("num_speculative_tokens", 0)
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= 64:
            p.append("serving.speculative_config.num_speculative_tokens: must be a whole number in [0, 64]")
        bad = _not_json(s.speculative_config, "serving.speculative_config", 1)
        if bad:
            p.append(bad)
    if math.isfinite(sup.stall_s) and math.isfinite(sup.liveness_interval_s) \
            and sup.stall_s < 2 * sup.liveness_interval_s:
        p.append(f"supervisor.stall_s: must be at least twice liveness_interval_s ({sup.liveness_interval_s:g} s): "
                 f"a stall is seen by comparing readings taken an interval apart; got {sup.stall_s:g}")
    p += _runtime_line_problems(s)

    # The cluster file is world-readable (and in the Nix store on NixOS): no secrets in it
    # (dspark.config.secret_policy says what counts as one).
    from dspark.config.secret_policy import is_secret_env

    for where, env in [("serving.env", s.env)] + [(f"nodes ({n.name}).env", n.env) for n in c.nodes]:
        for key in env:
            if not ENV_NAME.fullmatch(key):
                p.append(f"{where}: {key!r} is not an environment variable name (letters, digits and _, "
                         "not starting with a digit)")
            elif is_secret_env(key):
                p.append(f"{where}.{key}: a secret does not belong in the cluster file; put it in the "
                         "service's environment file (DSPARK_API_KEY=...) or the 'api-key' credential")
    p += _check_command_line(c)
    # Counted once each (a count per node was quadratic: 15,000 nodes took 24 s).
    names: dict[str, int] = {}
    by_rank: dict[int, list[str]] = {}
    for n in c.nodes:
        names[n.name] = names.get(n.name, 0) + 1
        by_rank.setdefault(n.rank, []).append(n.name)
    for dup in sorted(k for k, v in names.items() if v > 1):
        p.append(f"nodes: the name {dup!r} is used by more than one node; give each node its own name")
    for rank in sorted(r for r, who in by_rank.items() if len(who) > 1):
        p.append(f"nodes: rank {rank} is given to more than one node ({', '.join(by_rank[rank])}); "
                 "ranks must be unique")
    if sorted(by_rank) != list(range(len(c.nodes))):
        ranks = sorted(n.rank for n in c.nodes)
        shown = ", ".join(map(str, ranks[:20])) + (", ..." if len(ranks) > 20 else "")
        p.append(f"nodes: ranks must be 0..{len(c.nodes) - 1} (one per node), got [{shown}]")
    if s.tensor_parallel_size * s.pipeline_parallel_size != len(c.nodes) * s.gpus_per_node:
        p.append(f"serving.tensor_parallel_size: {s.tensor_parallel_size} x pipeline_parallel_size "
                 f"{s.pipeline_parallel_size} must equal nodes ({len(c.nodes)}) x gpus_per_node "
                 f"({s.gpus_per_node}) = {len(c.nodes) * s.gpus_per_node}")
    # Ports are grouped by the node's address, parsed (::1 and 0:0:0:0:0:0:0:1 are one host):
    # one machine, one port space (binds to 0.0.0.0 included); nodes sharing an address share a machine.
    ports: dict[tuple[Any, int], str] = {}
    for i, n in enumerate(c.nodes):
        why = _name_fault(n.name)
        shown = n.name if why is None else ascii(n.name)[1:-1]  # an invisible character shown as \\u....
        where = f"nodes[{i}] ({shown})"
        if why:
            p.append(f"nodes[{i}].name: {why}, got {ascii(n.name)}; write e.g. name = \"spark-{chr(97 + i % 26)}\"")
        addr = _node_address(n.address)
        if isinstance(addr, str):
            p.append(f"{where}.address: {addr}; write this node's fabric IP, e.g. address = \"192.168.100.10\"")
        for key in ("agent_host", "api_host"):
            value = getattr(n, key)
            if value is not None and not _is_host(value):
                p.append(f"{where}.{key}: {ascii(value)} is neither an IP address nor a host name (letters, "
                         f"digits, '-' and '.'); "
                         f"write e.g. {key} = \"{n.address if key == 'agent_host' else '127.0.0.1'}\" "
                         "or leave it out (the fabric address)")
        if n.role is not None and n.role not in ("head", "worker"):
            p.append(f"{where}.role: must be 'head' or 'worker', got {n.role!r}")
        elif n.role == "head" and n.rank != 0:
            p.append(f"{where}.role: the head must be rank 0, but this node has rank {n.rank}; "
                     "set rank = 0 here (and give the other node rank 1)")
        elif n.role == "worker" and n.rank == 0:
            p.append(f"{where}.role: rank 0 is the head; set role = \"head\" or give this node another rank")
        # ASCII digits only: str.isdigit() also takes "²", "٣" and "３", which NCCL cannot read.
        if n.gid_index is not None and n.gid_index != "auto" and not re.fullmatch(r"[0-9]{1,5}", n.gid_index):
            p.append(f"{where}.gid_index: must be a number or \"auto\" (a number in ASCII digits, e.g. \"3\"), "
                     f"got {ascii(n.gid_index)}")
        if n.gid_index == "auto" and _is_ipv6(n.address):
            p.append(f"{where}.gid_index: \"auto\" finds the RoCEv2 GID of an IPv4 address, and {n.address} is "
                     "IPv6; give the GID index as a number (show_gids lists them)")
        if n.allow_default_route and n.socket_ifname is None:
            p.append(f"{where}.allow_default_route: allows socket_ifname to carry the default route, and no "
                     "socket_ifname is set; set socket_ifname or remove allow_default_route")
        if n.gid_index is not None and n.rdma_device is None:
            p.append(f"{where}.gid_index: needs rdma_device (the GID belongs to an RDMA device)")
        for key in ("api_port", "master_port", "agent_port"):
            port = getattr(n, key)
            if not 0 < port < 65536:
                p.append(f"{where}.{key}: {port} is not a TCP port (1..65535)")
        used = [("agent_port", n.agent_port)]
        if n.is_head:
            used += [("api_port", n.api_port), ("master_port", n.master_port)]
        host = addr if not isinstance(addr, str) else n.address
        for key, port in used:
            who = f"{shown}.{key}"
            if (host, port) in ports:
                p.append(f"port {port} is used twice on host {n.address}: {ports[host, port]} and {who}; "
                         "give one of them another port")
            else:
                ports[host, port] = who
    return p


def owned_flag(arg: str) -> str | None:
    """The DSPARK_FLAGS option `arg` sets (in any spelling argparse takes), or None. argparse takes
    `--opt=v`, `--opt_name` (vLLM reads _ as -), an unambiguous abbreviation (`--node-r`),
    `--opt.key=v` for a JSON option, and `--no-opt` for a switch: each is the same option."""
    if not arg.startswith("-") or arg == "-" or arg[1:2].isdigit():
        return None
    dashes = "--" if arg.startswith("--") else "-"
    name = arg[len(dashes):].split("=", 1)[0].split(".", 1)[0].replace("_", "-")
    if dashes == "-":
        return "-" + name if "-" + name in DSPARK_FLAGS else None
    if name.startswith("no-") and "--" + name[3:] in DSPARK_FLAGS:
        name = name[3:]
    if "--" + name in DSPARK_FLAGS:
        return "--" + name
    if len(name) >= 3:  # argparse's abbreviations (vLLM's parser keeps allow_abbrev on)
        hits = [f for f in DSPARK_FLAGS if f.startswith("--" + name)]
        if hits:
            return hits[0]
    return None


def _check_command_line(c: Cluster) -> list[str]:
    """What dspark puts on vLLM's command line: no secret (ps shows it), nothing vLLM reads
    as an option where a value belongs, no option dspark sets itself, no argument too long."""
    from dspark.config.secret_policy import secret_args, secret_keys

    p: list[str] = []
    m, s = c.model, c.serving
    for key in ("path", "served_name"):
        value = getattr(m, key)
        if value.startswith("-"):  # the value itself is not echoed: it may be a secret
            p.append(f"model.{key}: starts with '-', which vLLM would read as an option (and ps would show); "
                     f"write a {'directory' if key == 'path' else 'name'}, e.g. {key} = "
                     f"{toml_value(dataclasses.fields(ModelConfig)[0 if key == 'path' else 1].metadata['example'])}")
        elif not value:
            p.append(f"model.{key}: empty; write e.g. {key} = \"deepseek-v4-flash\"" if key == "served_name"
                     else "model.path: empty; write the model directory, e.g. path = \"/var/lib/dspark/models/x\"")
        if len(value) > MAX_ARG_CHARS:
            p.append(f"model.{key}: {len(value)} characters, longer than {MAX_ARG_CHARS}")
    if not s.vllm_command or not s.vllm_command[0]:
        p.append("serving.vllm_command: must name vLLM's CLI, e.g. vllm_command = [\"vllm\"] or "
                 "[\"/opt/runtime/bin/vllm\"]")
    commands = [(f"serving.line_commands.{toml_key(k)}", v) for k, v in s.line_commands.items()]
    for where, args in (("serving.extra_args", s.extra_args), ("serving.vllm_command", s.vllm_command), *commands):
        for flag in secret_args(args):
            p.append(f"{where}: {flag} takes a secret, which does not belong in the cluster file nor on "
                     "vLLM's command line (ps shows it); the API key goes in the 'api-key' credential or "
                     "DSPARK_API_KEY in the service's environment file")
        long = [a for a in args if len(a) > MAX_ARG_CHARS]
        if long:
            p.append(f"{where}: an argument of {len(long[0])} characters, longer than {MAX_ARG_CHARS}; vLLM's "
                     "options and paths are shorter")
    for arg in s.extra_args:
        owned = owned_flag(arg)
        if owned:
            shown = arg.split("=", 1)[0]
            p.append(f"serving.extra_args: {shown} sets {owned}, which dspark writes itself from "
                     f"{DSPARK_FLAGS[owned]}; set that instead and remove {shown} from extra_args")
    if s.speculative_config is not None:
        for where in secret_keys(s.speculative_config, "serving.speculative_config"):
            p.append(f"{where}: a secret does not belong in the cluster file nor on vLLM's command line "
                     "(speculative_config is passed as JSON in --speculative-config); remove it")
    return p


def _node_address(address: str) -> Any:
    """The node's address parsed, or why it cannot be a node's address."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return f"{ascii(address)} is not an IP address"
    if ip.is_unspecified:
        return f"{address} is the unspecified address (any), which no peer can reach"
    if ip.is_multicast:
        return f"{address} is a multicast address, not one host's"
    if ip.version == 4 and ip.is_reserved:  # 240.0.0.0/4, 255.255.255.255 (broadcast) included
        return f"{address} is reserved or the broadcast address, not one host's"
    return ip


def _is_host(value: str) -> bool:
    """An IP address or a host name: nothing a URL or a shell would read more into."""
    try:
        ipaddress.ip_address(value)
        return True
    except ValueError:
        pass
    name = value[:-1] if value.endswith(".") else value
    return 0 < len(name) <= 253 and all(_HOST_LABEL.fullmatch(label) for label in name.split("."))


def _name_fault(name: str) -> str | None:
    """Why a node name cannot be used: it names the node in logs, units, the dashboard and
    --node, so it is printable and has nothing invisible (zero-width, bidi, control, spaces)."""
    if not name:
        return "empty"
    if len(name) > 253:
        return f"{len(name)} characters (at most 253: a host name's length)"
    for ch in name:
        if (not ch.isprintable() or ch.isspace()
                or unicodedata.category(ch) in ("Cf", "Cc", "Co", "Cn", "Zs", "Zl", "Zp")):
            return (f"holds {unicodedata.name(ch, f'U+{ord(ch):04X}')} (U+{ord(ch):04X}), "
                    "an invisible, space or control character")
    return None


def _runtime_line_problems(s: ServingConfig) -> list[str]:
    """The runtime line exists and honours the settings (dspark.lines.runtime says how each line
    names them, and why it refuses one)."""
    from dspark.lines import runtime as runtime_lines

    lines = runtime_lines.load()
    p: list[str] = []
    for line, command in s.line_commands.items():
        where = f"serving.line_commands.{toml_key(line)}"
        if line not in lines.lines:
            p.append(runtime_lines.unknown_line_message(line, lines).replace("serving.runtime_line", where))
        elif not command or not command[0]:
            p.append(f"{where}: must name that line's vLLM CLI, e.g. [\"/opt/dspark/lines/{line}/bin/vllm\"]")
        elif line == s.runtime_line and command != s.vllm_command:
            p.append(f"{where}: differs from serving.vllm_command, which is the command of the file's own line "
                     f"({line}); make them the same or drop this entry")
    if s.runtime_line not in lines.lines:
        return p + [runtime_lines.unknown_line_message(s.runtime_line, lines)]
    return p + runtime_lines.refusals(s.runtime_line, {k: getattr(s, k) for k in runtime_lines.SETTINGS}, lines)


def _graph_coverage_problems(s: ServingConfig) -> list[str]:
    """A user's capture sizes (or largest size) leave no decode batch without a FULL CUDA graph:
    every target verify batch and every DSpark draft batch of 1..max_num_seqs requests, as
    vLLM's model runner v2 dispatches them on each line the nodes may run (dspark.engine.graph_dispatch,
    proven against vLLM's own managers in tests/overlay/test_graph_grid.py). dspark's own list
    covers every batch; without graphs (--enforce-eager) there is nothing to cover."""
    from dspark.engine import graph_dispatch as G
    from dspark.lines import runtime as runtime_lines

    given = s.cudagraph_capture_sizes
    if given is None and s.max_cudagraph_capture_size is None or "--enforce-eager" in s.extra_args:
        return []
    whole = [x for x in (given or []) + [s.max_cudagraph_capture_size or 1, s.max_num_seqs,
                                           s.max_num_batched_tokens]
             if not isinstance(x, int) or isinstance(x, bool) or x < 1]
    k = s.speculative_config.get("num_speculative_tokens", 0) if s.speculative_config else 0
    if given == [] or whole or not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= 64 \
            or (given and s.max_cudagraph_capture_size not in (None, max(given))):
        return []  # reported on their own
    draft_q = G.draft_query_len(s.speculative_config)
    known = runtime_lines.load().lines
    releases = sorted({known[line].vllm for line in {s.runtime_line, *s.line_commands} if line in known})

    def sizes_of(serving: ServingConfig) -> list[int]:
        """What vLLM captures from the flags render writes (--cudagraph-capture-sizes, else
        --max-cudagraph-capture-size)."""
        rendered = serving.capture_sizes
        return G.vllm_sizes(rendered, None if rendered is not None else serving.cudagraph_capture_size,
                            max_num_seqs=serving.max_num_seqs, max_num_batched_tokens=serving.max_num_batched_tokens)

    def gaps_of(sizes: list[int]) -> dict[tuple[str, int], tuple[G.Batch, str]]:
        gaps: dict[tuple[str, int], tuple[G.Batch, str]] = {}
        for release in releases:
            for role, rows in G.uncovered(sizes, s.max_num_seqs, k, draft_q, release).items():
                for b in rows:
                    gaps.setdefault((role, b.reqs), (b, release))
        return gaps

    sizes = sizes_of(s)
    gaps = gaps_of(sizes)
    if not gaps:
        return []
    names = {"target": "verify", "draft": "DSpark draft"}
    said = "; ".join(
        f"{names[role]} batches of {G.ranges([n for r, n in gaps if r == role])} requests "
        f"({', '.join(sorted({f'{b.mode} on {v}' for (r, _), (b, v) in gaps.items() if r == role}))})"
        for role in ("target", "draft") if any(r == role for r, _ in gaps))
    where = "cudagraph_capture_sizes" if given is not None else "max_cudagraph_capture_size"
    if given is not None:
        add = G.sizes_to_add(sizes, s.max_num_seqs, k, draft_q, releases)
        fix = f"add {', '.join(map(str, add))} to it, or remove it for dspark's list"
    else:
        # The smallest largest size that covers every batch (vLLM's own list, which dspark leaves
        # without speculative decoding, steps by 8 up to 256, then by 16).
        top = s.max_num_seqs * (k + 1)
        enough = next((m for m in range(top, top + 17)
                       if not gaps_of(sizes_of(dataclasses.replace(s, max_cudagraph_capture_size=m)))), None)
        if enough is None:  # no largest size does (vLLM drops FULL graphs above max_num_seqs' tokens)
            whole_list = sorted(set(sizes) | set(G.sizes_to_add(sizes, s.max_num_seqs, k, draft_q, releases)))
            fix = f"set cudagraph_capture_sizes = [{', '.join(map(str, whole_list))}] instead"
        else:
            fix = f"raise it to {enough}" + (", or remove it for dspark's list" if k and enough == top else "")
    return [f"serving.{where}: leaves {said} without a FULL CUDA graph (vLLM's model runner v2 replays "
            f"one only at a captured size of at least a batch's tokens, rounded to whole requests); {fix}"]


def check_ranges(c: Cluster) -> list[str]:
    """Every number is finite and within its declared range (the `bounds` of its field)."""
    p: list[str] = []
    parts = [(name, getattr(c, name)) for name in SECTIONS] + [(f"nodes[{i}] ({n.name})", n)
                                                               for i, n in enumerate(c.nodes)]
    for where, obj in parts:
        for f in dataclasses.fields(obj):
            value, bounds = getattr(obj, f.name), f.metadata.get("bounds")
            if bounds is None or value is None or isinstance(value, bool):
                continue
            name = f.name
            if isinstance(value, list):  # a list of numbers: every item within the range
                value = next((v for v in value if not bounds[0] <= v <= bounds[1]), None)
                if value is None:
                    continue
            elif isinstance(value, dict):  # a table of numbers (by name): every value within the range
                name, value = next(((f"{f.name}.{toml_key(k)}", v) for k, v in value.items()
                                    if not bounds[0] <= v <= bounds[1]), (name, None))
                if value is None:
                    continue
            lo, hi = bounds
            positive = f.metadata.get("positive")
            ok = math.isfinite(value) and (lo < value if positive else lo <= value) and value <= hi
            if ok:
                continue
            if f.name.endswith("_s"):
                what = (f"a positive, finite number of seconds (at most {hi:g})" if positive or not lo else
                        f"a positive, finite number of seconds, at least {lo:g} and at most {hi:g}")
            elif isinstance(value, int):
                what = f"a whole number in [{lo:g}, {hi:g}]"
            else:
                what = f"in {'(' if positive else '['}{lo:g}, {hi:g}] (a finite number)"
            p.append(f"{where}.{name}: must be {what}, got {value}; write e.g. "
                     f"{f.name} = {toml_value(f.metadata.get('example'))}")
    return p


def _is_ipv6(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).version == 6
    except ValueError:
        return False


def _not_json(value: Any, where: str, depth: int) -> str | None:
    """Why a table cannot be passed to vLLM as JSON (a TOML date, an infinite number, too deep)."""
    if depth > MAX_DEPTH:
        return f"{where}: nested more than {MAX_DEPTH} levels deep"
    if isinstance(value, dict):
        for k, v in value.items():
            why = _not_json(v, f"{where}.{k}", depth + 1)
            if why:
                return why
        return None
    if isinstance(value, list):
        for i, v in enumerate(value):
            why = _not_json(v, f"{where}[{i}]", depth + 1)
            if why:
                return why
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return f"{where}: {value} is not a finite number"
    if value is None or isinstance(value, (str, int, float, bool)):
        return None
    return f"{where}: a TOML {type(value).__name__} cannot be passed to vLLM; write it as a string or a number"


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
