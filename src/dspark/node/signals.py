"""Signals for dspark's long-running commands (`serve`, `local up`, `dashboard`): the handlers
only put the signal on a queue; the command's one loop takes them off and acts (uvicorn's
supervisors do the same); `restore()` gives back the handlers it replaced. Stdlib only and cheap to
import: `serve` installs the queue before anything else, so a signal that arrives while the
cluster file is read is acted on, not lost and never a traceback.

What each signal means is the supervisor's policy (dspark.node.policy): SIGTERM and SIGINT
stop the node (exit 0); SIGHUP restarts it, through a failure exit so that systemd's
`Restart=on-failure` (and the pair's worker-first restart) brings it back."""

from __future__ import annotations

import queue
import signal
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: nothing more to import at run time
    from collections.abc import Callable, Iterable
    from types import FrameType
    from typing import Any

HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
WAKE = 0  # not a signal: a background probe has finished, look now rather than at the next tick


class SignalQueue:
    def __init__(self) -> None:
        self._q: queue.SimpleQueue[int] = queue.SimpleQueue()
        # what signal.signal() returned: a handler, SIG_DFL / SIG_IGN (ints), or None (not set from Python)
        self._old: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}
        self.first: int | None = None  # the first signal received, kept after get() took it
        self.received = 0  # how many signals arrived (a second Ctrl-C: `local up` kills at once)

    def install(self, signals: Iterable[int] = HANDLED) -> SignalQueue:
        for sig in signals:
            old = signal.signal(sig, self._record)
            self._old.setdefault(sig, old)
        return self

    def restore(self) -> None:
        """The handlers install() replaced, back in place."""
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def _record(self, signum: int, frame: FrameType | None) -> None:  # a handler does nothing else
        if self.first is None:
            self.first = signum
        self.received += 1
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

