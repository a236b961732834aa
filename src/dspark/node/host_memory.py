"""This host's memory, for the node snapshot (`memory`) and so the dashboard's node cards.

On a GB10 the CPU and the GPU share one unified memory, so the memory the model, the KV cache and
everything else on the host draw from is one figure: what NVML reports for the device where it
answers, else what the kernel reports in /proc/meminfo (used = MemTotal - MemAvailable: memory
the kernel could not hand to a new allocation without swapping). Elsewhere (a CPU-only host such
as CI's) it is the host's /proc/meminfo.

NVML is optional: only where pynvml imports, nvmlInit succeeds and a device answers its memory
query. Every reading is bounded (the file read is capped, NVML is initialised once) and every
failure reads as "not known" (None): nothing here raises into the supervisor or the agent.
Readings are kept for CACHE_S, so a burst of /state requests reads the file once.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

MEMINFO = Path("/proc/meminfo")
MAX_MEMINFO_BYTES = 64 * 1024  # /proc/meminfo is about 1.5 KiB
CACHE_S = 0.5
SOURCES = ("nvml", "meminfo")
_KIB = 1024


def _figures(total: int, available: int, source: str) -> dict | None:
    if total <= 0 or available < 0:
        return None
    available = min(available, total)
    return {"total_bytes": total, "used_bytes": total - available, "available_bytes": available, "source": source}


def from_meminfo(path: Path = MEMINFO) -> dict | None:
    """MemTotal and MemAvailable from /proc/meminfo (kB, as the kernel writes them); None when the
    file is absent, unreadable, larger than MAX_MEMINFO_BYTES or lacks either line."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_MEMINFO_BYTES + 1)
    except OSError:
        return None
    if len(data) > MAX_MEMINFO_BYTES:
        return None
    values: dict[str, int] = {}
    for line in data.decode("ascii", "replace").splitlines():
        key, _, rest = line.partition(":")
        if key not in ("MemTotal", "MemAvailable"):
            continue
        parts = rest.split()
        if len(parts) == 2 and parts[0].isdigit() and parts[1] == "kB" and len(parts[0]) <= 15:
            values[key] = int(parts[0]) * _KIB
    if "MemTotal" not in values or "MemAvailable" not in values:
        return None
    return _figures(values["MemTotal"], values["MemAvailable"], "meminfo")


class Nvml:
    """The first NVML device's memory; initialised once, None wherever NVML does not answer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tried = False
        self._nvml: Any = None  # the pynvml module once initialised (optional import, untyped)
        self._handle: Any = None

    def read(self) -> dict | None:
        with self._lock:
            if not self._tried:
                self._tried = True
                try:
                    import pynvml  # optional: only where the NVIDIA stack is installed

                    pynvml.nvmlInit()
                    if pynvml.nvmlDeviceGetCount() > 0:
                        self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
                        self._nvml = pynvml
                except Exception:  # noqa: BLE001 (ImportError, NVMLError, a library that fails to load)
                    self._nvml = None
            if self._nvml is None:
                return None
            try:
                info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
                return _figures(int(info.total), int(info.free), "nvml")
            except Exception:  # noqa: BLE001 (NVML_ERROR_NOT_SUPPORTED and friends)
                return None


class HostMemory:
    """NVML where it answers, else /proc/meminfo; a reading is reused for CACHE_S."""

    def __init__(self, meminfo: Path = MEMINFO, nvml: Nvml | None = None, cache_s: float = CACHE_S):
        self.meminfo, self.cache_s = meminfo, cache_s
        self.nvml = nvml if nvml is not None else Nvml()
        self._lock = threading.Lock()
        self._at = -1e18
        self._last: dict | None = None

    def read(self) -> dict | None:
        """{total_bytes, used_bytes, available_bytes, source}, or None when neither source answers.
        Never raises."""
        with self._lock:
            now = time.monotonic()
            if now - self._at < self.cache_s:
                return dict(self._last) if self._last else None
            try:
                m = self.nvml.read() or from_meminfo(self.meminfo)
            except Exception:  # noqa: BLE001 (a reading is never worth a failed /state)
                m = None
            self._at, self._last = now, m
            return dict(m) if m else None


_HOST = HostMemory()


def read() -> dict | None:
    """This host's memory (the process-wide reader)."""
    return _HOST.read()
