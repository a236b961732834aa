"""The replay in order (fetch, install, check, overlay), its report, and the command line;
`python3 -m nix.replay_runtime` runs main() through __main__.py (the package's docstring says why
that form)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .checks import LoadCheck, check_runtime_loads, pth_imports, strip_breaks, unresolved_needed
from .elf import elf_objects
from .plan import BUILD, DEFAULT_CACHE, Line, ReplayError, installer_wheel, load_line, load_plan
from .wheels import Log, apply_overlay, fetch, find_clashes, install, site_packages

PROG = "python3 -m nix.replay_runtime"
DESCRIPTION = "Replay nix/runtime.nix's build of the GB10 runtime without nixpkgs, and report what would stop it."


@dataclass
class Report:
    wheels: int = 0
    elf_objects: int = 0
    line: str = ""
    overlay: str = ""
    clashes: list[str] = field(default_factory=list)
    install_errors: list[str] = field(default_factory=list)
    unresolved: list[str] = field(default_factory=list)
    pth_imports: list[str] = field(default_factory=list)
    load_failures: list[str] = field(default_factory=list)
    runtime_loads: LoadCheck = field(default_factory=LoadCheck)
    unresolved_loads: list[str] = field(default_factory=list)
    overlay_errors: list[str] = field(default_factory=list)

    SECTIONS = (("clashes", "file clashes"), ("install_errors", "installer errors"),
                ("unresolved", "unresolved DT_NEEDED"), ("pth_imports", "imports depending on .pth files"),
                ("load_failures", "objects glibc would refuse (stripping)"),
                ("unresolved_loads", "libraries loaded at run time that the build leaves unresolvable"),
                ("overlay_errors", "overlay series errors"))

    @property
    def ok(self) -> bool:
        return not any(getattr(self, k) for k, _ in self.SECTIONS)

    def text(self) -> str:
        lines = [f"replayed {self.wheels} wheels, {self.elf_objects} ELF objects (runtime line {self.line})",
                 self.runtime_loads.summary(), f"overlay: {self.overlay}"]
        for key, title in self.SECTIONS:
            items = getattr(self, key)
            lines.append(f"{title}: {len(items)}")
            lines += [f"  {i}" for i in items]
        lines.append("OK" if self.ok else "FAILED")
        return "\n".join(lines)


def replay(cache: Path, prefix: Path, offline: bool = False, python: str = sys.executable,
           line: Line | None = None, build_path: Path = BUILD, log: Log = print) -> Report:
    line = line or load_line()
    wheels, build = load_plan(line.lock, build_path)
    inst = installer_wheel(build)
    fetch(cache, [*wheels, inst], offline, log)
    report = Report(wheels=len(wheels), line=line.id)
    report.clashes = find_clashes(wheels, cache, build)
    log(f"installing {len(wheels)} wheels into {prefix}")
    report.install_errors = install(prefix, wheels, cache, build, cache / inst.filename, python, log)
    elves = elf_objects(prefix)
    report.elf_objects = len(elves)
    report.unresolved = unresolved_needed(elves, prefix, build)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    report.pth_imports = pth_imports(site_packages(prefix), prefix / "bin" / "python", env)
    report.load_failures = strip_breaks(elves, prefix, build)
    report.runtime_loads = check_runtime_loads(elves, prefix, build)
    report.unresolved_loads = report.runtime_loads.unresolved
    # Last, as in runtime.nix's installPhase (the ELF checks above read no patched file).
    report.overlay_errors, report.overlay = apply_overlay(site_packages(prefix), line, prefix / "bin" / "python")
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--line",
                    help="the runtime line to replay (default: the default line, as `nix build .#runtime`)")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE,
                    help=f"wheel cache directory (default {DEFAULT_CACHE})")
    ap.add_argument("--prefix", type=Path, help="install here and keep it (default: a temporary directory)")
    ap.add_argument("--offline", action="store_true", help="fail instead of fetching what is not cached")
    ap.add_argument("--json", type=Path, help="also write the report as JSON")
    args = ap.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        line = load_line(args.line)
        if args.prefix is not None:
            if args.prefix.exists() and any(args.prefix.iterdir()):
                raise ReplayError(f"--prefix {args.prefix} is not empty")
            report = replay(args.cache, args.prefix, args.offline, line=line, log=log)
        else:
            with tempfile.TemporaryDirectory(prefix="dspark-replay-") as tmp:
                report = replay(args.cache, Path(tmp) / "runtime", args.offline, line=line, log=log)
    except ReplayError as e:
        print(f"replay-runtime: {e}", file=sys.stderr)
        return 2
    print(report.text())
    if args.json:
        data = {k: getattr(report, k) for k in ("wheels", "elf_objects", "line", "overlay",
                                                 *(k for k, _ in Report.SECTIONS))}
        loads = report.runtime_loads
        outcomes = ("resolved", "glibc", "driver", "absent", "unresolved")
        data["runtime_loads"] = {"objects": loads.objects, "checked": loads.checked,
                                 **{k: getattr(loads, k) for k in outcomes}}
        args.json.write_text(json.dumps(dict(data, ok=report.ok), indent=1) + "\n")
    return 0 if report.ok else 1

