"""This node's identity, what its agent serves in /state for a peer's `dspark check` to compare:
the cluster file's hash, the vLLM runtime's version and sources, the model directory's
fingerprint; and the check that the runtime is the release of serving.runtime_line."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from dspark.config.schema import Cluster
from dspark.files.safe_read import MAX_MODEL_CONFIG_BYTES, MAX_MODEL_INDEX_BYTES, read_bytes
from dspark.preflight.result import Check, fail, ok


def cluster_sha256(path: str | None) -> str | None:
    """The cluster file's SHA-256, byte for byte (the same file on every node)."""
    if not path:
        return None
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def _runtime_python(vllm_command: list[str]) -> str | None:
    """The Python interpreter behind vLLM's command: `python -m ...`, a script's shebang, or the
    `python` beside a wrapper (a venv's or the Nix runtime's bin/)."""
    first = shutil.which(vllm_command[0]) if vllm_command else None
    if first is None:
        return None
    if "python" in Path(first).name:
        return first
    try:
        with open(first, "rb") as f:
            line = f.readline(512)
    except OSError:
        return None
    if line.startswith(b"#!") and b"python" in line:
        words = line[2:].decode(errors="replace").split()
        if words and words[0].endswith("/env") and len(words) > 1:
            return shutil.which(words[1])
        return words[0] if words else None
    beside = Path(first).parent / "python"
    return str(beside) if beside.exists() else None


_FIND_VLLM = ("import importlib.util as u; s = u.find_spec('vllm'); "
              "print(list(s.submodule_search_locations)[0] if s and s.submodule_search_locations else '')")


def vllm_package(vllm_command: list[str], timeout_s: float = 30.0) -> tuple[str | None, Path | None, str]:
    """(the Python behind vLLM's command, its installed vllm package directory, why not found),
    found without importing vLLM."""
    python = _runtime_python(vllm_command)
    if python is None:
        return None, None, f"cannot tell which Python runs {vllm_command[:1]}"
    try:
        r = subprocess.run([python, "-c", _FIND_VLLM], capture_output=True, text=True, timeout=timeout_s,
                           stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        return python, None, f"{python}: {e}"
    where = r.stdout.strip()
    if r.returncode != 0 or not where:
        return python, None, f"no vllm package for {python}"
    return python, Path(where), ""


def runtime_identity(vllm_command: list[str], timeout_s: float = 30.0) -> dict:
    """vLLM's version and a SHA-256 of its Python sources as installed (an overlay or any local
    change to them alters it), found without importing vLLM."""
    from dspark.lines.overlay import OverlayError, installed_vllm_version

    _, pkg, error = vllm_package(vllm_command, timeout_s)
    if pkg is None:
        return {"error": error}
    try:
        version = installed_vllm_version(pkg.parent)
    except OverlayError as e:
        version, _ = None, e
    h = hashlib.sha256()
    count = 0
    for dirpath, dirnames, filenames in os.walk(pkg):
        dirnames.sort()
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            p = os.path.join(dirpath, name)
            try:
                with open(p, "rb") as f:
                    data = f.read()
            except OSError:
                continue
            rel = os.path.relpath(p, pkg).encode()
            h.update(len(rel).to_bytes(4, "little") + rel + len(data).to_bytes(8, "little") + data)
            count += 1
    return {"vllm_version": version, "vllm_sources_sha256": h.hexdigest(), "vllm_sources_files": count}


def model_fingerprint(model_path: str) -> str | None:
    """SHA-256 of config.json, the index, and every shard's name and size: two nodes with the
    same download agree; a missing, extra or truncated shard differs."""
    d = Path(model_path)
    h = hashlib.sha256()
    try:
        for name in ("config.json", "model.safetensors.index.json"):
            if (d / name).exists():
                limit = MAX_MODEL_CONFIG_BYTES if name == "config.json" else MAX_MODEL_INDEX_BYTES
                h.update(name.encode() + b"\0" + read_bytes(d / name, limit))
        for p in sorted(d.glob("*.safetensors")):
            h.update(f"{p.name}\0{p.stat().st_size}\n".encode())
    except OSError:
        return None
    return h.hexdigest()


def local_identity(cluster: Cluster) -> dict:
    return {"cluster_sha256": cluster_sha256(cluster.source), "model_sha256": model_fingerprint(cluster.model.path),
            "runtime_line": cluster.serving.runtime_line, **runtime_identity(cluster.serving.vllm_command)}


def check_runtime_line(cluster: Cluster, identity: dict) -> list[Check]:
    """The runtime that serving.vllm_command runs is the release of serving.runtime_line: the
    cluster file's settings are rendered to that line's flags and names, which another release
    may not have, or may mean otherwise."""
    from dspark.lines import runtime as runtime_lines

    line_id = cluster.serving.runtime_line
    line = runtime_lines.load().lines.get(line_id)
    found = identity.get("vllm_version")
    if line is None or not isinstance(found, str) or not found:
        return []  # an unknown line is refused with the cluster file; an unidentified runtime is warned of
    if found.split("+", 1)[0] != line.vllm:
        return [fail("runtime.line", f"serving.runtime_line is {line_id} (vLLM {line.vllm}), but "
                     f"serving.vllm_command ({cluster.serving.vllm_command[0]}) runs vLLM {found}",
                     f"point serving.vllm_command at line {line_id}'s runtime, or set serving.runtime_line "
                     "to the line of the runtime installed")]
    return [ok("runtime.line", f"runtime line {line_id}: vLLM {found}")]
