"""`dspark systemd install`'s side effects: write the rendered units, the nodes' drop-ins and
the sysusers entry under a root, create the user and reload systemd, and say whether the
units' user can execute what they start."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from dspark.files import state_io
from dspark.units.dropins import NodeRole, node_dropins
from dspark.units.names import SYSTEM_UNIT_DIR, SYSUSERS_FILE, USER
from dspark.units.render import render_units, sysusers


def default_dspark_bin() -> str:
    """The `dspark` executable of this installation (beside the running Python first)."""
    beside = Path(sys.executable).parent / "dspark"
    if beside.exists():
        return str(beside)
    found = shutil.which("dspark")
    if found:
        return str(Path(found).resolve())
    raise FileNotFoundError("no dspark executable found; pass --dspark-bin")


def write_files(files: dict[str, str], out: Path) -> list[Path]:
    written = []
    for rel, text in files.items():
        path = out / rel
        state_io.write_atomic(path, text, mode=0o644)
        written.append(path)
    return written


def systemd_running(root: Path) -> bool:
    return root == Path("/") and Path("/run/systemd/system").is_dir()


def install(nodes: list[NodeRole], config_path: str, dspark_bin: str, root: Path = Path("/"),
            run: Callable[..., object] = subprocess.run) -> tuple[list[Path], list[list[str]]]:
    """Write the units, the nodes' drop-ins and the sysusers entry under `root`; when `root`
    is the running system, create the user and reload systemd. Returns (files, commands run)."""
    files = {f"{SYSTEM_UNIT_DIR}/{k}": v for k, v in render_units(dspark_bin).items()}
    files.update({f"{SYSTEM_UNIT_DIR}/{k}": v for k, v in node_dropins(nodes, config_path).items()})
    files[SYSUSERS_FILE] = sysusers()
    written = write_files(files, root)
    commands: list[list[str]] = []
    if systemd_running(root):
        for cmd in (["systemd-sysusers", "/" + SYSUSERS_FILE], ["systemctl", "daemon-reload"]):
            run(cmd, check=True)
            commands.append(cmd)
    return written, commands


def _interpreter(path: str) -> list[str]:
    """The interpreter a script's #! line names (none for a binary or `#!/usr/bin/env ...`)."""
    try:
        with open(path, "rb") as f:
            first = f.readline(4096)
    except OSError:
        return []
    if not first.startswith(b"#!"):
        return []
    words = first[2:].decode(errors="replace").split()
    return [words[0]] if words and os.path.basename(words[0]) != "env" else []


def unexecutable(dspark_bin: str, vllm_command: list[str]) -> list[str]:
    """Why the units' user cannot execute what the units start (the dspark executable, vLLM's
    command, the interpreters their #! lines name), by the mode bits of each file and every
    directory above it; empty where that user does not exist (or this is root's own run)."""
    from dspark.units.user import executable_by, service_user

    user = service_user(USER, under_unit=False)
    if user.name != USER:
        return []
    paths = [dspark_bin, *_interpreter(dspark_bin)]
    vllm = shutil.which(vllm_command[0]) if vllm_command else None
    if vllm:
        paths += [vllm, *_interpreter(vllm)]
    reasons = (executable_by(Path(p), user) for p in dict.fromkeys(os.path.realpath(p) for p in paths))
    return list(dict.fromkeys(r for r in reasons if r))  # one line per directory that stops it
