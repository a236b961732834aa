"""The units' sandbox on NixOS: the package's node units (`dspark systemd render`) with the drop-in
the module writes for them (User=, the environment, the head's credential) as
`systemd-analyze security` rates them: the module relaxes none of the units' sandbox, so a
NixOS host's units are rated as the rendered ones, at most EXPOSURE_MAX."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from dspark.units.render import render_units
from tests.nix.test_module import _service_dropin, host

pytestmark = [pytest.mark.nix,
              pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")]

EXPOSURE_MAX = 2.0


def exposure(root, unit: str) -> float:
    r = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--no-pager", f"--root={root}", unit],
                       capture_output=True, text=True, timeout=120)
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", r.stdout)
    assert r.returncode == 0 and m, r.stdout + r.stderr
    return float(m.group(1))


@pytest.mark.parametrize("node, unit", [("spark-a", "dspark-head"), ("spark-b", "dspark-worker")])
def test_the_module_relaxes_none_of_the_units_sandbox(evaluate, tmp_path, node, unit):  # noqa: F811
    out = evaluate(host(node, apiKeyFile="/run/secrets/dspark-api-key", environmentFile="/run/secrets/dspark.env"))
    unit_dir = tmp_path / "etc" / "systemd" / "system"
    unit_dir.mkdir(parents=True)
    (unit_dir / f"{unit}.service").write_text(render_units("/run/current-system/sw/bin/dspark")[f"{unit}.service"])
    shipped = exposure(tmp_path, f"{unit}.service")
    dropin = unit_dir / f"{unit}.service.d" / "overrides.conf"
    dropin.parent.mkdir()
    dropin.write_text(_service_dropin(out["services"][unit]))
    assert "User=dspark" in dropin.read_text()
    on_nixos = exposure(tmp_path, f"{unit}.service")
    print(f"{unit}: exposure {shipped} rendered, {on_nixos} with the module's drop-in")
    assert on_nixos == shipped <= EXPOSURE_MAX
