"""NCCL's own dlopen of libibverbs, under the real dynamic loader, with the RUNPATH the Nix build
gives libnccl.so.2 (standard library only, so it runs on a GPU machine without this checkout's
venv):

    python3 tests/nix/nccl_runpath.py --nccl .../nvidia/nccl/lib/libnccl.so.2 \\
        --rdma-dir DIR_WITH_libibverbs.so.1 [--patchelf PATH] [--init]

A copy of libnccl.so.2 gets RUNPATH=<rdma dir>:/run/opengl-driver/lib (what autoPatchelf plus
runtime.nix's appendRunpaths leave it: it has no DT_NEEDED outside glibc and GCC's runtime), a
second copy gets /run/opengl-driver/lib alone (the build before the fix). Each is loaded in a
child Python with LD_DEBUG=libs; with --init the child creates a one-GPU communicator
(ncclCommInitAll), which is when NCCL initialises its network plugins and dlopens libibverbs
("NET/IB"). Printed as JSON: for each copy, where the loader found libibverbs.so.1 /
libmlx5.so.1 and through which search path (RUNPATH of the NCCL copy, or the host's
/etc/ld.so.cache, which the Nix store's glibc does not read), and NCCL's NET/IB lines.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

DRIVER_DIR = "/run/opengl-driver/lib"

CHILD = r"""
import ctypes, sys
nccl = ctypes.CDLL(sys.argv[1])
version = ctypes.c_int()
assert nccl.ncclGetVersion(ctypes.byref(version)) == 0
print("NCCL_VERSION", version.value, flush=True)
if sys.argv[2] == "init":
    comms = (ctypes.c_void_p * 1)()
    rc = nccl.ncclCommInitAll(comms, 1, None)
    print("INIT_RC", rc, flush=True)
    if rc == 0:
        nccl.ncclCommDestroy(comms[0])
"""


def loader_trace(debug_files: list[Path], sonames: tuple[str, ...]) -> dict[str, dict]:
    """For each soname: the search paths the loader tried in order (with their origin), and the
    file it opened ('calling init'), from LD_DEBUG=libs output."""
    out: dict[str, dict] = {}
    for path in debug_files:
        current = None
        for line in path.read_text(errors="replace").splitlines():
            line = line.split(":", 1)[1].strip() if ":" in line else line.strip()
            if m := re.match(r"find library=(\S+) \[\d+\]; searching", line):
                current = m.group(1) if m.group(1) in sonames else None
                if current:
                    out.setdefault(current, {"searched": [], "found": None})
            elif current and (m := re.match(r"search path=(\S*)\s+\((.+)\)", line)):
                out[current]["searched"].append(f"{m.group(1).split(':')[-1]} ({m.group(2)})")
            elif current and (m := re.match(r"search cache=(\S+)", line)):
                out[current]["searched"].append(f"cache {m.group(1)}")
            elif current and (m := re.match(r"trying file=(\S+)", line)):
                out[current]["last_tried"] = m.group(1)
            elif m := re.match(r"calling init: (\S+)", line):
                for so, rec in out.items():
                    if rec["found"] is None and Path(m.group(1)).name.startswith(so.split(".so")[0] + ".so"):
                        rec["found"] = m.group(1)
    return out


def probe(nccl: Path, runpath: str, patchelf: str, init: bool, work: Path, python: str) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    copy = work / "libnccl.so.2"
    shutil.copyfile(nccl, copy)
    subprocess.run([patchelf, "--set-rpath", runpath, str(copy)], check=True)
    got = subprocess.run([patchelf, "--print-rpath", str(copy)], check=True, capture_output=True, text=True)
    env = dict(os.environ, LD_DEBUG="libs", LD_DEBUG_OUTPUT=str(work / "ld"), NCCL_DEBUG="INFO",
               NCCL_DEBUG_SUBSYS="INIT,NET")
    env.pop("LD_LIBRARY_PATH", None)
    proc = subprocess.run([python, "-c", CHILD, str(copy), "init" if init else "load"], env=env,
                          capture_output=True, text=True, timeout=300)
    text = proc.stdout + proc.stderr
    return {
        "runpath": got.stdout.strip(),
        "returncode": proc.returncode,
        "nccl_version": next((ln.split()[1] for ln in text.splitlines() if ln.startswith("NCCL_VERSION")), None),
        "init_rc": next((ln.split()[1] for ln in text.splitlines() if ln.startswith("INIT_RC")), None),
        "net_lines": [ln for ln in text.splitlines() if "NET/IB" in ln or "ibverbs" in ln or "MLX5" in ln][:12],
        "loads": loader_trace(sorted(work.glob("ld.*")),
                              ("libibverbs.so.1", "libibverbs.so", "libmlx5.so.1", "libmlx5.so")),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nccl", type=Path, required=True)
    ap.add_argument("--rdma-dir", type=Path, required=True)
    ap.add_argument("--patchelf", default=shutil.which("patchelf") or "patchelf")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--init", action="store_true", help="create a one-GPU communicator (needs a GPU)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="nccl-runpath-") as tmp:
        result = {
            "fixed": probe(args.nccl, f"{args.rdma_dir.resolve()}:{DRIVER_DIR}", args.patchelf, args.init,
                           Path(tmp) / "fixed", args.python),
            "before": probe(args.nccl, DRIVER_DIR, args.patchelf, args.init, Path(tmp) / "before", args.python),
        }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
