"""The cluster file's cross-field checks (`check`): the contradictions between fields that no
single field's type catches, each returned line naming the fields and the fix. `check_ranges`
keeps every number within its field's declared `bounds`; the nodes' names, addresses, roles and
ports are checked here, vLLM's command line in dspark.config.command_line and the runtime line and
CUDA-graph coverage in dspark.config.line_checks. dspark.config.validate runs `check` on every
Cluster it builds.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import re
import unicodedata
from typing import Any

from dspark.config.command_line import check_command_line
from dspark.config.line_checks import graph_coverage_problems, runtime_line_problems
from dspark.config.schema import SECTIONS, Cluster
from dspark.config.toml import toml_key, toml_value

# How deep a table may nest: the cluster file itself (dspark.config.validate.load) and a table
# passed to vLLM as JSON (speculative_config).
MAX_DEPTH = 8
# The modalities vLLM's --limit-mm-per-prompt takes (config/multimodal.py MultiModalDummyOptionsBuiltins,
# 0.28.0 and 0.32.0).
MODALITIES = ("image", "video", "audio")
# Environment names: what a POSIX shell can assign and systemd's Environment= accepts.
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# What a host name may be (RFC 1123 labels, 253 characters at most).
_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


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
    p += graph_coverage_problems(s)
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
    p += runtime_line_problems(s)

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
    p += check_command_line(c)
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
