"""Runtime lines on the Nix side: one runtime per runtime line (nix/lines.nix reading
src/dspark/data/runtime_lines.toml), built by the same nix/runtime.nix from that line's lock and
overlay series, one flake output each beside `.#runtime` (the default line).

Evaluated against the stand-in of nixpkgs' top level (tests/nix/stub-nixpkgs) with the real
nixpkgs.lib, as tests/nix/test_runtime_nix.py does; nothing is built. The overlay step of each line's
build (the install phase's own command, from the evaluated derivation) is run for real here on the
vLLM trees this machine has: vLLM 0.28.0 in .venv and vLLM 0.32.0 in .venv-lines/v0.32.0
(`.ci/setup`), the same Python sources as the CUDA wheels the locks pin.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dspark.lines import runtime as runtime_lines
from dspark.lines.overlay import read_series, touched_files
from tests.nix.nix_support import REPO, NixError, flake_with_stub, nix_eval, run_nix
from tests.nix.replay_wheels import rr

pytestmark = pytest.mark.nix

LINES = runtime_lines.load()
LOCKED = sorted(i for i, line in LINES.lines.items() if line.lock_state == "locked")
STORE_NAME = re.compile(r"/nix/store/[0-9a-z]{32}-(.+)")


def sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def nix_eval_stored(nix_instantiate: str, expr: str):
    """nix_eval, with every path the expression names copied into this machine's store (as Nix does
    when it instantiates a derivation), so that the store paths in the result exist here."""
    try:
        return json.loads(run_nix(nix_instantiate, "--eval", "--read-write-mode", "--strict", "--json", "-E", expr))
    except NixError as e:
        if "ermission denied" in str(e) or "read-only" in str(e):
            pytest.skip(f"this Nix store is not writable here, so no path can be copied into it: {e}")
        raise


def store_name(path: str) -> str:
    m = STORE_NAME.fullmatch(path)
    assert m, path
    return m.group(1)


def line_runtime(nix_instantiate, stub: Path, line: str, expr: str, stored: bool = False):
    return (nix_eval_stored if stored else nix_eval)(nix_instantiate, f"""
      let
        pkgs = import {stub} {{ config.allowUnfree = true; }};
        drv = pkgs.callPackage ./nix/runtime.nix {{ runtimeLine = (import ./nix/lines.nix).lines.{json.dumps(line)}; }};
      in {expr}""")


# ------------------------------------------------------------------ the lines, as Nix reads them
def test_lines_nix_is_the_data_every_locked_line_with_its_lock_and_series(nix_instantiate):
    """nix/lines.nix reads runtime_lines.toml itself (builtins only): the same lines, default, locks
    and series as dspark.lines.runtime and the replay read."""
    out = nix_eval_stored(nix_instantiate, "import ./nix/lines.nix")
    assert out["default"] == LINES.default == "v0.28.0"
    assert sorted(out["lines"]) == LOCKED and {"v0.28.0", "v0.32.0"} <= set(LOCKED)
    assert out["known"] == sorted(LINES.lines)
    assert out["defaultLine"] == out["lines"][LINES.default]
    for line_id, nix_line in out["lines"].items():
        line = LINES.get(line_id)
        assert nix_line["id"] == line_id and nix_line["vllm"] == line.vllm
        # A flake attribute name usable unquoted on the command line: `nix build .#runtime-v0_32_0`.
        assert nix_line["attr"] == "runtime-" + line_id.replace(".", "_")
        assert re.fullmatch(r"runtime-[A-Za-z0-9_'-]+", nix_line["attr"])
        # Paths reach the store with the repository file's content.
        assert sha256(nix_line["lock"]) == sha256(REPO / line.lock)
        assert sha256(nix_line["requirements"]) == sha256(REPO / line.requirements)
        names = [p["name"] for p in nix_line["series"]]
        assert names == list(line.series), line_id
        replay = rr.plan.load_line(line_id)
        assert replay.lock == REPO / line.lock and replay.vllm == line.vllm
        assert [p.name for p in replay.series] == names
        for patch, path in zip(nix_line["series"], replay.series, strict=True):
            assert store_name(patch["path"]) == patch["name"] and sha256(patch["path"]) == sha256(path)
        series_file = getattr(line, "series_file", None)  # the series file, where the data names one
        if series_file:
            assert ([sha256(p["path"]) for p in nix_line["series"]]
                    == [sha256(p) for p in read_series(REPO / series_file)])
    # The default line's series is the overlay's own series file, in its order.
    assert [p["name"] for p in out["lines"]["v0.28.0"]["series"]] == [p.name for p in read_series(REPO / "overlay")]
    assert rr.plan.load_line().id == LINES.default


def test_a_series_file_is_read_as_dspark_overlay_reads_it(nix_instantiate, tmp_path):
    """nix/lines.nix and the replay read a line's series file the same way: one patch a line, a
    path relative to the file's folder (a ported patch beside it, a kept one as ../../NNNN), `#`
    lines and blank lines skipped, the order kept; without series_file, `series.applies` from
    overlay/; a line without a complete lock gets no runtime; a missing patch stops both."""
    repo = tmp_path / "repo"
    (repo / "nix").mkdir(parents=True)
    shutil.copy(REPO / "nix/lines.nix", repo / "nix/lines.nix")
    (repo / "src/dspark/data").mkdir(parents=True)
    (repo / "overlay/lines/b").mkdir(parents=True)
    for rel in ("lock.json", "requirements.txt", "overlay/0001-kept.patch", "overlay/0002-old.patch",
                "overlay/lines/b/0002-old.patch", "overlay/lines/b/0003-new.patch"):
        (repo / rel).write_text(f"{rel}\n")
    (repo / "overlay/lines/b/series").write_text(
        "# a line's series\n# vllm-version: 9.1\n\n../../0001-kept.patch\n  0003-new.patch  \n0002-old.patch\n")
    common = 'lock = "lock.json"\nrequirements = "requirements.txt"\n'
    (repo / "src/dspark/data/runtime_lines.toml").write_text(
        'default = "a"\n'
        f'[lines.a]\nvllm = "9.0"\nlock_state = "locked"\n{common}[lines.a.series]\napplies = ["0002-old.patch"]\n'
        f'[lines.b]\nvllm = "9.1"\nlock_state = "locked"\n{common}series_file = "overlay/lines/b/series"\n'
        f'[lines.c]\nvllm = "9.2"\nlock_state = "draft"\n{common}series_file = "overlay/lines/c/series"\n')
    out = nix_eval_stored(nix_instantiate, f"import {repo}/nix/lines.nix")
    assert sorted(out["lines"]) == ["a", "b"] and out["known"] == ["a", "b", "c"]
    want = {"a": ["overlay/0002-old.patch"],
            "b": ["overlay/0001-kept.patch", "overlay/lines/b/0003-new.patch", "overlay/lines/b/0002-old.patch"]}
    for line_id, rels in want.items():
        series = out["lines"][line_id]["series"]
        assert [p["name"] for p in series] == [Path(r).name for r in rels]
        assert [Path(p["path"]).read_text() for p in series] == [f"{r}\n" for r in rels]  # the file itself
        replay = rr.plan.load_line(line_id, repo / "src/dspark/data/runtime_lines.toml", repo)
        assert list(replay.series) == [repo / r for r in rels]
    (repo / "overlay/lines/b/series").write_text("0004-gone.patch\n")
    with pytest.raises(NixError, match="names 0004-gone.patch, which is not there"):
        nix_eval_stored(nix_instantiate, f"(import {repo}/nix/lines.nix).lines.b.series")
    with pytest.raises(rr.plan.ReplayError, match="0004-gone.patch, which is not there"):
        rr.plan.load_line("b", repo / "src/dspark/data/runtime_lines.toml", repo)


# ------------------------------------------------------------------ the flake's outputs
def test_the_flake_has_one_runtime_per_line_and_runtime_stays_the_default(nix_instantiate, stub):
    out = nix_eval(nix_instantiate, flake_with_stub(stub) + """ let p = outputs.packages.aarch64-linux; in {
        names = builtins.attrNames p;
        x86 = builtins.attrNames outputs.packages.x86_64-linux;
        runtime = p.runtime.outPath;
        lines = nixpkgs.lib.mapAttrs (_: l: { name = p.${l.attr}.name; out = p.${l.attr}.outPath;
                                     line = p.${l.attr}.passthru.runtimeLine.id; })
                  (import ./nix/lines.nix).lines;
      }""")
    attrs = ["runtime-" + i.replace(".", "_") for i in LOCKED]
    assert out["names"] == sorted(["default", "dspark", "runtime", *attrs])
    assert out["x86"] == ["default", "dspark"]  # the locks are resolved for the aarch64 nodes only
    for line_id in LOCKED:
        got = out["lines"][line_id]
        assert got["name"] == f"dspark-runtime-{LINES.get(line_id).vllm}" and got["line"] == line_id
    # `nix build .#runtime` is the default line's runtime itself, not another build of it.
    assert out["runtime"] == out["lines"][LINES.default]["out"]
    assert out["lines"]["v0.32.0"]["out"] != out["runtime"]


def test_the_overlay_gives_every_lines_runtime(nix_instantiate, stub):
    out = nix_eval(nix_instantiate, f"""
      let
        flake = (import ./flake.nix).outputs {{
          self = flake; nixpkgs = {{ lib = import (import {stub}/lib-path.nix); }}; }};
        pkgs = import {stub} {{ config.allowUnfree = true; overlays = [ flake.overlays.default ]; }};
      in {{
        default = pkgs.dspark-runtime.name;
        lines = builtins.mapAttrs (_: d: d.name) pkgs.dspark-runtime-lines;
      }}""")
    assert out == {"default": "dspark-runtime-0.28.0",
                   "lines": {i: f"dspark-runtime-{LINES.get(i).vllm}" for i in LOCKED}}


@pytest.mark.parametrize("line_id", LOCKED)
def test_each_lines_runtime_installs_its_own_lock_and_applies_its_own_series(nix_instantiate, stub, line_id):
    line = LINES.get(line_id)
    lock = json.loads((REPO / line.lock).read_text())
    out = line_runtime(nix_instantiate, stub, line_id, "{ inherit (drv) installPhase version; }")
    assert out["version"] == line.vllm
    install = out["installPhase"]
    wheels = [ln.strip().rsplit("/nix/store/00000000000000000000000000000000-", 1)[1]
              for ln in install.splitlines() if " -m installer " in ln]
    assert wheels == [p["filename"] for p in lock["packages"]]  # the line's lock, in its order
    vllm = next(p for p in lock["packages"] if p["name"] == "vllm")
    assert vllm["version"] == line.vllm and vllm["filename"] in wheels
    command = overlay_command(install)
    args = command.split()
    assert args[args.index("--vllm-version") + 1] == line.vllm
    patches = [a for a in args if a.endswith(".patch")]
    assert [store_name(p) for p in patches] == list(line.series)
    # After every wheel: the overlay patches the installed vLLM.
    joined = install.replace("\\\n", " ")
    assert joined.index(command) > joined.rindex(" -m installer ")


def test_the_lines_differ_only_in_what_the_line_gives(nix_instantiate, stub):
    a, b = (line_runtime(nix_instantiate, stub, i, "{ inherit (drv) postFixup dontStrip autoPatchelfIgnoreMissingDeps "
                                                   "appendRunpaths; buildInputs = map (d: d.name) drv.buildInputs; }")
            for i in ("v0.28.0", "v0.32.0"))
    assert a == b  # runtime-build.json drives both: the same wrappers, libraries and RPATHs


# ------------------------------------------------------------------ the overlay step, for real
def overlay_command(install: str) -> str:
    """The install phase's overlay step, as one line (its continuation joined)."""
    text = install.replace("\\\n", " ")
    (line,) = [ln.strip() for ln in text.splitlines() if "apply-overlay.py" in ln]
    return line


def site_of(version: str) -> Path | None:
    """The vLLM tree of that release on this machine (tests/lines/test_runtime_lines.py's lookup)."""
    if version == "0.28.0":
        spec = importlib.util.find_spec("vllm")
        return Path(spec.origin).parent.parent if spec and spec.origin else None
    site = os.environ.get(f"DSPARK_VLLM_{version.replace('.', '')[:3]}_SITE")
    if site:
        return Path(site)
    from dspark.local.cluster import lines_dir

    found = sorted((lines_dir() / f"v{version}").glob("lib/python3*/site-packages"))
    return found[0] if found else None


def tree(version: str) -> Path:
    site = site_of(version)
    if site is None or not (site / "vllm").is_dir():
        pytest.skip(f"no vLLM {version} tree here (.ci/setup installs 0.28.0 into .venv and 0.32.0 into "
                    f".venv-lines/v0.32.0; or set DSPARK_VLLM_0{version.split('.')[1]}_SITE)")
    return site


def stage_prefix(tmp_path: Path, site: Path) -> tuple[Path, Path]:
    """A runtime prefix laid out as runtime.nix's $out (bin/python, lib/python3.12/site-packages)
    holding the files of `site` the overlay reads: vllm/_version.py and every file any series
    touches. Returns (prefix, its site-packages)."""
    out = tmp_path / "out"
    staged = out / "lib" / "python3.12" / "site-packages"
    rels = {"vllm/_version.py"} | {rel for p in (REPO / "overlay").rglob("*.patch") for rel in touched_files(p)}
    for rel in sorted(rels):
        if (site / rel).is_file():
            (staged / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(site / rel, staged / rel)
    (out / "bin").mkdir(parents=True)
    (out / "bin" / "python").symlink_to(Path(sys.executable))
    # Stock files: .ci/setup applies each line's local series (overlay/local-series) to the
    # installed tree the local pair runs; reversed here (tests/overlay/stock_tree.py).
    spec = importlib.util.spec_from_file_location("dspark_stock_tree", REPO / "tests" / "overlay" / "stock_tree.py")
    stock_tree = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stock_tree)
    stock_tree.make_stock(staged)
    return out, staged


def run_overlay_step(nix_instantiate, stub, line_id: str, out: Path) -> subprocess.CompletedProcess:
    """The evaluated derivation's own overlay command, run by bash with $out set (its store paths
    real: the evaluation copied the overlay tool, apply-overlay.py and the patches into this store)."""
    command = overlay_command(line_runtime(nix_instantiate, stub, line_id, "drv.installPhase", stored=True))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return subprocess.run(["bash", "-euc", command], env=dict(env, out=str(out)), capture_output=True, text=True,
                          timeout=300)


def digests(site: Path) -> dict[str, str]:
    return {str(p.relative_to(site)): sha256(p) for p in sorted(site.rglob("*.py"))}


@pytest.mark.parametrize("line_id", LOCKED)
def test_the_builds_overlay_step_applies_the_lines_series_to_its_vllm(nix_instantiate, stub, tmp_path, line_id):
    line = LINES.get(line_id)
    out, site = stage_prefix(tmp_path, tree(line.vllm))
    before = digests(site)
    r = run_overlay_step(nix_instantiate, stub, line_id, out)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == f"applied {len(line.series)} patches: " + ", ".join(line.series)
    changed = {rel for rel, h in digests(site).items() if before.get(rel) != h}
    patches = rr.plan.load_line(line_id).series  # each from overlay/lines/<id>/ or overlay/, as nix/lines.nix
    touched = {rel for patch in patches for rel in touched_files(patch)}
    assert changed and changed <= touched
    # The tree now carries exactly the line's series: it reverses cleanly, in dspark.lines.overlay's own check.
    overlay_dir = tmp_path / "series"
    overlay_dir.mkdir()
    for patch in patches:
        (overlay_dir / patch.name).symlink_to(patch)
    (overlay_dir / "series").write_text("\n".join(line.series) + "\n")
    from dspark.lines import overlay

    assert overlay.is_applied(site, overlay_dir)


@pytest.mark.parametrize("line_id, other", [("v0.28.0", "0.32.0"), ("v0.32.0", "0.28.0")])
def test_a_lines_build_refuses_another_releases_vllm(nix_instantiate, stub, tmp_path, line_id, other):
    """The version the tree must hold is the line's: a lock that installed another vLLM stops the
    build with dspark.lines.overlay's message, and nothing is patched."""
    out, site = stage_prefix(tmp_path, tree(other))
    before = digests(site)
    r = run_overlay_step(nix_instantiate, stub, line_id, out)
    assert r.returncode == 1
    assert (f"written for vLLM {LINES.get(line_id).vllm}; " in r.stderr and f"holds vLLM {other}" in r.stderr
            and "Traceback" not in r.stderr), r.stderr
    assert digests(site) == before
