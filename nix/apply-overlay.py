"""Apply one runtime line's overlay series to an installed vLLM tree: what nix/runtime.nix runs in
its install phase, and nix/replay_runtime after its install (so the two cannot drift).

    python3 nix/apply-overlay.py --vllm-version 0.32.0 SITE_PACKAGES PATCH...

The patches are the line's series in order (nix/lines.nix: the line's series file), each its own
path (in the Nix build, its own store path). They are applied by dspark.lines.overlay (all or nothing,
`patch -F0`) from a directory holding them and a `series` file naming them, headed with the line's
release (`# vllm-version:`), which the tree must hold. An empty series only checks the release.
Needs dspark's src/ on PYTHONPATH; standard library only otherwise. Exit status: dspark.lines.overlay's.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

from dspark.lines import overlay

# A file copied into the Nix store is named <hash>-<name>; the series names it by <name>.
_STORE_NAME = re.compile(r"[0-9a-z]{32}-(.+)")


def patch_name(path: Path) -> str:
    m = _STORE_NAME.fullmatch(path.name)
    return m.group(1) if m and path.parent.name == "store" else path.name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-version", required=True, help="the line's vLLM release (runtime_lines.toml's vllm)")
    ap.add_argument("site_packages", type=Path)
    ap.add_argument("patches", type=Path, nargs="*", help="the line's series, in order")
    args = ap.parse_args(argv)
    if not args.patches:
        try:
            version = overlay.check_version(args.site_packages, args.vllm_version)
        except overlay.OverlayError as e:
            print(f"dspark overlay: {e}", file=sys.stderr)
            return 1
        print(f"vLLM {version}: the line's series is empty; nothing to apply")
        return 0
    with tempfile.TemporaryDirectory(prefix="dspark-line-overlay-") as tmp:
        d = Path(tmp)
        names = [patch_name(p) for p in args.patches]
        for name, patch in zip(names, args.patches, strict=True):
            (d / name).symlink_to(patch.absolute())
        (d / "series").write_text(f"# vllm-version: {args.vllm_version}\n" + "".join(f"{name}\n" for name in names))
        return overlay.main(["apply", str(args.site_packages), "--overlay-dir", str(d)])


if __name__ == "__main__":
    sys.exit(main())
