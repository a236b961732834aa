"""nix/replay_runtime on every runtime line: `--line ID` replays that line's build
(its lock, the shared runtime-build.json, and last its overlay series through nix/apply-overlay.py,
as nix/runtime.nix's install phase does), without nixpkgs.

The full replay of a line runs only where its locked wheels are cached ($DSPARK_WHEEL_CACHE, else
the replay's default cache; about 3.9 GB: `python3 -m nix.replay_runtime --line ID --cache DIR`),
a developer's machine, not CI (tests/nix/replay_wheels.py says why), and says which are missing
otherwise; the default line's is tests/nix/test_replay.py's. The
replay's overlay step runs for real everywhere the line's vLLM tree is installed (.ci/setup puts
vLLM 0.32.0's CPU build, the same Python sources, into .venv-lines/v0.32.0).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dspark.lines import runtime as runtime_lines
from tests.nix.nix_support import REPO
from tests.nix.replay_wheels import CACHE, rr
from tests.nix.test_runtime_lines_nix import stage_prefix, tree

pytestmark = pytest.mark.nix

LINES = runtime_lines.load()
OTHER_LINES = sorted(i for i, line in LINES.lines.items() if line.lock_state == "locked" and i != LINES.default)


@pytest.mark.parametrize("line_id", OTHER_LINES)
def test_full_replay_of_the_line_is_clean(tmp_path, line_id):
    line = rr.plan.load_line(line_id)
    wheels, build = rr.plan.load_plan(line.lock)
    missing = [w.filename for w in [*wheels, rr.plan.installer_wheel(build)] if not (CACHE / w.filename).is_file()]
    if missing:
        pytest.skip(f"{len(missing)} of the {line_id} line's locked wheels are not cached in {CACHE} (first: "
                    f"{missing[0]}); fetch them with `python3 -m nix.replay_runtime --line {line_id} --cache "
                    f"{CACHE}` (about 3.9 GB; not in CI) or set DSPARK_WHEEL_CACHE")
    proc = subprocess.run([sys.executable, "-m", "nix.replay_runtime", "--line", line_id, "--cache",
                           str(CACHE), "--offline", "--prefix", str(tmp_path / "runtime"),
                           "--json", str(tmp_path / "r.json")], cwd=REPO, capture_output=True, text=True,
                          timeout=3600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["ok"] is True and report["line"] == line_id and report["wheels"] == len(wheels)
    assert report["elf_objects"] > 400
    series = LINES.get(line_id).series
    assert report["overlay"] == f"applied {len(series)} patches: " + ", ".join(series)
    # The installed vLLM is the line's release (the version apply-overlay.py also checked).
    version = (rr.wheels.site_packages(tmp_path / "runtime") / "vllm" / "_version.py").read_text()
    assert f"'{LINES.get(line_id).vllm}'" in version


def test_the_replays_overlay_step_on_the_v032_tree(tmp_path):
    """The replay's last step (apply_overlay) on the vLLM 0.32.0 tree: the same apply-overlay.py
    the build runs, the line's series from the data; a second run finds the series applied."""
    out, site = stage_prefix(tmp_path, tree("0.32.0"))
    line = rr.plan.load_line("v0.32.0")
    problems, said = rr.wheels.apply_overlay(site, line, out / "bin" / "python")
    series = LINES.get("v0.32.0").series
    assert problems == [] and said == f"applied {len(series)} patches: " + ", ".join(series)
    again, said = rr.wheels.apply_overlay(site, line, out / "bin" / "python")
    assert again and "already carries the overlay series" in said


def test_an_unknown_or_unlocked_line_is_one_line_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "nix.replay_runtime", "--line", "v9.9.9", "--cache",
                           str(tmp_path), "--offline"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr == (f"replay-runtime: 'v9.9.9' is not a runtime line; known: "
                           f"{', '.join(sorted(LINES.lines))}\n")
    data = tmp_path / "lines.toml"
    data.write_text((REPO / "src/dspark/data/runtime_lines.toml").read_text()
                    .replace('lock_state = "locked"', 'lock_state = "draft"'))
    with pytest.raises(rr.plan.ReplayError, match="runtime line v0.32.0 has no complete lock"):
        rr.plan.load_line("v0.32.0", data)
