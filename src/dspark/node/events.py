"""What the node policy (dspark.node.policy) is told and what it answers: the `Events` the
supervisor gathers each tick (a signal, vLLM's exit, its log's stage, finished probes) and the
`Action`s it carries out, with the enums that name their kinds, the policy's phases and a run's
history verdict. Pure: no I/O, so that the policy stays a state machine on a fake clock."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dspark.node.agent_client import AgentAnswer
from dspark.node.liveness import Progress, Verdict
from dspark.node.states import Liveness

if TYPE_CHECKING:  # a type alone: the policy imports no config parsing
    from dspark.config.schema import SupervisorConfig

# Not an exit code: the run ends to go on at once on another runtime line (dspark.node.startup.serve
# starts the next run in the same process; `switch_to` names the line).
EXIT_SWITCH = 75
PEERS_POLL_S = 1.0  # the peers' agents are polled this often (faster while a head waits for its workers)


class ActionKind(enum.StrEnum):
    """What the supervisor does for an `Action` (the values are those its logs and tests read)."""

    STATE = "state"                    # show a state (state, detail)
    EXTEND = "extend"                  # EXTEND_TIMEOUT_USEC (seconds)
    START_VLLM = "start_vllm"
    READY = "ready"                    # READY=1, with detail
    READY_PROBE = "ready_probe"        # start one in the background
    LIVENESS_ROUND = "liveness_round"  # start one in the background
    POLL_PEERS = "poll_peers"          # start one in the background
    RECORD_ROUND = "record_round"      # record the policy's last verdict and probe
    RECORD_PROBE = "record_probe"      # a failed pre-ready completion
    WATCHDOG = "watchdog"
    CLEAR_HISTORY = "clear_history"
    SAY = "say"                        # a log line (detail)
    DRAIN = "drain"                    # SIGTERM to vLLM's API process alone: it drains (seconds: drain_s)
    STOP = "stop"                      # stop vLLM; state/detail: how the node is shown meanwhile
    EXIT = "exit"                      # code, history


class Phase(enum.StrEnum):
    """Where the policy is: backoff -> workers (a head waiting for its workers) -> vllm ->
    [draining] -> done; held: a failure during a switch, waiting for the pair's line to change."""

    INIT = "init"
    BACKOFF = "backoff"
    WORKERS = "workers"
    VLLM = "vllm"
    DRAINING = "draining"
    HELD = "held"
    DONE = "done"


class History(enum.StrEnum):
    """What an exit does to the failure history: clear it, keep it, or count one more failure."""

    CLEAR = "clear"
    KEEP = "keep"
    FAIL = "fail"


@dataclass(frozen=True)
class ReadyProbe:
    """Before ready (the head): /health, then a 1-token completion once /health answers."""

    healthy: bool
    live: Liveness | None = None        # the completion, when /health answered
    progress: Progress | None = None    # /metrics after a good completion (the judge's baseline)
    version: str | None = None


@dataclass(frozen=True)
class Round:
    """One liveness round's outcome: the judge's verdict, the probe when one ran, and when."""

    verdict: Verdict
    probe: Liveness | None
    at: float  # the judge's clock


@dataclass
class Events:
    signal: int | None = None
    vllm_exit: int | None = None          # vLLM's exit code, once it has exited
    stage: str = "starting"               # the stage vLLM's log has reached
    ready_probe: ReadyProbe | None = None  # a finished pre-ready probe (the head)
    round: Round | None = None            # a finished liveness round (the head, once ready)
    peers: dict[str, AgentAnswer] | None = None  # a finished poll of the peers' (workers') agents
    running: frozenset[str] = frozenset()  # background probes still running: "ready_probe", "round", "peers"
    wanted_line: str | None = None        # the head: the line its state says the pair runs (dspark.lines.state)
    switching: bool | None = None         # the head: a switch is under way (its state's switch record)


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    state: str = ""
    detail: str = ""
    code: int = 0
    seconds: float = 0.0
    history: History | None = None  # for EXIT
    at_once: bool = False  # for STOP: SIGKILL without stop_grace_s (a drain that overran had its time)


@dataclass
class Peer:
    name: str
    url: str
    is_head: bool
    started_at: float | None = None   # the peer's incarnation when the pair formed
    last: dict | None = None          # its last /state
    last_seen: float | None = None
    stopping_since: float | None = None  # a head seen draining (STOPPING) since then


@dataclass
class Limits:
    """The supervisor settings the policy needs (config.SupervisorConfig has them all)."""

    ready_timeout_s: float
    liveness_interval_s: float
    head_lost_s: float
    rendezvous_timeout_s: float
    worker_wait_timeout_s: float
    drain_s: float = 0.0        # a planned stop of the serving head drains this long (0: no drain)
    stop_grace_s: float = 30.0  # and vLLM then has this long to exit

    @classmethod
    def of(cls, sup: SupervisorConfig) -> Limits:
        return cls(sup.ready_timeout_s, sup.liveness_interval_s, sup.head_lost_s, sup.rendezvous_timeout_s,
                   sup.worker_wait_timeout_s, sup.drain_s, sup.stop_grace_s)
