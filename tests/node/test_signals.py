"""dspark.node.signals.SignalQueue, the one signal setup of `serve`, `local up` and `dashboard`: the
handler only queues; the first signal is kept for a loop that only asks whether to stop; the
handlers it replaced come back when the command is done (the caller's, e.g. pytest's)."""

from __future__ import annotations

import os
import signal

from dspark.node.signals import SignalQueue


def test_a_signal_is_queued_kept_as_the_first_and_the_old_handler_comes_back():
    seen: list[int] = []

    def before(signum, frame):
        seen.append(signum)

    old = signal.signal(signal.SIGUSR1, before)
    try:
        sigs = SignalQueue().install((signal.SIGUSR1, signal.SIGUSR2))
        try:
            assert sigs.first is None and sigs.get(0) is None
            os.kill(os.getpid(), signal.SIGUSR2)
            os.kill(os.getpid(), signal.SIGUSR1)
            assert sigs.get(5) == signal.SIGUSR2 and sigs.get(5) == signal.SIGUSR1
            assert sigs.first == signal.SIGUSR2  # kept after get() took it
            sigs.wake()
            assert sigs.get(5) is None  # a wake ends the wait and is no signal
        finally:
            sigs.restore()
        assert signal.getsignal(signal.SIGUSR1) is before and seen == []
        assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_installing_twice_restores_the_handler_from_before_the_first_install():
    old = signal.getsignal(signal.SIGUSR1)
    sigs = SignalQueue().install((signal.SIGUSR1,)).install((signal.SIGUSR1,))
    sigs.restore()
    assert signal.getsignal(signal.SIGUSR1) is old
