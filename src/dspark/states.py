"""A node's states and what its supervisor knows about itself (served by the agent, read by
every client: status, wait-worker, local, the dashboard)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from . import __version__

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


@dataclass
class Liveness:
    """The head's last liveness round and the last proof of life (dspark.liveness)."""

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
    runtime_line: str | None = None  # the runtime line this node runs (dspark.line_state)
    file_line: str | None = None     # the cluster file's line (serving.runtime_line)
    line_switch: dict | None = None  # the head: the switch under way (dspark.line_state.Switch), else None
    # What `dspark check` on a peer compares (dspark.preflight.peer.local_identity): the cluster
    # file's SHA-256, the model directory's fingerprint, vLLM's version and sources' SHA-256.
    identity: dict | None = None

    def snapshot(self) -> dict:
        d = asdict(self)
        now = time.time()
        d["uptime_s"] = round(now - self.started_at, 3)
        d["state_for_s"] = round(now - self.state_since, 3)
        d["time"] = now  # this node's clock: a peer's check compares it with its own
        return d
