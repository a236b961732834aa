"""How `dspark serve` starts a node: one path from the parsed options to the exit code.

`startup` does everything between the options and the supervisor: the state directory (systemd's
`a:b` list), the line this node runs, the API key's refusal, the host check (with its wait for a
held port, its STATUS= lines and the signals that end that wait) and the memory plan. It returns
a `Refusal` (the message, the exit code, and whether systemd restarts the node) or a `Plan`,
which `run` supervises (`serve`), turning an OSError of the run into a refusal after the
transient wait. `dspark serve` (dspark.cli.main) only parses its options, calls the two and
reports a refusal, as uvicorn's `run()` does. Nothing here imports click or the command line;
the host check (dspark.preflight, a layer above) is passed in.

The line a node runs is decided in one place, `running_line`: the line its state names (`dspark
switch`), unless the cluster file no longer installs it; then the file's, with a warning.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Protocol

from dspark import log as L
from dspark.config.credentials import api_key_refusal, read_api_key
from dspark.config.schema import Cluster, ConfigError, NodeConfig
from dspark.lines import state as line_state
from dspark.node.events import EXIT_SWITCH
from dspark.node.notify import Notifier
from dspark.node.policy import EXIT_CONFIG, EXIT_RETRY
from dspark.node.signals import SignalQueue
from dspark.node.supervisor import Supervisor, resolve_abandoned

RESTARTED = "systemd restarts the node, which tries again"


# ------------------------------------------------------------------------------ the line
class RunningLine(NamedTuple):
    line: str
    cluster: Cluster  # the cluster as this node runs it on `line`
    warning: str | None  # why the line asked for is not run (the cluster file's instead), or None


def running_line(cluster: Cluster, state_dir: Path | None, wanted: str | None = None) -> RunningLine:
    """The line this node runs: `wanted` (a switch's next line), else the one its state names
    (dspark.lines.state.current: the file's, unless `dspark switch` moved the pair). A line this
    cluster file no longer installs (or a retired one) falls back to the file's own, with a
    warning that says why; the file's own line failing is the cluster file's error (ConfigError)."""
    file_line = cluster.serving.runtime_line
    line = line_state.current(state_dir, file_line).line if wanted is None else wanted
    try:
        return RunningLine(line, cluster.on_line(line), None)
    except ConfigError as e:
        if line == file_line:
            raise
        return RunningLine(file_line, cluster.on_line(file_line),
                           f"{e.problems[0]}; running the cluster file's line {file_line}")


def state_dir_of(value: str | Path | None) -> Path | None:
    """The state directory from --state-dir or $STATE_DIRECTORY: systemd lists several with ':'
    (the first is this node's)."""
    if value is None:
        return None
    return Path(str(value).split(":")[0])


# ------------------------------------------------------------------------------ the outcome
@dataclass(frozen=True)
class Refusal:
    """The start ends here: `message` (one line, or the plan's text after it) and the exit code.
    `retry`: refused for now only (exit 5, restarted by the units). Code 0: a signal stopped the
    wait (the message is a plain line, not an error)."""

    message: str
    code: int
    retry: bool = False


@dataclass
class Plan:
    """What `run` needs: the cluster file's cluster and this node's entry, the line decided (its
    cluster is what the checks and the plan saw), and the start's state."""

    cluster: Cluster
    node: NodeConfig
    line: RunningLine
    state_dir: Path | None
    identity: dict | None
    signals: SignalQueue
    notify: Notifier  # STATUS= and EXTEND_TIMEOUT_USEC= while the start waits (the supervisor has its own)
    started: float  # time.monotonic() when the command began: the transient wait counts from it
    transient_wait_s: float


class GateVerdict(Protocol):
    @property
    def identity(self) -> dict: ...
    @property
    def refusal(self) -> str | None: ...
    @property
    def retry(self) -> bool: ...
    @property
    def signal(self) -> int | None: ...


class Gate(Protocol):
    """The host check's gate (dspark.preflight.gate)."""

    def __call__(self, cluster: Cluster, node: NodeConfig, say: Callable[[str], None], *, port_wait_s: float,
                 wait: Callable[[float], int | None] | None,
                 waiting: Callable[[float, str], None] | None) -> GateVerdict: ...


# ------------------------------------------------------------------------------ the start
def startup(cluster: Cluster, node: NodeConfig, *, state_dir: str | Path | None, signals: SignalQueue,
            say: Callable[[str], None], gate: Gate | None, identity: Callable[[Cluster], dict],
            skip_plan: bool = False, transient_wait_s: float = 0.0, started: float | None = None,
            notify: Notifier | None = None) -> Plan | Refusal:
    """Everything `dspark serve` does before it supervises: a Plan, or the Refusal that ends the
    start. `gate`: the host check (`--check`), None to skip it; `identity`: this node's identity
    without the checks; `say`: where the check's lines go (stderr). `signals`: the queue the
    command installed first thing, which ends a wait."""
    started = time.monotonic() if started is None else started
    state = state_dir_of(state_dir)
    line = running_line(cluster, state)  # the checks and the plan see the line this node runs
    if line.warning:
        L.line(logging.WARNING, f"dspark[{node.name}]: {line.warning}")
    running = line.cluster
    if node.is_head:  # the API is the head's: a key file it was given must hold a key
        refusal = api_key_refusal()
        if refusal:
            return Refusal(refusal, EXIT_CONFIG)
    notify = notify if notify is not None else Notifier()
    try:
        checked = _checks(running, node, signals, say, gate, identity, skip_plan, transient_wait_s, notify)
    except BaseException:
        notify.close()
        raise
    if isinstance(checked, Refusal):
        notify.close()
        return checked
    return Plan(cluster, node, line, state, checked, signals, notify, started, transient_wait_s)


def _checks(running: Cluster, node: NodeConfig, signals: SignalQueue, say: Callable[[str], None],
            gate: Gate | None, identity: Callable[[Cluster], dict], skip_plan: bool, transient_wait_s: float,
            notify: Notifier) -> dict | Refusal:
    """The host check (with its wait) and the memory plan, on the line this node runs: this
    node's identity, or the Refusal."""
    if gate is not None:
        verdict = gate(running, running.node(node.name), say=say, port_wait_s=transient_wait_s, wait=signals.get,
                       waiting=lambda seconds, text: _waiting(notify, seconds, text))
        if verdict.signal is not None:
            return _stopped_by(verdict.signal, verdict.refusal or "stopped")
        if verdict.refusal and verdict.retry:
            notify.status(verdict.refusal)
            return Refusal(f"{verdict.refusal}; exit {EXIT_RETRY}: {RESTARTED}", EXIT_RETRY, retry=True)
        if verdict.refusal:
            return Refusal(verdict.refusal, EXIT_CONFIG)
        ident = verdict.identity
    else:
        ident = identity(running)
    if not skip_plan:
        refusal = _plan_refusal(running)
        if refusal:
            return Refusal(refusal, EXIT_CONFIG)
    return ident


def _plan_refusal(running: Cluster) -> str | None:
    from dspark.plan.facts import PlanError
    from dspark.plan.from_cluster import plan_for_cluster

    try:
        plan = plan_for_cluster(running)
    except PlanError as e:
        return f"refusing to start: plan: {e}"
    if not plan.fits:
        return "refusing to start: the memory plan does not fit\n" + plan.render_text()
    return None


def run(plan: Plan, explain: Callable[[OSError], tuple[str, bool]]) -> int | Refusal:
    """Supervise (`serve`) until stopped: the exit code. An OSError of the run (the agent's port
    taken, the state directory full, vLLM's command not found) is a Refusal: `explain(e)` gives
    its words and whether it can clear; one that can waits out the transient wait first."""
    try:
        try:
            return serve(plan.cluster, plan.node, state_dir=plan.state_dir, signals=plan.signals,
                         identity=plan.identity, said=plan.line.warning)
        except OSError as e:
            message, retry = explain(e)
            if not retry:
                return Refusal(message, EXIT_CONFIG)
            # Not at once: a start that fails within seconds, restarted every RestartSec=, would
            # reach the units' start limit in a minute and stay down for good.
            left = plan.started + plan.transient_wait_s - time.monotonic()
            if left > 0:
                _waiting(plan.notify, left, f"{message}; exit {EXIT_RETRY} in {left:.0f} s: {RESTARTED}")
                sig = plan.signals.get(left)
                if sig is not None:
                    return _stopped_by(sig, message)
            return Refusal(f"{message}; exit {EXIT_RETRY}: {RESTARTED}", EXIT_RETRY, retry=True)
    finally:
        plan.notify.close()


def _waiting(notify: Notifier, seconds: float, line: str) -> None:
    """A start that waits: a warning in the journal, the line as `systemctl status` shows it,
    and systemd's start timeout kept ahead of the wait."""
    L.line(logging.WARNING, line, sys.stderr)
    notify.status(line)
    notify.extend_timeout(seconds + 30)


def _stopped_by(sig: int, why: str) -> Refusal:
    """A signal ended a wait before the start: SIGTERM and SIGINT stop (exit 0), SIGHUP restarts."""
    if sig == signal.SIGHUP:
        return Refusal(f"{why}; SIGHUP: restarting", EXIT_RETRY, retry=True)
    return Refusal(f"{why}; {signal.Signals(sig).name}: stopped", 0)


# ------------------------------------------------------------------------------ the runs
def serve(cluster: Cluster, node: NodeConfig, *, state_dir: Path | None = None,
          signals: SignalQueue | None = None, identity: dict | None = None, said: str | None = None) -> int:
    """Supervise until stopped; the exit code. One Supervisor per run: a switch's next run, on
    the new line, follows in this process. `signals`: a queue installed earlier (the CLI installs
    it first thing, so that no signal is lost while the cluster file is read). `identity`: what
    the agent reports for a peer's `dspark check` (dspark.preflight.node_identity.local_identity). `said`:
    the line warning `startup` already gave (not repeated)."""
    # The restart backoff only matters where something restarts the node: under systemd.
    signals = signals or SignalQueue().install()
    api_key, backoff = read_api_key(), "INVOCATION_ID" in os.environ
    file_line = cluster.serving.runtime_line
    if node.is_head and state_dir is not None:  # a switch killed while this head was down: gone on with first
        resolve_abandoned(state_dir, file_line, cluster.supervisor, f"the head ({node.name}) at its start", None,
                          lambda msg, level: L.line(level, f"dspark[{node.name}]: {msg}"))
    st = line_state.current(state_dir, file_line)
    wanted, switching, first = st.line, st.switch is not None, True
    while True:
        line, on_line, warning = running_line(cluster, state_dir, wanted)
        if warning:
            # The state names a line this cluster file no longer installs (or a retired one): back
            # to the file's, and the state says so, or the head's watch of it would switch again.
            if warning != said:
                L.line(logging.WARNING, f"dspark[{node.name}]: {warning}")
            if state_dir is not None:
                line_state.write(state_dir, line_state.LineState(file_line, file_line))
        said = None
        sup = Supervisor(on_line, on_line.node(node.name), state_dir=state_dir, api_key=api_key,
                         backoff=backoff and first, signals=signals, file_line=file_line, switching=switching,
                         count_start=first)
        sup.state.identity = identity
        code = sup.run()
        to = sup.policy.switch_to
        if code != EXIT_SWITCH or not to:
            return code
        if node.is_head and state_dir is not None:
            # The line the head's state names now: a switch interrupted while this run drained for
            # it (a rollback before the head moved) goes straight back, not through the new line.
            to = line_state.current(state_dir, file_line).line
        elif state_dir is not None:
            # A worker keeps the pair's line, so that it comes back on it after a restart alone.
            # Not kept (a full or read-only state directory) costs only that: it follows its head.
            try:
                line_state.write(state_dir, line_state.LineState(to, file_line))
            except OSError as e:
                sup.say(f"cannot keep the pair's runtime line {to} in {state_dir}: {e.strerror}; following the "
                        f"head onto it all the same (restarted alone, this worker starts on "
                        f"{line_state.current(state_dir, file_line).line} and follows its head again)",
                        logging.WARNING)
        sup.say(f"going on on runtime line {to}")
        wanted, switching, first = to, True, False
