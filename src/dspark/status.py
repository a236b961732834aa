"""Clients of the node agents and the head's API: `dspark wait-worker` and `dspark status`."""

from __future__ import annotations

import json
import time
from typing import Any, Callable

from . import states as A
from .agent_client import agent_state  # the one client of the agents (re-exported)
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


def collect(cluster: Cluster, token: str | None = None) -> dict:
    """Both nodes' agents and the head's API in one snapshot."""
    nodes = []
    for n in sorted(cluster.nodes, key=lambda n: n.rank):
        s = agent_state(n.agent_url)
        nodes.append({"name": n.name, "rank": n.rank, "agent": n.agent_url, "reachable": s is not None,
                      "state": (s or {}).get("state", "unreachable"), "detail": (s or {}).get("detail", ""),
                      "runtime_line": (s or {}).get("runtime_line"), "line_switch": (s or {}).get("line_switch"),
                      "vllm_pid": (s or {}).get("vllm_pid"), "vllm_version": (s or {}).get("vllm_version"),
                      "restarts": (s or {}).get("restarts"), "uptime_s": (s or {}).get("uptime_s"),
                      "liveness": (s or {}).get("liveness")})
    api: dict[str, Any] = {"url": cluster.head.api_url, "health": None, "version": None}
    try:
        api["health"] = request(cluster.head.api_url + vllm_facts.HEALTH, timeout=2.0, token=token).status
        api["version"] = get_object(cluster.head.api_url + vllm_facts.VERSION, timeout=2.0, token=token).get("version")
    except (HTTPFailure, KeyError, TypeError):
        pass
    serving = all(n["state"] == A.SERVING for n in nodes) and api["health"] == 200
    return {"serving": serving, "nodes": nodes, "api": api}


def render_table(snap: dict) -> str:
    rows = [("NODE", "RANK", "STATE", "LINE", "VLLM PID", "RESTARTS", "UPTIME", "DETAIL")]
    for n in snap["nodes"]:
        up = n["uptime_s"]
        rows.append((n["name"], str(n["rank"]), n["state"], n.get("runtime_line") or "-", str(n["vllm_pid"] or "-"),
                     str(n["restarts"] if n["restarts"] is not None else "-"),
                     f"{up:.0f}s" if up is not None else "-", n["detail"]))
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
            what = "rolling back" if sw.get("rollback") else "switching"
            lines.append(f"runtime line: {what} {sw.get('from')} -> {sw.get('to')} ({sw.get('id')}; dspark switch "
                         "--history on the head)")
    lines.append("pair: SERVING" if snap["serving"] else "pair: NOT SERVING")
    return "\n".join(lines)


def liveness_line(live: dict, now: float | None = None) -> str:
    """'alive by progress 3 s ago: ...' from an agent's liveness report."""
    now = time.time() if now is None else now
    head = "alive" if live.get("ok") else f"NOT ALIVE ({live.get('error') or 'no proof yet'})"
    proof, at = live.get("proof"), live.get("proof_at")
    if proof not in ("progress", "probe") or not isinstance(at, (int, float)):
        return head + "; no proof of life yet"
    return f"{head}; last proof: {proof}, {max(0.0, now - at):.0f} s ago ({live.get('proof_detail') or ''})"


def to_json(snap: dict) -> str:
    return json.dumps(snap, indent=2)
