"""`dspark serve`: the one long-running process per node, the systemd unit's main process.

The supervisor wires four parts together and owns the one loop that acts:
  dspark.node.vllm_process  the vLLM child (start, stop, log pump and the stage its log announces)
  dspark.node.probes        /health, the 1-token completion, /metrics progress, the peers' agents;
                       each runs in the background, never in the loop
  dspark.node.policy   the head/worker state machine: ready, live, broken pair, backoff, exit
                       (its events and actions: dspark.node.events; following the head's
                       runtime line: dspark.node.line_follow)
  dspark.node.signals       handlers that only queue the signal; the loop waits on that queue, so a
                       signal is acted on at once, whatever a probe is doing
and speaks sd_notify, serves the node agent and keeps the failure history (restart backoff).
One Supervisor is one run on one runtime line; dspark.node.startup starts the node and runs
them (a switch's next run follows in the same process).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO, assert_never

from dspark import log as L
from dspark.config.schema import Cluster, NodeConfig, SupervisorConfig
from dspark.files import state_io
from dspark.files.safe_read import parse_json
from dspark.lines import history as switch_history
from dspark.lines import state as line_state
from dspark.node import hardware
from dspark.node import states as S
from dspark.node.agent import Agent
from dspark.node.events import Action, ActionKind, Events, History, Limits, Peer, Phase
from dspark.node.launch import Launch, render
from dspark.node.liveness import LivenessJudge
from dspark.node.notify import Notifier
from dspark.node.policy import EXIT_DIED, EXIT_OK, NodePolicy
from dspark.node.probes import Background, VllmProbes, liveness_round, poll_agents, ready_probe
from dspark.node.rdma import resolve_gid_index
from dspark.node.signals import SignalQueue
from dspark.node.vllm_process import GROUP_GONE_S, VllmProcess

FAILURES_FILE = "failures.json"
STARTS_FILE = "starts"
ABANDONED_CHECK_S = 2.0  # the head's look for a switch whose dspark switch is gone, while its state has one
STOPPED_LINGER_S = 1.5  # how long the agent keeps answering after a clean stop
# Counters read back from the state directory are clamped: backoff_delay's 5 * 2**(n - 2) s is
# past a float's range from n = 1026 (about 14 days of a node waiting for its peer), and has
# long been BACKOFF_MAX_S by n = 8.
MAX_FAILURES = 1000
MAX_STARTS = 10**9
MAX_STARTS_BYTES = 64  # a count and a newline


class FailureHistory:
    """This node's consecutive failed runs, in the state directory across restarts.

    A run counts as failed from its start (a kill -9 or a watchdog abort leaves no chance to
    write anything) until it has served BACKOFF_STABLE_S or stops cleanly."""

    def __init__(self, state_dir: Path):
        self.path = Path(state_dir) / FAILURES_FILE

    def load(self) -> tuple[int, str]:
        """(consecutive failed runs, the last one's reason); a file of another shape is moved aside
        (dspark.files.state_io) and the node starts without a backoff."""
        return state_io.read_state(self.path, _parse_failures, (0, ""), default_is="no failed runs (no backoff)")

    def save(self, consecutive: int, last: str = "") -> None:
        try:
            state_io.write_atomic(self.path, json.dumps({"consecutive": min(max(0, consecutive), MAX_FAILURES),
                                                         "last": last, "at": time.time()}) + "\n")
        except OSError:
            pass


def _parse_failures(data: bytes) -> tuple[int, str]:
    d = parse_json(data, max_bytes=state_io.MAX_STATE_BYTES, max_depth=state_io.STATE_JSON_DEPTH)
    if not isinstance(d, dict):
        raise state_io.CorruptState(f"{state_io.json_kind(d)}, not an object")
    n, last = d.get("consecutive", 0), d.get("last", "")
    if isinstance(n, bool) or not isinstance(n, int):
        raise state_io.CorruptState(f"consecutive is {state_io.json_kind(n)} ({str(n)[:40]}), not a count")
    if not isinstance(last, str):
        raise state_io.CorruptState(f"last is {state_io.json_kind(last)}, not a text")
    return min(max(0, n), MAX_FAILURES), last


class Supervisor:
    def __init__(
        self,
        cluster: Cluster,
        node: NodeConfig,
        *,
        notifier: Notifier | None = None,
        env: dict[str, str] | None = None,
        state_dir: Path | None = None,
        launch: Launch | None = None,
        log: TextIO | None = None,
        api_key: str | None = None,
        tick_s: float = 0.1,
        backoff: bool = False,
        signals: SignalQueue | None = None,
        file_line: str | None = None,
        switching: bool = False,
        count_start: bool = True,
    ):
        self.cluster = cluster
        self.node = node
        self.sup = cluster.supervisor
        self.notify = notifier if notifier is not None else Notifier()
        self.log = log or sys.stderr
        self.tick_s = tick_s
        self.signals = signals if signals is not None else SignalQueue()
        self.history = FailureHistory(state_dir) if backoff and state_dir is not None else None
        self.state_dir = state_dir
        # A RoCE GID of `auto` is looked up when vLLM is launched (_start_vllm), not here: the
        # constructor touches nothing of the host.
        self._gid_pending = launch is None and node.gid_index == "auto" and bool(node.rdma_device)
        self.vllm = VllmProcess(launch if launch is not None else render(cluster, node),
                                dict(os.environ if env is None else env), api_key=api_key)
        # Probes (and the key) go only to the vLLM this supervisor started: its process group,
        # once it runs (dspark.node.port_owner).
        self.probes = VllmProbes(node.api_url, cluster.model.served_name, api_key, group=lambda: self.vllm.pid)
        # The line this run is on (cluster, from dspark.lines.state) and the cluster file's own.
        self.file_line = file_line or cluster.serving.runtime_line
        self._line_mtime: float | None = None
        self._wanted: line_state.LineState | None = None
        self._abandoned_checked = -1e18
        self.state = S.NodeState(node=node.name, rank=node.rank, role="head" if node.is_head else "worker",
                                 restarts=_count_start(state_dir) if count_start else _read_starts(state_dir),
                                 api_url=cluster.head.api_url if node.is_head else None,
                                 runtime_line=cluster.serving.runtime_line, file_line=self.file_line,
                                 resumed=not count_start)
        import threading

        self._lock = threading.Lock()
        peers = [Peer(n.name, n.agent_url, n.is_head) for n in cluster.nodes
                 if n.name != node.name and (node.is_head or n.is_head)]
        judge = LivenessJudge(stall_s=self.sup.stall_s, probe_failures=self.sup.liveness_failures,
                              fresh_s=self.sup.liveness_interval_s + self.sup.liveness_timeout_s)
        self.policy = NodePolicy(is_head=node.is_head, limits=Limits.of(self.sup), judge=judge, peers=peers,
                                 api_url=node.api_url, watchdog_s=self.notify.watchdog_interval,
                                 track_history=self.history is not None,
                                 runtime_line=cluster.serving.runtime_line, file_line=self.file_line,
                                 installed=frozenset({*cluster.serving.line_commands, self.file_line}),
                                 switching=switching, resumed=not count_start)
        wake = self.signals.wake
        self._ready_probe: Background = Background("ready-probe", wake)
        self._round: Background = Background("liveness-round", wake)
        self._peers: Background = Background("peers", wake)
        self.agent: Agent | None = None
        self._gpu = hardware.Gpu()

    # ------------------------------------------------------------------ small helpers
    def say(self, msg: str, level: int = logging.INFO) -> None:
        """One line of this node's log, at `level` (dspark.log: the journal's priority)."""
        L.line(level, f"dspark[{self.node.name}]: {msg}", self.log)

    def set_state(self, state: str, detail: str = "") -> None:
        with self._lock:
            self.state.record_state(state, detail)  # the node's event ring (the dashboard's timeline)
            if state != self.state.state:
                self.state.state_since = time.time()
            self.state.state = state
            self.state.detail = detail
        text = f"{state}: {detail}" if detail else state
        self.notify.status(text)
        self.say(text, logging.ERROR if state == S.FAILED else L.NOTICE)

    def snapshot(self) -> dict:
        with self._lock:
            self.state.vllm_version = self.state.vllm_version or self.vllm.version
            snap = self.state.snapshot()
        # This node's GPU (NVML, where present) and NVMe readings, for the dashboard on the head.
        snap["hardware"] = hardware.read_local(self._gpu)
        return snap

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        self.set_state(S.STARTING, f"rank {self.node.rank} of {len(self.cluster.nodes)}")
        self.agent = Agent(self.node.agent_bind, self.node.agent_port, self.snapshot).start()
        code = EXIT_DIED
        try:
            if self.history is not None:
                failures, last = self.history.load()
                self.policy.failures, self.policy.last_failure = failures, last
                # Counted as failed from its start: a kill -9 or a watchdog abort writes nothing.
                self.history.save(failures + 1, "did not finish: killed, crashed or watchdog timeout")
            early = self.signals.get(0)  # a signal while the cluster file was read
            actions = self.policy.step(time.monotonic(), Events(signal=early)) if early else []
            if not actions:
                actions = self.policy.start(time.monotonic())
            while True:
                done = self._apply(actions)
                if done is not None:
                    code = done
                    return code
                sig = self.signals.get(self.tick_s)  # the one place signals are acted on
                actions = self.policy.step(time.monotonic(), self._events(sig))
        finally:
            if self.vllm.running():
                self._stop_vllm("supervisor exiting")
            self.vllm.stop(0.0)  # a vLLM that exited on its own: its group is swept all the same
            if code == EXIT_OK:
                # Stopped on purpose: the next start is a fresh node, whose restarts count from 0.
                _clear_starts(self.state_dir)
                # A clean stop passes through stopping and stopped in well under a second: keep
                # saying "stopped" for longer than one poll of the dashboard or a peer (1 s), or
                # they see only a refused connection, which reads as a crash.
                time.sleep(STOPPED_LINGER_S)
            self.agent.stop()
            self.notify.close()

    def _read_wanted(self) -> line_state.LineState:
        """The head: the pair's line as its state file says (`dspark switch` writes it), re-read
        when the file changes; its switch record is served to the workers. A record whose `dspark
        switch` is gone (killed) is finished here, within ABANDONED_CHECK_S (dspark.lines.history)."""
        now = time.monotonic()
        if (self._wanted is not None and self._wanted.switch is not None
                and now - self._abandoned_checked >= ABANDONED_CHECK_S):
            self._abandoned_checked = now
            self._resolve_abandoned()
        m = line_state.mtime(self.state_dir)
        if self._wanted is not None and m == self._line_mtime:
            return self._wanted
        self._line_mtime = m
        self._wanted = wanted = line_state.current(self.state_dir, self.file_line)
        sw = wanted.switch
        with self._lock:
            self.state.line_switch = sw.to_json() if sw else None
        return wanted

    def _resolve_abandoned(self) -> None:
        assert self.state_dir is not None  # a head with a state file
        serving = self.state.runtime_line if self.state.state == S.SERVING else None
        resolve_abandoned(self.state_dir, self.file_line, self.sup, f"the head ({self.node.name})", serving, self.say)

    def _events(self, sig: int | None) -> Events:
        ev = Events(signal=sig, vllm_exit=self.vllm.poll(), stage=self.vllm.stage)
        if self.node.is_head and self.state_dir is not None:
            wanted = self._read_wanted()
            ev.wanted_line, ev.switching = wanted.line, wanted.switch is not None
        running = set()
        for bg, attr in ((self._ready_probe, "ready_probe"), (self._round, "round"), (self._peers, "peers")):
            finished, result = bg.take()
            if finished:
                setattr(ev, attr, result)
            elif bg.busy:
                running.add(attr)
        ev.running = frozenset(running)
        return ev

    def _apply(self, actions: list[Action]) -> int | None:
        """Carry out the policy's actions; the exit code once it says exit."""
        p, sup = self.policy, self.sup
        for a in actions:
            match a.kind:
                case ActionKind.STATE:
                    self.set_state(a.state, a.detail)
                case ActionKind.SAY:
                    # The policy's one warning among its remarks: a liveness round that failed.
                    failed_round = p.verdict is not None and not p.verdict.alive and a.detail == p.verdict.reason
                    self.say(a.detail, logging.WARNING if failed_round else logging.INFO)
                case ActionKind.EXTEND:
                    self.notify.extend_timeout(a.seconds)
                case ActionKind.START_VLLM:
                    self._start_vllm()
                case ActionKind.READY:
                    if p.version:
                        with self._lock:
                            self.state.vllm_version = p.version
                    self.notify.ready(a.detail)
                case ActionKind.READY_PROBE:
                    self._ready_probe.start(lambda: ready_probe(self.probes, sup.liveness_timeout_s))
                case ActionKind.LIVENESS_ROUND:
                    self._round.start(lambda: liveness_round(p.judge, self.probes, sup.liveness_timeout_s))
                case ActionKind.POLL_PEERS:
                    urls = {peer.name: peer.url for peer in p.peers}
                    self._peers.start(functools.partial(poll_agents, urls, timeout=1.0))
                case ActionKind.RECORD_ROUND:
                    self._record_liveness()
                case ActionKind.RECORD_PROBE:
                    with self._lock:
                        self.state.liveness = p.failed_probe
                case ActionKind.WATCHDOG:
                    self.notify.watchdog()
                case ActionKind.CLEAR_HISTORY:
                    if self.history is not None:
                        self.history.save(0)
                case ActionKind.DRAIN:
                    self._drain_vllm(a.detail, a.seconds)
                case ActionKind.STOP:
                    self._stop_vllm(a.detail, at_once=a.at_once)
                case ActionKind.EXIT:
                    if self.history is not None:
                        if a.history == History.CLEAR:
                            self.history.save(0)
                        elif a.history == History.KEEP:
                            self.history.save(p.failures, p.last_failure)
                        else:
                            self.history.save(p.failures + 1, f"exit {a.code}: {self.state.detail}")
                    return a.code
                case unknown:
                    assert_never(unknown)
        return None

    def _start_vllm(self) -> None:
        if self._gid_pending:  # the index can change across a reboot (dspark.node.rdma): read at the launch
            self._gid_pending = False
            node = self.node
            assert node.rdma_device is not None  # _gid_pending says so
            gid = resolve_gid_index(node.rdma_device, node.address)
            if gid is None:
                self.say(f"no RoCE v2 GID for {node.address} on {node.rdma_device}; NCCL picks one", logging.WARNING)
            self.vllm.launch = render(self.cluster, node, gid)
        self.say("starting vLLM: " + " ".join(self.vllm.launch.redacted_argv()))
        self.vllm.start()
        with self._lock:
            self.state.vllm_pid = self.vllm.pid

    def _record_liveness(self) -> None:
        verdict, probe = self.policy.verdict, self.policy.probe
        if verdict is None:
            return
        now_mono, now = time.monotonic(), time.time()
        proof = self.policy.judge.proof
        live = S.Liveness(ok=verdict.alive, at=now, latency_s=probe.latency_s if probe else None,
                          error=verdict.reason or None)
        if proof is not None:
            live.proof, live.proof_at, live.proof_detail = proof.kind, now - (now_mono - proof.at), proof.detail
        with self._lock:
            self.state.liveness = live

    def _status_line(self) -> str:
        with self._lock:
            return f"{self.state.state}: {self.state.detail}" if self.state.detail else self.state.state

    def _drain_vllm(self, signame: str, drain_s: float) -> None:
        """A planned stop of the serving head: SIGTERM to vLLM's API process alone. Started with
        --shutdown-timeout (dspark.node.launch), it turns new requests away, lets its engine finish
        the requests in flight for up to drain_s, then exits; the loop sees the exit. (A SIGTERM
        to the whole group would reach the TP workers too, and the requests would fail.)"""
        pid = self.vllm.pid
        self.say(f"{signame}: draining vLLM (pid {pid}): its requests in flight finish within {drain_s:g} s, "
                 "new requests are turned away")
        if self._goes_on():
            # A switch's drain: the unit is not stopping (the policy feeds its watchdog meanwhile).
            self.notify.status(self._status_line())
        else:
            # The unit is stopping: systemd pauses the watchdog; the stop may take the drain, the
            # grace after it and the sweep of vLLM's group.
            self.notify.send(stopping=1, status=self._status_line(),
                             extend_timeout_usec=int((drain_s + self.sup.stop_grace_s + GROUP_GONE_S + 15) * 1e6))
        self.vllm.drain()

    def _goes_on(self) -> bool:
        """Whether this process goes on once vLLM is stopped: a switch (the next run, on the new
        line, follows in this process: serve()) or a hold (the node waits for the pair's line to
        change). Then the unit is not stopping: STOPPING=1 cannot be taken back (systemd would
        keep the unit deactivating and kill it TimeoutStopSec later, mid-switch)."""
        return self.policy.phase == Phase.HELD or self.policy.switch_to is not None

    def _stop_vllm(self, reason: str, at_once: bool = False) -> None:
        grace = 0.0 if at_once else self.sup.stop_grace_s
        goes_on, room_s, lengthened = self._goes_on(), grace + GROUP_GONE_S + 15, []

        def stopping(pid: int) -> None:
            self.say(f"stopping vLLM (pid {pid}): {reason}")
            if not goes_on:
                # The unit is stopping: systemd pauses the watchdog and gives the stop its time.
                self.notify.send(stopping=1, status=self._status_line(), extend_timeout_usec=int(room_s * 1e6))
            elif self.notify.watchdog_usec:
                # Not stopping (a switch, a hold): the watchdog runs on, lengthened for the stop.
                lengthened.append(self.notify.send(watchdog_usec=int(room_s * 1e6), status=self._status_line()))

        if self.vllm.stop(grace, stopping) and grace > 0:
            self.say(f"vLLM did not exit within {grace:g} s; SIGKILL", logging.WARNING)
        if any(lengthened):
            self.notify.send(watchdog_usec=self.notify.watchdog_usec)  # the unit's WatchdogSec again
        with self._lock:
            self.state.vllm_pid = None


def _clear_starts(state_dir: Path | None) -> None:
    """After a clean stop: the restart count is of this running node, not of every start ever."""
    if state_dir is not None:
        try:
            (Path(state_dir) / STARTS_FILE).unlink(missing_ok=True)
        except OSError:
            pass


def _parse_starts(data: bytes) -> int:
    text = data.decode("ascii", "replace").strip()
    if not text.isdigit():
        raise state_io.CorruptState(f"{text[:20]!r} is not a count")
    return min(int(text), MAX_STARTS)


def _starts(state_dir: Path) -> int:
    """The starts recorded (0 without a file; one of another shape is moved aside: dspark.files.state_io)."""
    return state_io.read_state(Path(state_dir) / STARTS_FILE, _parse_starts, 0, default_is="a start count of 0",
                               max_bytes=MAX_STARTS_BYTES)


def resolve_abandoned(state_dir: Path, file_line: str, sup: SupervisorConfig, by: str, serving_on: str | None,
                       say: Callable[[str, int], None]) -> None:
    """The head's part of dspark.lines.history.resolve_abandoned: what it did (or could not do)
    said as a warning through `say(message, level)`."""
    try:
        rec = switch_history.resolve_abandoned(state_dir, file_line, by=by, serving_on=serving_on,
                                               limit_s=switch_history.timeout_s(sup))
    except OSError as e:
        say(f"a switch without its dspark switch is left as it is: {e}", logging.WARNING)
        return
    if rec is not None:
        say(f"switch {rec.id} ({rec.from_line} -> {rec.to_line}) without its dspark switch: {rec.verdict}: "
            f"{rec.reason}", logging.WARNING)


def _read_starts(state_dir: Path | None) -> int:
    """The restarts already counted (a switch's next run is the same start)."""
    return max(0, _starts(state_dir) - 1) if state_dir else 0


def _count_start(state_dir: Path | None) -> int:
    """Restarts of this node's service since it was last started cleanly: the starts recorded in
    the state directory since then (a clean stop clears them), minus one."""
    if state_dir is None:
        return 0
    starts = _starts(state_dir)
    try:
        state_io.write_atomic(Path(state_dir) / STARTS_FILE, f"{min(starts + 1, MAX_STARTS)}\n")
    except OSError:
        pass
    return starts

