"""Clients of the node agents and the head's API: `dspark wait-worker` and `dspark status`."""

from __future__ import annotations

import json
import math
import time
from typing import Any, Callable, TypeGuard

from . import states as A
from .agent_client import AgentAnswer, agent_state, fetch_state  # the one client of the agents (re-exported)
from . import vllm_facts
from .config import Cluster
from .http import HTTPFailure, get_object, request

WORKER_READY_STATES = (A.RENDEZVOUS, A.SERVING)


def wait_for_workers(
    cluster: Cluster,
    timeout_s: float,
    keep_going: Callable[[list[str]], bool] | None = None,
    states: tuple[str, ...] = WORKER_READY_STATES,
    poll_s: float = 0.5,
) -> tuple[bool, str]:
    """Block until every worker's agent reports one of `states`. Returns (ok, message).

    `keep_going(waiting_names)` is called each round; returning False stops the wait."""
    deadline = time.monotonic() + timeout_s
    last: dict[str, str] = {}
    while True:
        waiting = []
        for w in cluster.workers:
            s = agent_state(w.agent_url, timeout=min(2.0, poll_s * 4))
            last[w.name] = (s or {}).get("state", "unreachable")
            theirs, mine = (s or {}).get("runtime_line"), cluster.serving.runtime_line
            same_file = (s or {}).get("file_line") == mine  # then the worker follows its head's line
            if isinstance(theirs, str) and theirs and theirs != mine and not same_file:
                return False, (f"{w.name} runs runtime line {theirs}, this cluster file says {mine}: "
                               "a pair does not form on two lines; put every node on one line "
                               "(serving.runtime_line in the same cluster file on every node)")
            if last[w.name] not in states:
                waiting.append(w.name)
        if not waiting:
            return True, "ready: " + ", ".join(f"{n} {st}" for n, st in last.items())
        if keep_going is not None and not keep_going(waiting):
            return False, "interrupted"
        if time.monotonic() >= deadline:
            seen = ", ".join(f"{n} at {cluster.node(n).agent_url} is {last[n]}" for n in waiting)
            return False, (f"worker not ready after {timeout_s:g} s: {seen}; "
                           + A.START_WORKERS_FIRST)
        time.sleep(poll_s)


def _text(v: Any) -> bool:
    return isinstance(v, str)


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _pid(v: Any) -> bool:
    return _count(v) and v > 0


def _seconds(v: Any) -> TypeGuard[float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _object(v: Any) -> bool:
    return isinstance(v, dict)


# The fields of an agent's /state that status shows, each with the type it must have. A value of
# another type (a peer's bug or a hostile answer) is left out of the snapshot and named in the
# node's "invalid" list: the table shows "?" there, the rest of the row as usual.
AGENT_FIELDS: dict[str, Callable[[Any], bool]] = {
    "detail": _text, "runtime_line": _text, "line_switch": _object, "vllm_pid": _pid, "vllm_version": _text,
    "restarts": _count, "uptime_s": _seconds, "liveness": _object}


def node_row(name: str, rank: int, agent_url: str, answer: AgentAnswer) -> dict:
    """One node of the snapshot from its agent's answer: every AGENT_FIELDS field of the type
    it must have or None; an unreachable node's detail says why it is."""
    s = answer.state or {}
    row: dict[str, Any] = {"name": name, "rank": rank, "agent": agent_url, "reachable": answer.state is not None,
                           "state": s.get("state", "unreachable")}  # a str: fetch_state refuses any other
    invalid = []
    for field, valid in AGENT_FIELDS.items():
        value = s.get(field)
        if value is not None and not valid(value):
            invalid.append(field)
            value = None
        row[field] = value
    if row["detail"] is None and "detail" not in invalid:
        row["detail"] = "" if answer.state is not None else answer.error
    row["invalid"] = invalid
    return row


def collect(cluster: Cluster, token: str | None = None) -> dict:
    """Both nodes' agents and the head's API in one snapshot."""
    nodes = [node_row(n.name, n.rank, n.agent_url, fetch_state(n.agent_url))
             for n in sorted(cluster.nodes, key=lambda n: n.rank)]
    api: dict[str, Any] = {"url": cluster.head.api_url, "health": None, "version": None}
    try:
        api["health"] = request(cluster.head.api_url + vllm_facts.HEALTH, timeout=2.0, token=token).status
        version = get_object(cluster.head.api_url + vllm_facts.VERSION, timeout=2.0, token=token).get("version")
        api["version"] = version if isinstance(version, str) else None
    except HTTPFailure:
        pass
    serving = all(n["state"] == A.SERVING for n in nodes) and api["health"] == 200
    return {"serving": serving, "nodes": nodes, "api": api}


def _cell(node: dict, field: str, show: Callable[[Any], str] = str, absent: str = "-") -> str:
    """A node's field for the table: `?` when the agent sent it with the wrong type."""
    if field in node.get("invalid", ()):
        return "?"
    value = node.get(field)
    return absent if value is None else show(value)


def _said(value: Any) -> str:
    """A free-text field inside an agent's nested report (liveness, line_switch), as text."""
    return value if isinstance(value, str) else "?"


def render_table(snap: dict) -> str:
    rows = [("NODE", "RANK", "STATE", "LINE", "VLLM PID", "RESTARTS", "UPTIME", "DETAIL")]
    for n in snap["nodes"]:
        rows.append((n["name"], str(n["rank"]), n["state"], _cell(n, "runtime_line") or "-", _cell(n, "vllm_pid"),
                     _cell(n, "restarts"), _cell(n, "uptime_s", lambda up: f"{up:.0f}s"),
                     _cell(n, "detail", absent="")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
    api = snap["api"]
    health = api["health"] if api["health"] is not None else "unreachable"
    lines.append("")
    lines.append(f"API {api['url']}  /health {health}  vLLM {api['version'] or '-'}")
    for n in snap["nodes"]:
        live = n.get("liveness")
        if isinstance(live, dict):
            lines.append(f"liveness ({n['name']}): {liveness_line(live)}")
    for n in snap["nodes"]:
        sw = n.get("line_switch")
        if isinstance(sw, dict):
            what = "rolling back" if sw.get("rollback") is True else "switching"
            lines.append(f"runtime line: {what} {_said(sw.get('from'))} -> {_said(sw.get('to'))} "
                         f"({_said(sw.get('id'))}; dspark switch --history on the head)")
    lines.append("pair: SERVING" if snap["serving"] else "pair: NOT SERVING")
    return "\n".join(lines)


def liveness_line(live: dict, now: float | None = None) -> str:
    """'alive by progress 3 s ago: ...' from an agent's liveness report."""
    now = time.time() if now is None else now
    error = live.get("error")
    head = "alive" if live.get("ok") is True else f"NOT ALIVE ({_said(error) if error else 'no proof yet'})"
    proof, at, detail = live.get("proof"), live.get("proof_at"), live.get("proof_detail")
    if proof not in ("progress", "probe") or not _seconds(at):
        return head + "; no proof of life yet"
    return f"{head}; last proof: {proof}, {max(0.0, now - at):.0f} s ago ({_said(detail) if detail else ''})"


def to_json(snap: dict) -> str:
    return json.dumps(snap, indent=2)
