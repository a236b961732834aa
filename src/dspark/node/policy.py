"""The node's policy: when it starts vLLM, when it is ready, when it is alive, when its pair is
broken, and how it ends. A state machine with no I/O and no clock of its own: the supervisor
(dspark.node.supervisor) gathers what happened (a signal, vLLM's exit, the stage its log reached,
finished probes) into `Events`, calls `step(now, events)` and carries out the `Action`s it
gets back. Tests drive it with fake probe results and a fake clock (tests/test_node_policy.py).

Phases: backoff -> workers (the head of a pair: until every worker is in the rendezvous) ->
vllm (before and after ready) -> [draining] -> done. Signals: SIGTERM/SIGINT stop the node
(exit 0; during the restart backoff the failure history is kept); SIGHUP restarts it through a
failure exit (EXIT_DIED), so that `Restart=on-failure` brings it back and a pair re-forms worker
first (restarting vLLM alone inside a running pair would leave the peer's collective waiting).

A planned stop (SIGTERM/SIGINT) of a serving head drains: vLLM's API process alone gets the
SIGTERM and, started with --shutdown-timeout, turns new requests away and finishes those in
flight (up to drain_s) before it exits; the head shows STOPPING meanwhile, and its workers keep
their vLLM (the head's collective needs them) until it shows STOPPED. vLLM's exit ends the
drain; a second signal, a broken pair or drain_s + stop_grace_s without an exit end it at once.
A fault (vLLM died, a peer lost, liveness lost) never drains, nor does a worker: a worker's stop
while its head serves breaks the pair, and the head stops at once.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import cast

from dspark.node import states as S
from dspark.node.agent_client import AgentAnswer, is_lost
from dspark.node.events import EXIT_SWITCH, PEERS_POLL_S, Action, ActionKind, Events, History, Limits, Peer, Phase
from dspark.node.line_follow import LineFollow
from dspark.node.liveness import LivenessJudge, Verdict
from dspark.node.stages import at_least, stage_detail

# Exit codes (the unit sets RestartPreventExitStatus=2: a bad config is not retried; every other
# failure is).
EXIT_OK = 0
EXIT_CONFIG = 2          # refused before starting anything: bad config, plan does not fit
EXIT_NEVER_READY = 3     # vLLM exited or timed out before the node became ready
EXIT_DIED = 4            # the node was serving (or in its pair) and then died, lost its pair or got SIGHUP
# Refused for now, for a condition that can clear: a port another process holds (after `serve
# --check` waited for it), a full or read-only filesystem, any OSError the cluster file cannot
# fix. Not in RestartPreventExitStatus=: systemd restarts the node, which tries again.
EXIT_RETRY = 5

# Restart backoff. The units restart a failed node after a short fixed RestartSec= (systemd 252
# has no growing delay); the supervisor adds the growing part, from the failure history it
# keeps in the state directory, and says so in a STATUS= line.
BACKOFF_FIRST_S = 5.0
BACKOFF_MAX_S = 300.0
BACKOFF_STABLE_S = 120.0  # serving this long clears the history

READY_POLL_S = 0.1        # the head's /health poll before ready: READY within a tick of vLLM answering
EXTEND_EVERY_S = 30.0     # keep systemd's start timeout ahead of a long model load
EXTEND_BY_S = 90.0


def backoff_delay(failures: int) -> float:
    """Seconds to wait before starting after `failures` consecutive failed runs: the first retry
    at once (a pair re-forms after one death), then 5, 10, 20, ... up to BACKOFF_MAX_S."""
    if failures <= 1:
        return 0.0
    return min(BACKOFF_FIRST_S * 2 ** (failures - 2), BACKOFF_MAX_S)


@dataclass
class NodePolicy(LineFollow):
    is_head: bool
    limits: Limits
    judge: LivenessJudge
    peers: list[Peer] = field(default_factory=list)
    api_url: str = ""
    watchdog_s: float | None = None       # half of WATCHDOG_USEC, None outside systemd's watchdog
    failures: int = 0                     # consecutive failed runs before this one
    last_failure: str = ""
    track_history: bool = False
    runtime_line: str | None = None       # the runtime line this node runs (dspark.lines.state)
    file_line: str | None = None          # the cluster file's line (a worker follows a head of the same file)
    installed: frozenset[str] = frozenset()  # the lines with a command here (serving.line_commands)
    switching: bool = False               # a switch is under way: a failure holds instead of exiting
    resumed: bool = False                 # this run goes on from a switch: systemd's watchdog is armed already

    def __post_init__(self) -> None:
        self.phase = Phase.INIT
        self.state, self.detail = S.STARTING, ""
        self.ready = self.paired = self.committed = False
        self.t_start = self.backoff_until = 0.0
        self.last_extend = self.last_health = self.last_live = self.last_peers = self.last_dog = -1e18
        self.serving_since: float | None = None
        self.history_cleared = False
        self.waiting_since = 0.0
        self.workers_seen: dict[str, str] = {}
        self.verdict: Verdict | None = None   # the last liveness verdict and the probe behind it, for the agent
        self.probe: S.Liveness | None = None
        self.failed_probe: S.Liveness | None = None  # the last failed completion before ready
        self.version: str | None = None  # vLLM's /version, read once ready
        self.drain_until = 0.0  # draining: vLLM is stopped if it has not exited by then
        self.drain_signal = ""
        self.switch_to: str | None = None  # set when the run ends (EXIT_SWITCH) to go on on this line
        self.held_on: str | None = None    # held: the pair's line when the hold began
        self.hold_until = self.hold_s = 0.0
        self._now = 0.0
        self.held_code = EXIT_NEVER_READY

    # ---------------------------------------------------------------- helpers
    def _show(self, out: list[Action], state: str, detail: str = "") -> None:
        if (state, detail) != (self.state, self.detail):
            self.state, self.detail = state, detail
            out.append(Action(ActionKind.STATE, state=state, detail=detail))

    def _end(self, out: list[Action], code: int, state: str, detail: str, *, stop: str = "",
             history: History | None = None, at_once: bool = False, hold: bool = True) -> list[Action]:
        """Show the final state, stop vLLM (when `stop` says why), exit with `code`. A failure is
        shown before the stop (which can take stop_grace_s): clients see it at once. A stop on
        request shows STOPPING during the stop and STOPPED once vLLM is gone. A failure while a
        switch is under way holds the node instead (`_hold`), unless `hold` is False (a signal)."""
        if hold and self.switching and code in (EXIT_NEVER_READY, EXIT_DIED) and self.phase != Phase.HELD:
            return self._hold(out, code, detail, stop)
        self.phase = Phase.DONE
        if state != S.STOPPED:
            self._show(out, state, detail)
        if stop:
            out.append(Action(ActionKind.STOP, state=self.state, detail=stop, at_once=at_once))
        self._show(out, state, detail)
        out.append(Action(ActionKind.EXIT, code=code,
                          history=history or (History.CLEAR if code == EXIT_OK else History.FAIL)))
        return out

    # ---------------------------------------------------------------- the machine
    def start(self, now: float) -> list[Action]:
        """The first step: the restart backoff, if the history calls for one."""
        out: list[Action] = []
        self.t_start = self._now = now
        delay = backoff_delay(self.failures) if self.track_history else 0.0
        if delay > 0:
            self.phase, self.backoff_until = Phase.BACKOFF, now + delay
            out.append(Action(ActionKind.EXTEND, seconds=delay + 60))
            self._show(out, S.STARTING, f"backoff: {self.failures} failed runs in a row "
                                        f"(last: {self.last_failure}); starting in {delay:.0f} s")
        else:
            out += self._begin(now)
        return out

    def _begin(self, now: float) -> list[Action]:
        out: list[Action] = []
        self.t_start = now
        if self.is_head and self.peers:
            self.phase, self.waiting_since = Phase.WORKERS, now
            self._show(out, S.RENDEZVOUS, "waiting for the worker(s) to enter the rendezvous")
            out.append(Action(ActionKind.POLL_PEERS))
            self.last_peers = now
        else:
            out += self._start_vllm()
        return out

    def _start_vllm(self) -> list[Action]:
        self.phase = Phase.VLLM
        return [Action(ActionKind.START_VLLM)]

    def step(self, now: float, ev: Events) -> list[Action]:
        out: list[Action] = []
        self._now = now
        if self.phase == Phase.DONE:
            return out
        if ev.signal is not None:
            return self._on_signal(out, ev.signal, now)
        if self.is_head and ev.switching is not None:
            self.switching = ev.switching
        if self.phase == Phase.HELD:
            return self._held(out, now, ev)
        if (self.is_head and ev.wanted_line and self.runtime_line and ev.wanted_line != self.runtime_line
                and self.phase != Phase.DRAINING):
            return self._switch(out, now, ev.wanted_line)
        if self.phase == Phase.DRAINING:
            return self._draining(out, now, ev)
        if self.phase == Phase.BACKOFF:
            if now >= self.backoff_until:
                out += self._begin(now)
            return out
        if self.phase == Phase.WORKERS:
            return self._waiting_for_workers(out, now, ev)
        return self._running(out, now, ev)

    def _on_signal(self, out: list[Action], sig: int, now: float) -> list[Action]:
        name = signal.Signals(sig).name
        running = self.phase in (Phase.VLLM, Phase.DRAINING)
        if sig == signal.SIGHUP:
            why = "received SIGHUP: restarting the node (a failure exit: Restart=on-failure brings it back)"
            return self._end(out, EXIT_DIED, S.FAILED, why, stop=name if running else "", hold=False)
        if self.phase == Phase.BACKOFF:
            return self._end(out, EXIT_OK, S.STOPPED, "stopped during the restart backoff", history=History.KEEP)
        if self.phase == Phase.WORKERS:
            return self._end(out, EXIT_OK, S.STOPPED, "stopped while waiting for the worker(s)")
        if not running:  # before anything started
            return self._end(out, EXIT_OK, S.STOPPED, f"stopped ({name}) before starting vLLM", history=History.KEEP)
        if self.phase == Phase.DRAINING:  # a second signal: the operator will not wait
            return self._end(out, EXIT_OK, S.STOPPED, f"vLLM killed at once: a second signal ({name}) during the "
                             "drain", stop=f"{name} during the drain", at_once=True)
        if self.is_head and self.ready and self.limits.drain_s > 0:
            lim = self.limits
            self.phase, self.drain_signal = Phase.DRAINING, name
            self.drain_until = now + lim.drain_s + lim.stop_grace_s
            self._show(out, S.STOPPING, f"received {name}: draining the requests in flight (up to "
                                        f"{lim.drain_s:g} s); new requests are turned away")
            out.append(Action(ActionKind.DRAIN, detail=name, seconds=lim.drain_s))
            return out
        self._show(out, S.STOPPING, f"received {name}")
        return self._end(out, EXIT_OK, S.STOPPED, f"vLLM stopped after {name}", stop=name)

    def _draining(self, out: list[Action], now: float, ev: Events) -> list[Action]:
        """The head drains: vLLM exits once its requests in flight are done (or drain_s is up).
        No liveness round meanwhile (its completion would be turned away) and no watchdog ping
        (systemd is stopping the unit); the peers are still watched: a broken pair cannot finish
        anything, so it ends the drain at once."""
        name = self.drain_signal
        # A drain for a switch ends the run for the next line (shown STOPPING: the pair goes on).
        code, final = (EXIT_SWITCH, S.STOPPING) if self.switch_to else (EXIT_OK, S.STOPPED)
        hist = History.KEEP if self.switch_to else None
        if ev.vllm_exit is not None:
            return self._end(out, code, final, f"vLLM drained its requests and stopped after {name}", history=hist)
        if self.peers and ev.peers is not None:
            broken = self._peers(now, ev.peers)
            if broken:
                return self._end(out, code, final, f"drain cut short, pair broken: {broken}",
                                 stop="pair broken during the drain", history=hist)
        if self.switch_to:
            self._feed(out, now)  # a switch's drain: the unit is not stopping, its watchdog runs
        if now >= self.drain_until:
            lim = self.limits
            return self._end(out, code, final,
                             f"vLLM still running {lim.drain_s + lim.stop_grace_s:g} s after {name} "
                             f"(drain_s + stop_grace_s): killed", stop="the drain overran", at_once=True, history=hist)
        if self.peers and "peers" not in ev.running and now - self.last_peers >= PEERS_POLL_S:
            self.last_peers = now
            out.append(Action(ActionKind.POLL_PEERS))
        return out

    def _extend(self, out: list[Action], now: float) -> None:
        if now - self.last_extend > EXTEND_EVERY_S:
            out.append(Action(ActionKind.EXTEND, seconds=EXTEND_BY_S))
            self.last_extend = now

    def _waiting_for_workers(self, out: list[Action], now: float, ev: Events) -> list[Action]:
        """The head starts vLLM only once every worker's agent reports the rendezvous."""
        self._extend(out, now)
        if self.resumed:
            self._feed(out, now)
        if ev.peers is not None:
            other = self._other_line(ev.peers)
            if other is not None:
                return self._end(out, EXIT_NEVER_READY, S.FAILED, other)
            waiting = []
            for p in self.peers:
                a = ev.peers.get(p.name)
                # an answer's "state" is a str (fetch_state refuses any other)
                self.workers_seen[p.name] = (cast(str, a.state.get("state")) if a is not None and a.state
                                             else "unreachable")
                theirs = (a.state or {}).get("runtime_line") if a is not None else None
                if theirs and self.runtime_line and theirs != self.runtime_line:
                    self.workers_seen[p.name] = f"on line {theirs}"
                if self.workers_seen[p.name] != S.RENDEZVOUS:
                    waiting.append(p)
            if not waiting:
                self.committed = True
                return out + self._start_vllm()
            self._show(out, S.RENDEZVOUS, "waiting for " + ", ".join(p.name for p in waiting)
                       + " to enter the rendezvous")
            if now - self.waiting_since >= self.limits.worker_wait_timeout_s:
                seen = ", ".join(f"{p.name} at {p.url} is {self.workers_seen[p.name]}" for p in waiting)
                return self._end(out, EXIT_NEVER_READY, S.FAILED,
                                 f"worker not ready after {self.limits.worker_wait_timeout_s:g} s: {seen}; "
                                 + S.START_WORKERS_FIRST)
            # Polled briskly: every moment here is added to the pair's start.
            out.append(Action(ActionKind.POLL_PEERS))
        elif "peers" not in ev.running:
            out.append(Action(ActionKind.POLL_PEERS))  # the last poll ended without an answer (never here)
        return out

    def _running(self, out: list[Action], now: float, ev: Events) -> list[Action]:
        lim = self.limits
        if ev.vllm_exit is not None:
            when = "while serving" if self.ready else "before becoming ready"
            return self._end(out, EXIT_DIED if self.ready else EXIT_NEVER_READY, S.FAILED,
                             f"vLLM exited with code {ev.vllm_exit} {when}")
        stage = ev.stage
        if not self.paired and at_least(stage, "loading"):
            self.paired = True  # the rendezvous completed: from now on, peers must stay
        if not self.ready:
            if now - self.t_start > lim.ready_timeout_s:
                return self._end(out, EXIT_NEVER_READY, S.FAILED,
                                 f"not ready after {lim.ready_timeout_s:g} s (ready_timeout_s)",
                                 stop="never became ready")
            self._extend(out, now)
            if stage != "starting" and stage != self.state:
                self._show(out, stage, stage_detail(stage))
            if self.is_head:
                rp = ev.ready_probe
                if rp is not None and rp.live is not None:
                    if rp.live.ok:
                        self.verdict = self.judge.probed(True, None, rp.live.latency_s, rp.progress, now)
                        self.probe, self.version = rp.live, rp.version
                        out.append(Action(ActionKind.RECORD_ROUND))
                        self.ready = self.paired = True
                        self.last_live = now
                        self._show(out, S.SERVING, f"API on {self.api_url}")
                        out.append(Action(ActionKind.READY, detail=f"serving: API on {self.api_url}"))
                    else:
                        self.failed_probe = rp.live
                        out.append(Action(ActionKind.RECORD_PROBE))
                if not self.ready and "ready_probe" not in ev.running and now - self.last_health >= READY_POLL_S:
                    self.last_health = now
                    out.append(Action(ActionKind.READY_PROBE))
            elif stage != "starting":
                # Up and waiting for (or in) the rendezvous: the worker is ready.
                self.ready = True
                out.append(Action(ActionKind.READY, detail=f"{stage}: {stage_detail(stage)}"))
                out.append(Action(ActionKind.SAY, detail="ready (in the rendezvous)"))
        elif self.is_head:
            r = ev.round
            if r is not None:
                self.verdict, self.probe = r.verdict, r.probe
                out.append(Action(ActionKind.RECORD_ROUND))
                v = r.verdict
                if not v.alive:
                    out.append(Action(ActionKind.SAY, detail=v.reason))
                if v.dead:
                    hung = r.probe is not None and r.probe.latency_s is None
                    if self.watchdog_s and hung:
                        # No answer at all: a hung vLLM. Under systemd's watchdog that is its
                        # call (the pings stopped with the last round that found it alive; it
                        # kills what no longer responds, result 'watchdog'). An error answer or
                        # a stall is ours to act on.
                        self._show(out, S.FAILED, f"liveness lost: {v.reason}; the watchdog restarts the node")
                    else:
                        return self._end(out, EXIT_DIED, S.FAILED, f"liveness lost: {v.reason}",
                                         stop="liveness lost")
            if "round" not in ev.running and now - self.last_live >= lim.liveness_interval_s:
                self.last_live = now
                out.append(Action(ActionKind.LIVENESS_ROUND))
        else:
            if self.state != S.SERVING and stage != self.state and stage != "starting":
                self._show(out, stage, stage_detail(stage))

        if self.peers:
            if ev.peers is not None and not self.is_head:
                to = self._head_line(ev.peers)
                if to is not None:
                    return self._switch(out, now, to)
                stopped = self._head_stopped(ev.peers) if self.paired else None
                if stopped is not None:
                    return self._end(out, EXIT_OK, S.STOPPED, f"its head {stopped} stopped",
                                     stop="its head stopped", at_once=True, hold=False)
                back = self._head_reformed(ev.peers) if self.switching else None
                if back is not None:  # a head back on this line after an interrupted switch
                    return self._switch(out, now, back, f"the head restarted on runtime line {back} during the "
                                                        "switch: the pair re-forms there")
            if ev.peers is not None:
                broken = self._peers(now, ev.peers)
                if broken:
                    return self._end(out, EXIT_DIED if (self.ready or self.paired) else EXIT_NEVER_READY,
                                     S.FAILED, f"pair broken: {broken}", stop="pair broken")
                self._follow_head(out)
            if not self.is_head and not self.paired and now - self.t_start > lim.rendezvous_timeout_s:
                return self._end(out, EXIT_NEVER_READY, S.FAILED,
                                 f"no head joined within {lim.rendezvous_timeout_s:g} s", stop="rendezvous timed out")
            if "peers" not in ev.running and now - self.last_peers >= PEERS_POLL_S:
                self.last_peers = now
                out.append(Action(ActionKind.POLL_PEERS))

        if self.state != S.SERVING:
            self.serving_since = None
        elif self.serving_since is None:
            self.serving_since = now
        if (self.track_history and not self.history_cleared and self.state == S.SERVING
                and self.serving_since is not None  # always, while SERVING (set just above)
                and now - self.serving_since >= BACKOFF_STABLE_S):
            self.history_cleared = True  # served long enough: the next failure restarts at once
            self.failures = 0
            out.append(Action(ActionKind.CLEAR_HISTORY))

        wd = self.watchdog_s
        # A run that goes on after a switch starts under a watchdog armed by the first run's READY:
        # it is fed while this run starts (ready_timeout_s bounds the start), as the first run's
        # start was covered by the start timeout.
        starting_again = self.resumed and not self.ready and self.phase == Phase.VLLM
        if (self.ready or starting_again) and wd and now - self.last_dog >= wd and self._watchdog_ok(now, ev):
            self.last_dog = now
            out.append(Action(ActionKind.WATCHDOG))
        return out

    def _feed(self, out: list[Action], now: float) -> None:
        if self.watchdog_s and now - self.last_dog >= self.watchdog_s:
            self.last_dog = now
            out.append(Action(ActionKind.WATCHDOG))

    def _watchdog_ok(self, now: float, ev: Events) -> bool:
        if self.is_head and self.ready:
            # Only while a liveness round found the engine alive recently (progress or probe).
            return self.judge.fed(now)
        return ev.vllm_exit is None

    def _peers(self, now: float, answers: dict[str, AgentAnswer]) -> str | None:
        """Why the pair is broken, or None."""
        # A head that started vLLM for the workers in the rendezvous is bound to those
        # incarnations: one that restarts or vanishes would leave its vLLM waiting forever.
        bound = self.paired or self.committed
        for p in self.peers:
            a = answers.get(p.name)
            if a is None:
                continue
            if a.state is not None:
                p.last, p.last_seen = a.state, now
                if not bound:
                    continue
                if p.started_at is None:
                    p.started_at = a.state.get("started_at")
                if p.started_at is not None and a.state.get("started_at") != p.started_at:
                    return f"{p.name} restarted; the pair must re-form"
                if p.is_head and not self.is_head and a.state.get("state") == S.STOPPING:
                    # A head stopping on request drains its requests in flight, which need this
                    # worker's ranks until its vLLM is gone (then it shows STOPPED). Bounded by
                    # the head's own limits (the same cluster file), and a head lost meanwhile.
                    p.stopping_since = now if p.stopping_since is None else p.stopping_since
                    lim = self.limits
                    if now - p.stopping_since <= lim.drain_s + lim.stop_grace_s + lim.head_lost_s:
                        continue
                lost = is_lost(a, p.last, 0.0, self.limits.head_lost_s)
            elif not bound:
                continue
            elif p.last_seen is None:
                p.last, p.last_seen = {"state": "unreachable"}, now  # start the clock at pair formation
                continue
            else:
                lost = is_lost(a, p.last, now - p.last_seen, self.limits.head_lost_s)
            if lost:
                return f"{p.name}: {lost}"
        return None
