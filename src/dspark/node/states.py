"""A node's states and what its supervisor knows about itself (served by the agent, read by
every client: status, wait-worker, local, the dashboard)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from dspark import __version__
from dspark.node import host_memory

# Node states, in the order a healthy start passes through them.
STARTING = "starting"
RENDEZVOUS = "rendezvous"
LOADING = "loading"
WARMING = "warming"
SERVING = "serving"
STOPPING = "stopping"
STOPPED = "stopped"
FAILED = "failed"
STATES = (STARTING, RENDEZVOUS, LOADING, WARMING, SERVING, STOPPING, STOPPED, FAILED)

# What to do about a worker that is not in the rendezvous (the head's supervisor, wait-worker).
START_WORKERS_FIRST = ("start every worker first (systemctl start dspark-worker on its host; "
                       "dspark-worker@NODE where one host runs several)")

# The node's recent events (NodeState.events, served by the agent, merged by the dashboard into its
# timeline): a bounded ring, oldest first. Kinds:
#   start, restart  a run of the supervisor begins (restart: the service was restarted since its
#                   last clean start; "switch": the run that goes on on another runtime line)
#   backoff         the restart backoff holds the start back
#   stage           rendezvous, loading, warming
#   serving         vLLM serves (the head: the API answered a real completion)
#   liveness        the head's liveness verdict changed (alive, or not alive and why)
#   switch          the head's state names a runtime-line switch (or its rollback), or no longer does
#   drain, stopping, stopped, failed   the stop: drained (requests in flight finish), plain, done, a fault
EVENTS_MAX = 64
EVENT_DETAIL_MAX = 240
EVENT_KINDS = ("start", "restart", "switch", "backoff", "stage", "serving", "liveness", "drain", "stopping",
               "stopped", "failed")


@dataclass
class Liveness:
    """The head's last liveness round and the last proof of life (dspark.node.liveness)."""

    ok: bool                          # the last round found the engine alive
    at: float                         # unix time of that round
    latency_s: float | None = None    # the last 1-token probe's latency, when one ran
    error: str | None = None          # why the last round did not find it alive
    proof: str | None = None          # what proved it alive last: "progress" or "probe"
    proof_at: float | None = None     # unix time of that proof
    proof_detail: str = ""


@dataclass
class NodeState:
    """What a node's supervisor knows about itself; the agent serves a snapshot of it."""

    node: str
    rank: int
    role: str
    state: str = STARTING
    detail: str = ""
    vllm_pid: int | None = None
    vllm_version: str | None = None
    restarts: int = 0
    started_at: float = field(default_factory=time.time)
    state_since: float = field(default_factory=time.time)
    liveness: Liveness | None = None
    api_url: str | None = None
    dspark_version: str = __version__
    runtime_line: str | None = None  # the runtime line this node runs (dspark.lines.state)
    file_line: str | None = None     # the cluster file's line (serving.runtime_line)
    line_switch: dict | None = None  # the head: the switch under way (dspark.lines.state.Switch), else None
    # What `dspark check` on a peer compares (dspark.preflight.node_identity.local_identity): the cluster
    # file's SHA-256, the model directory's fingerprint, vLLM's version and sources' SHA-256.
    identity: dict | None = None
    # This run goes on in the same process after a runtime-line switch (dspark.node.startup.serve):
    # its start is recorded as the switch's, not as a restart.
    resumed: bool = False
    # The recent events (EVENT_KINDS), oldest first, at most EVENTS_MAX: {"at", "kind", "detail"}.
    # Recorded by record_state (the supervisor's set_state) and, on assignment, by a change of the
    # liveness verdict or of the head's line_switch (__setattr__). Declared last: the hooks start
    # recording once it exists, not during __init__.
    events: list[dict] = field(default_factory=list)

    def record(self, kind: str, detail: str = "", at: float | None = None) -> None:
        """Append an event to the ring (the oldest goes once it holds EVENTS_MAX)."""
        events = self.__dict__.get("events")
        if events is None:
            return
        events.append({"at": round(time.time() if at is None else at, 3), "kind": kind,
                       "detail": detail[:EVENT_DETAIL_MAX]})
        del events[:-EVENTS_MAX]

    def record_state(self, state: str, detail: str = "") -> None:
        """The supervisor is about to show `state` (with `detail`): recorded when the state changes,
        or when the same state turns into another kind of event (a start held back by the backoff)."""
        kind = event_kind(state, detail, self.restarts, self.resumed)
        last = self.events[-1]["kind"] if self.events else None
        if state == self.state and kind == last:
            return
        if kind in ("start", "restart", "switch"):
            where = f"runtime line {self.runtime_line}" if self.runtime_line else ""
            what = {"start": "", "restart": f"restart {self.restarts}",
                    "switch": "going on after a runtime-line switch"}[kind]
            detail = "; ".join(x for x in (what, detail, where) if x)
        elif kind == "stage":
            detail = f"{state}: {detail}" if detail else state
        self.record(kind, detail)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "liveness" and isinstance(value, Liveness):
            before = self.__dict__.get("liveness")
            if not isinstance(before, Liveness) or before.ok != value.ok:
                self.record("liveness", _verdict(value), value.at)
        elif name == "line_switch" and "events" in self.__dict__:
            before = self.__dict__.get("line_switch")
            if isinstance(value, dict) and (not isinstance(before, dict) or before.get("id") != value.get("id")):
                self.record("switch", _switch_text(value, "under way"))
            elif value is None and isinstance(before, dict):
                self.record("switch", _switch_text(before, "ended"))
        super().__setattr__(name, value)

    def snapshot(self) -> dict:
        d = asdict(self)
        now = time.time()
        d["uptime_s"] = round(now - self.started_at, 3)
        d["state_for_s"] = round(now - self.state_since, 3)
        d["time"] = now  # this node's clock: a peer's check compares it with its own
        # This host's memory (on a GB10 the unified memory the GPU shares): dspark.node.host_memory.
        d["memory"] = host_memory.read()
        return d


def event_kind(state: str, detail: str, restarts: int = 0, resumed: bool = False) -> str:
    """The kind of event a node entering `state` (with `detail`) records (EVENT_KINDS)."""
    if state == STARTING:
        if "backoff" in detail:
            return "backoff"
        return "switch" if resumed else "restart" if restarts > 0 else "start"
    if state in (RENDEZVOUS, LOADING, WARMING):
        return "stage"
    if state == STOPPING:
        return "drain" if "draining" in detail else "stopping"
    return state  # serving, stopped, failed


def _verdict(live: Liveness) -> str:
    if live.ok:
        how = f" ({live.proof}: {live.proof_detail})" if live.proof and live.proof_detail else ""
        return "alive" + how
    return "not alive" + (f": {live.error}" if live.error else "")


def _switch_text(sw: dict, what: str) -> str:
    kind = "rollback" if sw.get("rollback") is True else "switch"
    sid = sw.get("id")
    return (f"runtime-line {kind} {sw.get('from')} → {sw.get('to')} {what}" +
            (f" ({sid})" if isinstance(sid, str) and sid else ""))
