"""Signals for `dspark serve`: the handlers only put the signal on a queue; the supervisor's one
loop takes them off and acts (uvicorn's supervisors do the same). Stdlib only and cheap to
import: `serve` installs the queue before anything else, so a signal that arrives while the
cluster file is read is acted on, not lost and never a traceback.

What each signal means is the supervisor's policy (dspark.node_policy): SIGTERM and SIGINT
stop the node (exit 0); SIGHUP restarts it, through a failure exit so that systemd's
`Restart=on-failure` (and the pair's worker-first restart) brings it back."""

from __future__ import annotations

import queue
import signal

HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
WAKE = 0  # not a signal: a background probe has finished, look now rather than at the next tick


class SignalQueue:
    def __init__(self) -> None:
        self._q: queue.SimpleQueue[int] = queue.SimpleQueue()

    def install(self, signals=HANDLED) -> "SignalQueue":
        for sig in signals:
            signal.signal(sig, self._record)
        return self

    def _record(self, signum, frame) -> None:  # a handler does nothing else
        self._q.put(signum)

    def put(self, signum: int) -> None:
        self._q.put(signum)

    def wake(self) -> None:
        self._q.put(WAKE)

    def get(self, timeout: float) -> int | None:
        """The next signal, waiting at most `timeout` seconds (a signal or a wake ends the wait at
        once); None when there is none."""
        try:
            sig = self._q.get(timeout=max(0.0, timeout)) if timeout > 0 else self._q.get_nowait()
        except queue.Empty:
            return None
        return None if sig == WAKE else sig

