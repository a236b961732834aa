"""systemd's notify protocol (sd_notify(3)), written out: one datagram per message.

The supervisor is the unit's main process and the only sender. Outside systemd
(no NOTIFY_SOCKET) every call is a no-op, so the same code runs by hand and in tests.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

# Variables that belong to the supervisor alone; vLLM (a child) must not see them, or it
# could notify on the unit's behalf.
NOTIFY_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


class Notifier:
    def __init__(self, address: str | None = None, env: Mapping[str, str] | None = None):
        env = os.environ if env is None else env
        address = address if address is not None else env.get("NOTIFY_SOCKET")
        self._sock: socket.socket | None = None
        self._address: str | None = None  # set together with _sock
        if address:
            # A leading '@' names a socket in the abstract namespace.
            self._address = "\0" + address[1:] if address.startswith("@") else address
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.watchdog_usec = _watchdog_usec(env)
        self.ready_sent = False

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between WATCHDOG=1 pings (half the unit's WatchdogSec), or None."""
        return self.watchdog_usec / 2e6 if self.watchdog_usec else None

    def send(self, **fields: object) -> bool:
        """Send KEY=value lines (keys upper-cased); False when not under systemd or it failed."""
        if self._sock is None or self._address is None or not fields:
            return False
        msg = "\n".join(f"{k.upper()}={_one_line(v)}" for k, v in fields.items())
        try:
            self._sock.sendto(msg.encode(), self._address)
            return True
        except OSError:
            return False

    def status(self, text: str) -> bool:
        return self.send(status=text)

    def ready(self, status: str | None = None) -> bool:
        """READY=1, once."""
        if self.ready_sent:
            return False
        self.ready_sent = True
        return self.send(ready=1, **({"status": status} if status else {}))

    def watchdog(self) -> bool:
        return self.send(watchdog=1)

    def extend_timeout(self, seconds: float) -> bool:
        return self.send(extend_timeout_usec=int(seconds * 1e6))

    def stopping(self, status: str | None = None) -> bool:
        return self.send(stopping=1, **({"status": status} if status else {}))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _one_line(value: object) -> str:
    return str(value).replace("\n", " ")


def _watchdog_usec(env: Mapping[str, str]) -> int | None:
    usec = env.get("WATCHDOG_USEC")
    pid = env.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) or None
    except ValueError:
        return None


def child_env(env: dict[str, str]) -> dict[str, str]:
    """A copy of `env` for a child process, without the notify protocol's variables."""
    return {k: v for k, v in env.items() if k not in NOTIFY_ENV}
