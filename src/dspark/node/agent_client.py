"""The one client of the node agents (`GET /state`) and the one rule that says a peer is lost.

Used by the supervisor (its peers), `dspark status` and `wait-worker`, `dspark local` and the
dashboard. A connection refused where an agent answered before means its supervisor has
exited; silence for `lost_after_s` means the node (or the path to it) is gone; a node that
reports failed, stopping or stopped is on its way out."""

from __future__ import annotations

from dataclasses import dataclass

from dspark.node.states import FAILED, STOPPED, STOPPING

LEAVING = (FAILED, STOPPING, STOPPED)


@dataclass(frozen=True)
class AgentAnswer:
    state: dict | None     # the agent's /state (an object with a string "state"), or None
    refused: bool = False  # nothing listens on the agent's port: its supervisor is gone
    error: str = ""


def fetch_state(url: str, timeout: float = 2.0) -> AgentAnswer:
    """One `GET /state` from the agent at `url` (its base URL). Never raises."""
    from dspark.net.http import MAX_STATE_BYTES, HTTPFailure, get_object

    try:  # at most MAX_STATE_BYTES and MAX_JSON_DEPTH deep: a hostile peer is "unreachable"
        s = get_object(url.rstrip("/") + "/state", timeout=timeout, max_bytes=MAX_STATE_BYTES)
    except HTTPFailure as e:
        # A refused connection stays distinguishable from a timeout: the supervisor is gone.
        return AgentAnswer(None, refused=e.refused, error=str(e))
    if not isinstance(s.get("state"), str):
        return AgentAnswer(None, error=f"{url}/state: not a node state")
    return AgentAnswer(s)


def agent_state(url: str, timeout: float = 2.0) -> dict | None:
    """The agent's /state, or None when it does not answer with one."""
    return fetch_state(url, timeout).state


def is_lost(answer: AgentAnswer | None, last: dict | None, silent_s: float | None, lost_after_s: float) -> str | None:
    """Why a node whose agent answered `answer` this round is lost, or None.

    `last` is its last /state (this round's when it answered), `silent_s` how long since it
    last answered (None: it never has; a node never seen is not lost, it is not up yet)."""
    if answer is not None and answer.state is not None:
        state = answer.state.get("state")
        return f"it is {state}" if state in LEAVING else None
    if last is None or silent_s is None:
        return None
    if answer is not None and answer.refused:
        return f"its supervisor is gone: connection refused (last reported {last.get('state')})"
    if silent_s >= lost_after_s:
        return f"its agent is unreachable for {silent_s:.0f} s (last reported {last.get('state')})"
    return None
