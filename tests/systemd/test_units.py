"""The rendered unit texts: what they say, that `systemd-analyze verify` accepts them (and
rejects broken ones), `dspark systemd render/install`, and the NixOS module's unit names."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dspark.config.schema import SupervisorConfig
from dspark.local.cluster import LocalPorts, prepare
from dspark.node.policy import BACKOFF_MAX_S, backoff_delay
from dspark.units.dropins import NodeRole, node_dropins, node_units
from dspark.units.names import (
    DASHBOARD,
    HEAD,
    LOCAL_PAIR_DROPIN,
    NODE_DROPIN,
    READY_TARGET,
    SYSTEM_UNIT_DIR,
    SYSUSERS_FILE,
    UNIT_NAMES,
    WAIT_WORKER,
    WORKER,
    WORKER_TEMPLATE,
)
from dspark.units.render import START_LIMIT, START_TIMEOUT, WATCHDOG_S, exec_quote, render_units

ROOT = Path(__file__).resolve().parents[2]
DSPARK_BIN = str(Path(sys.executable).parent / "dspark")

needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                   reason="systemd-analyze not found (apt-get install systemd; .ci/setup --system)")


def dspark(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dspark", *args], capture_output=True, text=True, timeout=timeout)


def settings(text: str) -> dict[str, list[str]]:
    """Key -> values (in order) of a unit text, all sections together; comments left out."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith(("#", "[")) and "=" in line:
            k, v = line.split("=", 1)
            out.setdefault(k, []).append(v)
    return out


def verify(*paths: Path) -> tuple[bool, str]:
    """systemd-analyze verify, strictly: any diagnostic counts (252 only warns on bad keys)."""
    r = subprocess.run(["systemd-analyze", "verify", *map(str, paths)], capture_output=True, text=True, timeout=60)
    output = (r.stdout + r.stderr).strip()
    return r.returncode == 0 and not output, output


@pytest.fixture
def rendered(tmp_path) -> Path:
    out = tmp_path / "units"
    r = dspark("systemd", "render", "--out", str(out), "--dspark-bin", DSPARK_BIN)
    assert r.returncode == 0, r.stderr
    return out


def test_render_writes_every_unit(rendered):
    assert sorted(p.name for p in rendered.iterdir()) == sorted(UNIT_NAMES)


@pytest.mark.systemd
@needs_analyze
def test_every_rendered_unit_passes_verify(rendered):
    ok, output = verify(*sorted(rendered.iterdir()))
    assert ok, output


@pytest.mark.systemd
@needs_analyze
@pytest.mark.parametrize("breakage", [
    ("Type=notify", "Type=notifyy"),                        # a bad value
    ("KillMode=mixed", "KilMode=mixed"),                     # a misspelled key
    ("Requires=dspark-worker-ready.target", "Requires=dspark-worker-redy.target"),  # unknown unit
    ("ExecStart=" + DSPARK_BIN, "ExecStart=/nonexistent/dspark"),                   # no such program
])
def test_bad_unit_text_fails_verify(rendered, breakage):
    old, new = breakage
    head = rendered / HEAD
    text = head.read_text()
    assert old in text
    head.write_text(text.replace(old, new))
    ok, output = verify(head)
    assert not ok and output


def test_node_units_are_notify_watchdog_restart_on_failure_and_sandboxed():
    units = render_units(DSPARK_BIN)
    for name in (HEAD, WORKER):
        s = settings(units[name])
        assert s["Type"] == ["notify"] and s["NotifyAccess"] == ["main"]
        assert s["WatchdogSec"] == [f"{WATCHDOG_S}s"]
        assert s["Restart"] == ["on-failure"] and s["RestartPreventExitStatus"] == ["2"]
        assert s["KillMode"] == ["mixed"]
        stop_s = int(s["TimeoutStopSec"][0].rstrip("s"))
        d = SupervisorConfig()
        assert stop_s > d.drain_s + d.stop_grace_s + 15  # the head's drain, vLLM's grace, the group sweep
        assert s["TimeoutStartSec"] == [START_TIMEOUT]
        for key, value in (("ProtectSystem", "strict"), ("NoNewPrivileges", "yes"), ("PrivateTmp", "yes"),
                           ("PrivateDevices", "no"), ("DevicePolicy", "closed"), ("LimitMEMLOCK", "infinity")):
            assert s[key] == [value], key
        assert any("nvidia-frontend" in d for d in s["DeviceAllow"])
        assert s["CacheDirectory"] == ["dspark"]
        env = dict(e.split("=", 1) for e in s["Environment"])
        for var in ("TRITON_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE", "CUTE_DSL_CACHE_DIR", "VLLM_CACHE_ROOT",
                    "TORCHINDUCTOR_CACHE_DIR"):
            assert env[var].startswith("%C/dspark/"), var
    head = settings(units[HEAD])
    assert READY_TARGET in head["Requires"] and READY_TARGET in " ".join(head["After"])
    target = settings(units[READY_TARGET])
    assert target["Requires"] == [WAIT_WORKER] and target["After"] == [WAIT_WORKER]
    wait = settings(units[WAIT_WORKER])
    assert wait["Type"] == ["oneshot"] and wait["ExecStart"] == [f"{DSPARK_BIN} wait-worker"]
    assert settings(units[DASHBOARD])["ExecStart"] == [f"{DSPARK_BIN} dashboard"]


def test_every_relaxation_carries_a_comment():
    text = render_units(DSPARK_BIN)[HEAD]
    lines = text.splitlines()
    for key in ("PrivateDevices=no", "LimitMEMLOCK=infinity", "ProtectHome=read-only", "LimitNOFILE="):
        i = next(n for n, line in enumerate(lines) if line.startswith(key))
        assert lines[i - 1].startswith("#"), key
    for i, line in enumerate(lines):
        if line.startswith("DeviceAllow="):
            assert lines[i - 1].startswith("#"), line


def test_exec_lines_escape_specifiers_and_quote_blanks():
    assert exec_quote("/opt/d spark/bin/dspark") == '"/opt/d spark/bin/dspark"'
    assert exec_quote("/opt/100%/dspark") == "/opt/100%%/dspark"
    assert exec_quote("/opt/$HOME/dspark") == "/opt/$$HOME/dspark"


def test_backoff_grows_and_is_bounded():
    delays = [backoff_delay(n) for n in range(0, 12)]
    assert delays[:6] == [0, 0, 5, 10, 20, 40]
    assert delays == sorted(delays) and max(delays) == BACKOFF_MAX_S
    # The start limit is only a net: with the backoff, its burst needs longer than its interval.
    interval_s = int(START_LIMIT[0].rstrip("min")) * 60
    assert sum(backoff_delay(n) for n in range(START_LIMIT[1])) > interval_s


@pytest.fixture
def cluster_file(tmp_path) -> Path:
    return prepare(tmp_path / "local", LocalPorts(api=28000, master=28001, agent=28002))


def test_install_under_a_root_writes_units_drop_ins_and_the_user(tmp_path, cluster_file):
    root = tmp_path / "root"
    r = dspark("systemd", "install", "--root", str(root), "--node", "local-head", "--node", "local-worker",
               "--config", str(cluster_file), "--dspark-bin", DSPARK_BIN)
    assert r.returncode == 0, r.stderr
    assert "nothing reloaded" in r.stdout
    unit_dir = root / SYSTEM_UNIT_DIR
    assert all((unit_dir / name).is_file() for name in UNIT_NAMES)
    head = (unit_dir / f"{HEAD}.d" / NODE_DROPIN).read_text()
    assert "Environment=DSPARK_NODE=local-head" in head and f"Environment=DSPARK_CONFIG={cluster_file}" in head
    assert "DSPARK_NODE=local-worker" in (unit_dir / f"{WORKER}.d" / NODE_DROPIN).read_text()
    both = settings((unit_dir / f"{HEAD}.d" / LOCAL_PAIR_DROPIN).read_text())
    assert both == {"Wants": [WORKER], "After": [WORKER], "PrivateTmp": ["no"],
                    "ReadWritePaths": ["/tmp /var/tmp"]}
    assert "PrivateTmp=no" in (unit_dir / f"{WORKER}.d" / LOCAL_PAIR_DROPIN).read_text()
    assert re.search(r"^u dspark ", (root / SYSUSERS_FILE).read_text(), re.M)


def test_install_of_one_node_has_no_local_ordering(tmp_path, cluster_file):
    root = tmp_path / "root"
    r = dspark("systemd", "install", "--root", str(root), "--node", "local-head", "--config", str(cluster_file),
               "--dspark-bin", DSPARK_BIN)
    assert r.returncode == 0, r.stderr
    assert not (root / SYSTEM_UNIT_DIR / f"{HEAD}.d" / LOCAL_PAIR_DROPIN).exists()
    assert not (root / SYSTEM_UNIT_DIR / f"{WORKER}.d").exists()


def test_install_refuses_an_unknown_node(tmp_path, cluster_file):
    r = dspark("systemd", "install", "--root", str(tmp_path), "--node", "nope", "--config", str(cluster_file))
    assert r.returncode == 2 and "nope" in r.stderr


def test_render_prints_the_node_drop_ins(cluster_file):
    r = dspark("systemd", "render", "--node", "local-worker", "--config", str(cluster_file), "--dspark-bin", DSPARK_BIN)
    assert r.returncode == 0, r.stderr
    assert f"### {WORKER}.d/{NODE_DROPIN}" in r.stdout and "DSPARK_NODE=local-worker" in r.stdout


def test_the_nixos_module_names_only_rendered_units():
    text = (ROOT / "modules" / "dspark.nix").read_text()
    named = set(re.findall(r"systemd\.services\.(dspark-[a-z-]+)", text))
    assert named == {"dspark-head", "dspark-worker", "dspark-wait-worker", "dspark-dashboard"}
    assert {f"{n}.service" for n in named} <= set(UNIT_NAMES)
    # The module renders nothing itself: the package's units come from `dspark systemd render`.
    package = (ROOT / "nix" / "package.nix").read_text()
    assert "systemd render --out" in package and "systemd.packages = [ cfg.package ]" in text


# ------------------------------------------------------------------ several workers on one host
RING = ("local-head", "local-worker", "local-worker-2", "local-worker-3")
RING_WORKERS = tuple(f"dspark-worker@{n}.service" for n in RING[1:])


@pytest.fixture
def ring_file(tmp_path) -> Path:
    return prepare(tmp_path / "ring", LocalPorts(api=28010, master=28011, agent=28012), nodes=4)


def install_ring(tmp_path: Path, ring_file: Path, *names: str) -> tuple[Path, subprocess.CompletedProcess]:
    root = tmp_path / "root"
    args = [a for n in names for a in ("--node", n)]
    r = dspark("systemd", "install", "--root", str(root), *args, "--config", str(ring_file),
               "--dspark-bin", DSPARK_BIN)
    return root / SYSTEM_UNIT_DIR, r


def test_the_worker_template_is_the_worker_unit_per_instance():
    units = render_units(DSPARK_BIN)
    plain, template = settings(units[WORKER]), settings(units[WORKER_TEMPLATE])
    # Its own state directory per instance (failure history, start count), the node from the name.
    assert template["ExecStart"] == [f"{DSPARK_BIN} serve --check --state-dir %S/dspark/worker-%i"]
    assert template["StateDirectory"] == ["dspark dspark/worker-%i"]
    assert "DSPARK_NODE=%i" in template["Environment"]
    # Everything else is the one-worker unit's, restart policy and hardening included.
    differ = {"ExecStart", "StateDirectory", "Environment", "Description", "SyslogIdentifier"}
    assert {k: v for k, v in template.items() if k not in differ} == {k: v for k, v in plain.items() if k not in differ}
    assert [e for e in template["Environment"] if e != "DSPARK_NODE=%i"] == plain["Environment"]
    # No systemd binding between node units: a worker's failure must not turn into a clean stop of the head.
    for text in units.values():
        assert not {"BindsTo", "PartOf"} & set(settings(text))


def test_install_of_a_ring_host_runs_each_worker_as_an_instance(tmp_path, ring_file):
    unit_dir, r = install_ring(tmp_path, ring_file, *RING)
    assert r.returncode == 0, r.stderr
    # The hint starts the workers first, then the head.
    assert r.stdout.splitlines()[-1].startswith("next: systemctl start " + " ".join(RING_WORKERS)
                                                + " dspark-head.service")
    for name, unit in zip(RING[1:], RING_WORKERS, strict=True):
        node = settings((unit_dir / f"{unit}.d" / NODE_DROPIN).read_text())
        assert node["Environment"] == [f"DSPARK_NODE={name}", f"DSPARK_CONFIG={ring_file}"]
        assert settings((unit_dir / f"{unit}.d" / LOCAL_PAIR_DROPIN).read_text()) == {
            "PrivateTmp": ["no"], "ReadWritePaths": ["/tmp /var/tmp"]}
    assert not (unit_dir / f"{WORKER}.d").exists()  # the one-worker unit is not used here
    head = settings((unit_dir / f"{HEAD}.d" / LOCAL_PAIR_DROPIN).read_text())
    assert head["Wants"] == [" ".join(RING_WORKERS)] and head["After"] == [" ".join(RING_WORKERS)]
    wait = settings((unit_dir / f"{WAIT_WORKER}.d" / LOCAL_PAIR_DROPIN).read_text())
    assert wait == {"After": [" ".join(RING_WORKERS)]}


@needs_analyze
def test_an_installed_ring_passes_verify_with_its_drop_ins(tmp_path, ring_file):
    unit_dir, r = install_ring(tmp_path, ring_file, *RING)
    assert r.returncode == 0, r.stderr
    # systemd-analyze reads the units and their drop-ins from SYSTEMD_UNIT_PATH (the trailing
    # ':' appends the built-in search path, where network-online.target lives).
    env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{unit_dir}:"}
    out = subprocess.run(["systemd-analyze", "verify", *RING_WORKERS, HEAD, WAIT_WORKER, READY_TARGET],
                         capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert out.returncode == 0 and not (out.stdout + out.stderr).strip(), out.stdout + out.stderr
    # And it does read the drop-ins: a broken key in one is reported.
    dropin = unit_dir / f"{RING_WORKERS[1]}.d" / LOCAL_PAIR_DROPIN
    dropin.write_text(dropin.read_text().replace("PrivateTmp=no", "PrivateTmpp=no"))
    out = subprocess.run(["systemd-analyze", "verify", RING_WORKERS[1]], capture_output=True, text=True,
                         timeout=60, env=env, cwd=tmp_path)
    assert "PrivateTmpp" in out.stdout + out.stderr


def test_a_host_of_two_workers_without_the_head(tmp_path, ring_file):
    unit_dir, r = install_ring(tmp_path, ring_file, "local-worker-2", "local-worker-3")
    assert r.returncode == 0, r.stderr
    assert "DSPARK_NODE=local-worker-3" in (unit_dir / f"{RING_WORKERS[2]}.d" / NODE_DROPIN).read_text()
    assert (unit_dir / f"{RING_WORKERS[1]}.d" / LOCAL_PAIR_DROPIN).is_file()  # they share /tmp
    assert not (unit_dir / f"{HEAD}.d").exists() and not (unit_dir / f"{WAIT_WORKER}.d").exists()
    assert r.stdout.splitlines()[-1].startswith(f"next: systemctl start {RING_WORKERS[1]} {RING_WORKERS[2]} ")


def test_one_worker_of_a_ring_keeps_the_one_worker_unit(tmp_path, ring_file):
    unit_dir, r = install_ring(tmp_path, ring_file, "local-worker-3")
    assert r.returncode == 0, r.stderr
    assert "DSPARK_NODE=local-worker-3" in (unit_dir / f"{WORKER}.d" / NODE_DROPIN).read_text()
    assert not any(p.name.startswith("dspark-worker@") and p.is_dir() for p in unit_dir.iterdir())


def test_a_node_name_that_cannot_name_an_instance_is_refused():
    nodes = [NodeRole("w one", False), NodeRole("w2", False)]
    with pytest.raises(ValueError, match="node 'w one' cannot name a dspark-worker@.service instance"):
        node_dropins(nodes)
    assert node_units([NodeRole("w one", False)]) == {"w one": WORKER}  # alone it needs no instance


def test_install_refuses_a_node_given_twice(tmp_path, ring_file):
    _, r = install_ring(tmp_path, ring_file, "local-worker-2", "local-worker-2")
    assert r.returncode == 2 and "local-worker-2 given more than once" in r.stderr
