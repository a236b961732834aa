"""Line-following: a worker runs the runtime line its head runs (the same cluster file), and a
head refuses to form a pair with a worker on another line of another file. Part of the node
policy (dspark.node.policy, whose `NodePolicy` has these methods); pure, like it.

Every question about a peer's line goes through one helper, `_line_of`: what its agent's /state
in this poll says (the line it runs, whether it reads this node's cluster file)."""

from __future__ import annotations

from dataclasses import dataclass

from dspark.node import states as S
from dspark.node.agent_client import AgentAnswer
from dspark.node.events import EXIT_SWITCH, PEERS_POLL_S, Action, ActionKind, Events, History, Limits, Peer, Phase


@dataclass(frozen=True)
class OnLine:
    """A peer's answer in one poll, as far as lines go."""

    peer: Peer
    state: dict            # its agent's /state
    line: str | None       # the runtime line it reports (a non-empty text), None when none
    file_line: object      # the cluster file's line it reports (None when it reports none)


class LineFollow:
    """The line-following half of `NodePolicy` (the attributes are the policy's)."""

    is_head: bool
    limits: Limits
    peers: list[Peer]
    runtime_line: str | None
    file_line: str | None
    installed: frozenset[str]
    switching: bool
    phase: Phase
    state: str
    detail: str
    ready: bool
    paired: bool
    drain_signal: str
    drain_until: float
    switch_to: str | None
    held_on: str | None
    hold_until: float
    hold_s: float
    # The code a hold ends with: the failure's that held the node. Until one did, EXIT_NEVER_READY
    # (dspark.node.policy): a worker that cannot follow its head never became ready on that line
    # (and a switch never starts from a hold: step() hands a held node to _held).
    held_code: int
    last_peers: float
    _now: float

    def _show(self, out: list[Action], state: str, detail: str = "") -> None:
        raise NotImplementedError  # NodePolicy's

    def _end(self, out: list[Action], code: int, state: str, detail: str, *, stop: str = "",
             history: History | None = None, at_once: bool = False, hold: bool = True) -> list[Action]:
        raise NotImplementedError  # NodePolicy's

    def _feed(self, out: list[Action], now: float) -> None:
        raise NotImplementedError  # NodePolicy's

    # ---------------------------------------------------------------- the one helper
    def _head_peer(self) -> Peer | None:
        return next((p for p in self.peers if p.is_head), None)

    def _line_of(self, answers: dict[str, AgentAnswer], peer: Peer | None = None) -> OnLine | None:
        """What `peer` (default: this worker's head) answered in this poll about its line; None
        when it did not answer with a /state."""
        peer = peer if peer is not None else self._head_peer()
        a = answers.get(peer.name) if peer is not None else None
        if peer is None or a is None or not a.state:
            return None
        theirs = a.state.get("runtime_line")
        return OnLine(peer, a.state, theirs if isinstance(theirs, str) and theirs else None,
                      a.state.get("file_line"))

    # ---------------------------------------------------------------- the head
    def _other_line(self, answers: dict[str, AgentAnswer]) -> str | None:
        """Why the head refuses to form the pair: a worker that reports another runtime line
        (one vLLM engine cannot span two releases). A worker that reports none (an older dspark)
        is left to `dspark check`'s comparison of the runtimes."""
        for p in self.peers:
            on = self._line_of(answers, p)
            if on is None or (self.file_line and on.file_line == self.file_line):
                continue  # the same cluster file: the worker follows this head onto its line
            if self.runtime_line and on.line and on.line != self.runtime_line:
                return (f"refusing to form the pair on two runtime lines: {p.name} runs {on.line}, this head "
                        f"runs {self.runtime_line}; put every node on one line (serving.runtime_line in the "
                        "same cluster file on every node), then restart the workers first")
        return None

    # ---------------------------------------------------------------- a worker
    def _follow_head(self, out: list[Action]) -> None:
        """A worker is serving while its head is; the pair forms when the head serves."""
        head = self._head_peer()
        if (head is not None and head.last and head.last.get("state") == S.SERVING and self.ready
                and self.state != S.SERVING):
            self.paired = True
            self._show(out, S.SERVING, f"pair serving with {head.name}")

    def _head_line(self, answers: dict[str, AgentAnswer]) -> str | None:
        """A worker: the line its head runs, when it is not this worker's and the head reads the
        same cluster file (then the pair's line is the head's: the worker follows). The head's
        switch record, when it shows one, says whether a failure on the way holds."""
        on = self._line_of(answers)
        if on is None:
            return None
        if not self.is_head:
            self.switching = bool(on.state.get("line_switch"))
        if (on.line and self.runtime_line and on.line != self.runtime_line
                and self.file_line and on.file_line == self.file_line):
            return on.line
        return None

    def _head_stopped(self, answers: dict[str, AgentAnswer]) -> str | None:
        """A worker: its head's name when the head shows STOPPED (a planned stop, its drain over):
        the worker stops too, cleanly (exit 0: nothing for systemd to restart), its vLLM at once
        (its collective's other end is gone). Start the pair again worker first."""
        on = self._line_of(answers)
        return on.peer.name if on is not None and on.state.get("state") == S.STOPPED else None

    def _head_reformed(self, answers: dict[str, AgentAnswer]) -> str | None:
        """A worker: the head's line when the head answers as a new incarnation (not the one this
        worker paired with) on a line this worker has, of the same cluster file: a head back on
        the old line after a switch interrupted during its drain. The worker goes on there (its
        next run enters the rendezvous first), where a broken pair would hold it or end it."""
        on = self._line_of(answers)
        if on is None or on.peer.started_at is None or on.state.get("started_at") == on.peer.started_at:
            return None
        if on.line is not None and on.file_line == self.file_line and on.line in self.installed:
            return on.line
        return None

    def _held_worker_follows(self, answers: dict[str, AgentAnswer]) -> tuple[str | None, str]:
        """A held worker: (the line to go on on, why) when its head answers on another line this
        worker has, or restarted on this one. A head that answers without a switch record ends
        the hold (`switching`)."""
        on = self._line_of(answers)
        if on is None:
            return None, ""  # not answering (between two runs): nothing learnt
        self.switching = bool(on.state.get("line_switch"))
        if (on.line is not None and on.line != self.held_on and on.file_line == self.file_line
                and on.line in self.installed):
            return on.line, f"the pair moved to runtime line {on.line}"
        back = self._head_reformed(answers)
        if back is not None:
            return back, f"the head restarted on runtime line {back}: the pair re-forms there"
        return None, ""

    # ---------------------------------------------------------------- switch, hold
    def _switch(self, out: list[Action], now: float, to: str, why: str = "") -> list[Action]:
        """End this run to go on on line `to` (`why`: said instead of "switching from ... to ..."):
        a serving head drains first (drain_s), anything else stops vLLM at once; a worker that
        does not have the line holds."""
        if not self.is_head and to not in self.installed:
            why = (f"cannot follow the head onto runtime line {to}: it is not installed on this node "
                   f"(serving.line_commands has {', '.join(sorted(self.installed)) or 'no line'})")
            self.switching = True
            return self._hold(out, self.held_code, why, "the head left this line" if self.phase == Phase.VLLM else "",
                              held_on=to)
        self.switch_to = to
        what = why or f"switching from runtime line {self.runtime_line} to {to}"
        if self.is_head and self.phase == Phase.VLLM and self.ready and self.limits.drain_s > 0:
            lim = self.limits
            self.phase, self.drain_signal = Phase.DRAINING, "the switch"
            self.drain_until = now + lim.drain_s + lim.stop_grace_s
            self._show(out, S.STOPPING, f"{what}: draining the requests in flight (up to {lim.drain_s:g} s)")
            out.append(Action(ActionKind.DRAIN, detail="the switch", seconds=lim.drain_s))
            return out
        running = self.phase == Phase.VLLM
        # A worker follows a head whose vLLM is gone already: its own has nothing left to finish.
        return self._end(out, EXIT_SWITCH, S.STOPPING, what, stop=what if running else "", history=History.KEEP,
                         at_once=not self.is_head)

    def _hold(self, out: list[Action], code: int, detail: str, stop: str, held_on: str | None = None) -> list[Action]:
        """A failure while the pair switches lines: stop vLLM, show FAILED and stay (the agent
        answering) until the pair's line changes (the switch's rollback) or the hold times out;
        exiting would end `dspark local up`, and under systemd restart onto the same line."""
        lim = self.limits
        self.phase, self.held_code = Phase.HELD, code
        self.held_on = held_on or self.runtime_line
        self.hold_s = max(lim.ready_timeout_s, lim.worker_wait_timeout_s)
        self.hold_until = self._now + self.hold_s
        detail = f"{detail}; holding until the pair's runtime line changes (the switch's rollback)"
        self._show(out, S.FAILED, detail)
        if stop:
            out.append(Action(ActionKind.STOP, state=self.state, detail=stop))
            self._show(out, S.FAILED, detail)
        return out

    def _held(self, out: list[Action], now: float, ev: Events) -> list[Action]:
        """Held (a failure during a switch): go on on the pair's new line once it changes, end
        when the switch is over or the hold times out."""
        to, why = None, ""
        if self.is_head:
            if ev.wanted_line and ev.wanted_line != self.held_on:
                to, why = ev.wanted_line, f"the pair moved to runtime line {ev.wanted_line}"
        elif ev.peers is not None:
            to, why = self._held_worker_follows(ev.peers)
        if to is not None:
            self.switch_to = to
            return self._end(out, EXIT_SWITCH, S.STOPPING, why, history=History.KEEP)
        failure = self.detail.split("; holding")[0]
        if not self.switching:  # the switch ended (its verdict, or resolved as abandoned): nothing to wait for
            return self._end(out, self.held_code, S.FAILED, f"{failure}; the switch is over")
        if now >= self.hold_until:
            self.switching = False
            return self._end(out, self.held_code, S.FAILED, f"{failure}; the pair's line did not change within "
                                                            f"{self.hold_s:g} s")
        if not self.is_head and "peers" not in ev.running and now - self.last_peers >= PEERS_POLL_S:
            self.last_peers = now
            out.append(Action(ActionKind.POLL_PEERS))
        self._feed(out, now)  # holding on purpose, not hung
        return out
