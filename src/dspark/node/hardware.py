"""This host's GPU and NVMe readings. No SSH, no sudo: NVML and sysfs only.

NVML (pynvml) is optional: without the module, or without a GPU, every GPU field is None and
the page shows "n/a". NVMe temperatures come from the kernel's hwmon class, whose `nvme`
devices report millidegrees Celsius in temp1_input ("Composite").
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

HWMON = Path("/sys/class/hwmon")

EMPTY_GPU: dict[str, str | float | None] = {
    "name": None, "temperature_c": None, "power_w": None, "utilization_pct": None}


def nvme_temperature_c(root: Path = HWMON) -> float | None:
    """The hottest NVMe drive's composite temperature, or None when there is none."""
    temps = []
    try:
        devices = sorted(root.iterdir())
    except OSError:
        return None
    for dev in devices:
        try:
            if (dev / "name").read_text().strip() != "nvme":
                continue
            temps.append(int((dev / "temp1_input").read_text().strip()) / 1000.0)
        except (OSError, ValueError):
            continue
    return max(temps) if temps else None


class Gpu:
    """NVML, initialised once on first use; every failure reads as "not available"."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._nvml: Any = None  # the pynvml module once initialised (optional import, untyped)
        self._handles: list | None = None  # None: not tried yet; []: no GPU / no NVML

    def _init(self) -> None:
        self._handles = []
        try:
            import pynvml  # optional: only where the NVIDIA stack is installed
        except ImportError:
            return
        try:
            pynvml.nvmlInit()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self._nvml = pynvml
        except Exception:  # noqa: BLE001 (NVMLError and driver/library load failures alike)
            self._handles = []

    def read(self) -> list[dict]:
        """One dict per GPU (fields None where NVML does not say, e.g. power on some boards)."""
        with self._lock:
            if self._handles is None:
                self._init()
            nv, out = self._nvml, []
            for h in self._handles or []:
                g = dict(EMPTY_GPU)
                for key, fn in (
                    ("name", lambda h=h: _text(nv.nvmlDeviceGetName(h))),
                    ("temperature_c", lambda h=h: float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))),
                    ("power_w", lambda h=h: nv.nvmlDeviceGetPowerUsage(h) / 1000.0),
                    ("utilization_pct", lambda h=h: float(nv.nvmlDeviceGetUtilizationRates(h).gpu)),
                ):
                    try:
                        g[key] = fn()
                    except Exception:  # noqa: BLE001 (NVML_ERROR_NOT_SUPPORTED and friends)
                        pass
                out.append(g)
            return out


def _text(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def read_local(gpu: Gpu, hwmon: Path = HWMON) -> dict:
    """This host's readings in the snapshot's `hardware` shape."""
    gpus = gpu.read()
    return {"gpus": gpus, "nvme_temperature_c": nvme_temperature_c(hwmon)}
