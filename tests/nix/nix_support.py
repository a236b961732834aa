"""Helpers for the Nix tests: run the evaluator offline, write Python data as Nix, load
the nix/ scripts as modules."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Single-user, offline evaluation: no build users, no binary caches.
NIX_CONFIG = "build-users-group =\nsubstituters =\nexperimental-features = nix-command flakes\n"


class NixError(Exception):
    pass


def run_nix(nix_instantiate: str, *args: str) -> str:
    env = dict(os.environ, NIX_CONFIG=NIX_CONFIG)
    proc = subprocess.run([nix_instantiate, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    if proc.returncode != 0:
        raise NixError(proc.stderr.strip())
    return proc.stdout


def nix_eval(nix_instantiate: str, expr: str):
    """Evaluate a Nix expression (in the repository root) strictly and return it as Python data."""
    return json.loads(run_nix(nix_instantiate, "--eval", "--strict", "--json", "-E", expr))


def to_nix(value) -> str:
    """Python data as a Nix expression (dicts, lists, strings, numbers, booleans, None)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value).replace("${", "\\${")
    if isinstance(value, (list, tuple)):
        return "[ " + " ".join(f"({to_nix(v)})" for v in value) + " ]"
    if isinstance(value, dict):
        return "{ " + " ".join(f"{json.dumps(k)} = {to_nix(v)};" for k, v in value.items()) + " }"
    raise TypeError(f"no Nix form for {value!r}")


def load_script(name: str, relpath: str):
    """A script of the repository (nix/lock-runtime.py, say) imported as module `name`."""
    spec = importlib.util.spec_from_file_location(name, REPO / relpath)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_package(name: str, relpath: str):
    """A package of the repository (nix/replay_runtime, say) imported as package `name` from its
    folder, with each of its modules (`pkg.plan`, `pkg.elf`, ...): no change to sys.path."""
    folder = REPO / relpath
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[name] = pkg
    spec.loader.exec_module(pkg)
    for module in sorted(p.stem for p in folder.glob("*.py") if not p.stem.startswith("_")):
        importlib.import_module(f"{name}.{module}")
    return pkg


def flake_with_stub(stub) -> str:
    """A Nix `let` binding the flake's outputs with the stand-in nixpkgs (the `stub` fixture) as
    its input, and legacyPackages as nixpkgs has it (config {}, so unfree is refused); the caller
    appends the expression to evaluate."""
    return f"""
      let
        lib = import {stub}/lib-path.nix;
        nixpkgs = {{
          outPath = {stub};
          lib = import lib;
        }} // {{ legacyPackages = {{ aarch64-linux = import {stub} {{ system = "aarch64-linux"; }}; }}; }};
        outputs = (import ./flake.nix).outputs {{ self = outputs; inherit nixpkgs; }};
      in"""
