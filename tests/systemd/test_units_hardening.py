"""The rendered units' sandbox, as `systemd-analyze security` rates it (offline,
on the unit files as shipped): at most EXPOSURE_MAX for every service (the node units were at
3.5; nixpkgs' CUDA services reach 1.5), and every setting it still counts as exposed is
explained by a comment in the unit. The same rating of the loaded units, with the pair
serving under them, is in test_under_systemd.py."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dspark.units.install import write_files
from dspark.units.names import DASHBOARD, HEAD, WAIT_WORKER, WORKER, WORKER_TEMPLATE
from dspark.units.render import render_units

DSPARK_BIN = str(Path(sys.executable).parent / "dspark")
EXPOSURE_MAX = 2.0
SERVICES = (HEAD, WORKER, WORKER_TEMPLATE, WAIT_WORKER, DASHBOARD)

pytestmark = [pytest.mark.systemd,
              pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                 reason="systemd-analyze not found (apt-get install systemd; .ci/setup --system)")]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("units")
    write_files(render_units(DSPARK_BIN), out)
    return out


def security(unit: Path, *args: str) -> str:
    r = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--no-pager", *args, str(unit)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def exposure(unit: Path) -> float:
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", security(unit))
    assert m, f"no overall exposure level for {unit.name}"
    return float(m.group(1))


@pytest.mark.parametrize("name", SERVICES)
def test_every_service_is_rated_at_most_the_bound(rendered, name):
    level = exposure(rendered / name)
    print(f"{name}: exposure {level}")
    assert level <= EXPOSURE_MAX


def explained(directive: str, comments: str) -> bool:
    """`systemd-analyze security` names an exposed setting as `Key=`, `Key=~@group`,
    `Key=~AF_X` or `A=/B=`: each key (and the group or family) must be named in a comment."""
    keys = re.findall(r"(\w+)=", directive)
    extra = re.findall(r"~(@[\w-]+|AF_[A-Z0-9]+)", directive)
    return bool(keys) and all(k + "=" in comments for k in keys) and all(x in comments for x in extra)


@pytest.mark.parametrize("name", (HEAD, WORKER, WORKER_TEMPLATE))
def test_every_exposed_setting_of_a_node_unit_is_explained_in_the_unit(rendered, name):
    text = (rendered / name).read_text()
    comments = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    rows = json.loads(security(rendered / name, "--json=short"))
    exposed = [r["name"] for r in rows if r.get("exposure") not in (None, "0.0")]
    assert exposed, "systemd-analyze rated nothing as exposed: the JSON changed?"
    unexplained = [d for d in exposed if not explained(d, comments)]
    assert unexplained == [], unexplained


def test_the_hardening_settings_are_in_the_rendered_units(rendered):
    text = (rendered / HEAD).read_text()
    for line in ("ProtectProc=invisible", "RemoveIPC=yes", "PrivateUsers=yes", "SystemCallFilter=@system-service",
                 "SystemCallFilter=~@privileged", "SystemCallErrorNumber=EPERM", "PrivateMounts=yes",
                 "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK",
                 "DeviceAllow=char-nvidia-uvm rw"):
        assert line in text.splitlines(), line
    # ptrace (and perf) stay out: @debug is in neither the allow list nor @system-service.
    r = subprocess.run(["systemd-analyze", "syscall-filter", "@system-service"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "ptrace" not in r.stdout.split() and "@debug" not in r.stdout.split()
    filters = [line.split("=", 1)[1] for line in text.splitlines() if line.startswith("SystemCallFilter=")]
    assert filters == ["@system-service", "~@privileged"]
