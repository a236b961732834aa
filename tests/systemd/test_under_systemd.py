"""The project's own units under a real systemd (in a systemd-nspawn container made for this
module and always removed), running the real local vLLM pair.

The tests run in file order against one container and one installed appliance: start,
status, a worker kill, a hung head, a wedged worker, the head started alone (cross-host ordering), stop.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request

import pytest

from appliance import CLUSTER_DIR, UNITS, Appliance, install
from nspawn_container import Container, missing_requirements

from dspark.local import HEAD_NAME, SERVED_NAME, WORKER_NAME

pytestmark = [pytest.mark.systemd,
              pytest.mark.skipif(missing_requirements() is not None, reason=f"systemd tests: {missing_requirements()}")]

START_S = 600      # a pair start on a loaded 2-core machine (about 50 s when idle)
DETECT_S = 15      # the bound for detecting a worker death
EXPOSURE_MAX = 2.0  # `systemd-analyze security` of the node units (nixpkgs' CUDA services: 1.5)


@pytest.fixture(scope="module")
def app():
    box = Container()
    try:
        box.start()
        yield install(box)
    finally:
        box.stop()


def usec() -> int:
    """The container's realtime clock, in µs (it is the host's clock)."""
    return time.time_ns() // 1000


def first(lines: list[tuple[float, str]], text: str) -> float | None:
    return next((t for t, line in lines if text in line), None)


def test_installed_units_and_drop_ins_verify(app: Appliance):
    units = [f"/etc/systemd/system/{u}" for u in (*UNITS, "dspark-dashboard.service")]
    out = app.box.run("systemd-analyze", "verify", *units, timeout=60)
    assert out.returncode == 0 and not out.stderr.strip(), out.stderr
    cat = app.box.systemctl("cat", "dspark-head.service", check=True).stdout
    assert f"Environment=DSPARK_NODE={HEAD_NAME}" in cat
    assert "After=dspark-worker.service" in cat  # the both-roles drop-in


def test_start_head_pulls_in_the_worker_ready_target_and_waits_for_it(app: Appliance):
    r = app.box.systemctl("start", "dspark-head", timeout=START_S)
    assert r.returncode == 0, r.stderr + app.diagnose()
    props = {u: app.box.show(u, "ActiveState", "ActiveEnterTimestampMonotonic", "ExecMainStartTimestampMonotonic")
             for u in UNITS}
    assert all(p["ActiveState"] == "active" for p in props.values()), props
    # Ordered: worker ready (READY=1 in the rendezvous) -> wait-worker -> target -> head started.
    worker_ready = int(props["dspark-worker.service"]["ActiveEnterTimestampMonotonic"])
    target = int(props["dspark-worker-ready.target"]["ActiveEnterTimestampMonotonic"])
    head_started = int(props["dspark-head.service"]["ExecMainStartTimestampMonotonic"])
    assert worker_ready <= target <= head_started
    # `systemctl start` returned only once the head was READY: it serves now.
    status, detail = app.complete()
    assert status == 200, detail
    app.wait_serving(60)  # the worker follows its head into serving


def test_the_units_run_as_shipped_as_the_unprivileged_dspark_user(app: Appliance):
    # No test drop-in relaxes the units: what runs is what ships.
    for unit in ("dspark-head.service", "dspark-worker.service", "dspark-wait-worker.service"):
        p = app.box.show(unit, "User", "ProtectSystem", "ProtectHome", "NoNewPrivileges", "DropInPaths")
        assert p["User"] == "dspark" and p["ProtectSystem"] == "strict" and p["NoNewPrivileges"] == "yes", p
        assert p["ProtectHome"] == "read-only", p
        assert "test-user" not in p["DropInPaths"], p
    for node in (HEAD_NAME, WORKER_NAME):
        unit = "dspark-head.service" if node == HEAD_NAME else "dspark-worker.service"
        pids = {"supervisor": app.box.show(unit, "MainPID")["MainPID"], "vLLM": str(app.state(node)["vllm_pid"])}
        for what, pid in pids.items():
            user = app.box.run("ps", "-o", "user=", "-p", pid, timeout=30).stdout.strip()
            assert user == "dspark", (node, what, pid, user)


def test_the_node_units_are_hardened_and_the_pair_serves_under_them(app: Appliance):
    """`systemd-analyze security` of the container's systemd, on the units as
    loaded (drop-ins included), rates each node unit at most EXPOSURE_MAX (3.5 before); the
    sandbox is in force on the running supervisors, and the pair serves under it."""
    for unit in ("dspark-head.service", "dspark-worker.service"):
        out = app.box.run("systemd-analyze", "security", "--no-pager", unit, timeout=120)
        level = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out.stdout)
        assert level is not None, out.stdout[-2000:] + out.stderr
        print(f"{unit}: exposure {level.group(1)}")
        assert float(level.group(1)) <= EXPOSURE_MAX, out.stdout
        pid = app.box.show(unit, "MainPID")["MainPID"]

        def proc(name: str) -> str:
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


def test_worker_vllm_killed_is_detected_and_the_pair_recovers_worker_first(app: Appliance):
    app.wait_serving(60)
    restarts = {u: app.main_pid_restarts(u) for u in ("dspark-head.service", "dspark-worker.service")}
    since = usec()
    detected = app.kill_vllm_until_the_head_leaves(WORKER_NAME)
    assert detected is not None and detected < DETECT_S, "head still serving 60 s after the kill"
    back = app.wait_serving(START_S)
    for unit, n in restarts.items():
        assert app.main_pid_restarts(unit) > n, unit
    worker_ready = first(app.box.journal("dspark-worker.service", since), "ready (in the rendezvous)")
    head_vllm = first(app.box.journal("dspark-head.service", since), "starting vLLM")
    assert worker_ready is not None and head_vllm is not None and worker_ready < head_vllm
    print(f"worker kill: detected after {detected:.1f} s, serving again {back + detected:.0f} s after the kill")


def test_hung_head_is_restarted_by_the_watchdog(app: Appliance):
    app.wait_serving(60)
    restarts = app.main_pid_restarts("dspark-head.service")
    pid = app.state(HEAD_NAME)["vllm_pid"]
    since = usec()
    app.kill("STOP", pid, group=True)  # all of the head's vLLM processes hang
    deadline = time.monotonic() + 90
    journal: list[tuple[float, str]] = []
    while time.monotonic() < deadline:
        journal = app.box.journal("dspark-head.service", since)
        if first(journal, "Watchdog timeout"):
            break
        time.sleep(1)
    assert first(journal, "Watchdog timeout"), "\n".join(line for _, line in journal[-30:])
    app.wait_serving(START_S)
    journal = app.box.journal("dspark-head.service", since)
    assert first(journal, "Failed with result 'watchdog'")
    assert app.main_pid_restarts("dspark-head.service") > restarts
    # The stopped processes are gone with the old incarnation.
    assert app.box.run("kill", "-0", str(pid), timeout=10).returncode != 0
    # Second failure in a row without a stable spell in between: the restart backs off and says so.
    assert first(journal, "backoff: 2 failed runs in a row"), "\n".join(line for _, line in journal[-40:])


def test_wedged_worker_is_a_stall_and_the_pair_recovers_worker_first(app: Appliance):
    """The worker's vLLM stopped (SIGSTOP) while requests run: /health and /metrics still
    answer, nothing advances; the head calls it a stall within stall_s and both restart."""
    app.wait_serving(START_S)
    stall_s, interval = app.cluster.supervisor.stall_s, app.cluster.supervisor.liveness_interval_s
    restarts = {u: app.main_pid_restarts(u) for u in ("dspark-head.service", "dspark-worker.service")}
    stop = threading.Event()
    threads = [threading.Thread(target=_load, args=(app.api_url, stop), daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(3)
        pid = app.state(WORKER_NAME)["vllm_pid"]
        since = usec()
        t0 = time.monotonic()
        app.kill("STOP", pid, group=True)
        detected = None
        while time.monotonic() - t0 < stall_s + 60:
            s = app.state(HEAD_NAME, timeout=1.0)
            if s is None or s["state"] != "serving":
                detected = time.monotonic() - t0
                break
            time.sleep(0.2)
    finally:
        stop.set()
    assert detected is not None and detected <= stall_s + interval + 5, detected
    back = app.wait_serving(START_S)
    head_journal = app.box.journal("dspark-head.service", since)
    assert first(head_journal, "engine stalled"), "\n".join(line for _, line in head_journal[-30:])
    for unit, n in restarts.items():
        assert app.main_pid_restarts(unit) > n, unit
    worker_ready = first(app.box.journal("dspark-worker.service", since), "ready (in the rendezvous)")
    head_vllm = first(head_journal, "starting vLLM")
    assert worker_ready is not None and head_vllm is not None and worker_ready < head_vllm
    print(f"worker wedge: detected after {detected:.1f} s (stall_s {stall_s:g}), "
          f"serving again {back + detected:.0f} s after the SIGSTOP")


def test_journalctl_picks_out_by_priority_what_went_wrong(app: Appliance):
    """dspark's lines reach the journal with their level (dspark.log's `<N>` prefix, which journald
    reads and strips): after the faults above, `journalctl -p warning` shows the head's failures
    (the killed worker, the stall) and none of its state changes or vLLM's own output; `-p notice` adds the state
    changes; a line vLLM writes is info. Read in the container, from the units' own journal."""
    def lines(*args: str) -> list[str]:
        r = app.box.run("journalctl", "--no-pager", "-o", "cat", "-u", "dspark-head.service", *args, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout.splitlines()

    warnings = lines("-p", "warning")
    assert any(x.startswith("dspark[") and ": failed: " in x for x in warnings), warnings[-30:]
    assert not any("starting vLLM" in x or "serving: API on" in x for x in warnings), warnings[-30:]
    notices = lines("-p", "notice")
    assert any("serving: API on" in x for x in notices) and not any("starting vLLM" in x for x in notices)
    records = [json.loads(x) for x in lines("-o", "json") if x.startswith("{")]
    messages = [(r.get("MESSAGE"), r.get("PRIORITY")) for r in records if isinstance(r.get("MESSAGE"), str)]
    assert not any(m.startswith(("<3>", "<4>", "<5>", "<6>")) for m, _ in messages)  # read and stripped
    assert {p for m, p in messages if m.startswith("dspark[") and ": failed: " in m} == {"3"}
    assert {p for m, p in messages if m.startswith("dspark[") and ": starting vLLM" in m} == {"6"}


def _load(api_url: str, stop: threading.Event) -> None:
    """Long completions back to back until `stop` (bounded by it and by each request's timeout)."""
    body = json.dumps({"model": SERVED_NAME, "prompt": [1, 2, 3, 4], "max_tokens": 2000,
                       "ignore_eos": True}).encode()
    for _ in range(100):
        if stop.is_set():
            return
        req = urllib.request.Request(api_url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                r.read()
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)


def test_head_started_alone_waits_for_the_worker_ready_target(app: Appliance):
    """The cross-host shape: no direct ordering, only the target reached by `wait-worker`."""
    box = app.box
    box.systemctl("stop", "dspark-head", "dspark-worker", timeout=200, check=True)
    # (The worker may have left first, as "pair broken: local-head is stopping": result failed.)
    box.systemctl("reset-failed", timeout=30)
    # Only the ordering goes; the shared /tmp stays (one host: vLLM's IPC sockets live there).
    box.path("/etc/systemd/system/dspark-wait-worker.service.d/60-dspark-local-pair.conf").unlink()
    head_dropin = box.path("/etc/systemd/system/dspark-head.service.d/60-dspark-local-pair.conf")
    head_dropin.write_text("\n".join(line for line in head_dropin.read_text().splitlines()
                                     if not line.startswith(("Wants=", "After="))) + "\n")
    box.systemctl("daemon-reload", check=True)
    box.systemctl("start", "--no-block", "dspark-head", check=True)
    deadline = time.monotonic() + 60
    status = ""
    while time.monotonic() < deadline:
        status = box.status("dspark-wait-worker")
        if f"waiting for {WORKER_NAME} to enter the rendezvous" in status:
            break
        time.sleep(0.5)
    assert f"waiting for {WORKER_NAME} to enter the rendezvous" in status, status
    assert box.show("dspark-head.service", "ActiveState")["ActiveState"] == "inactive"  # its start job waits
    assert box.show("dspark-worker.service", "ActiveState")["ActiveState"] == "inactive"  # not pulled in
    box.systemctl("start", "--no-block", "dspark-worker", check=True)
    app.wait_serving(START_S)
    assert box.show("dspark-worker-ready.target", "ActiveState")["ActiveState"] == "active"


def test_systemctl_stop_leaves_no_process(app: Appliance):
    r = app.box.systemctl("stop", "dspark-head", "dspark-worker", timeout=200)
    assert r.returncode == 0, r.stderr
    for unit in ("dspark-head.service", "dspark-worker.service"):
        p = app.box.show(unit, "ActiveState", "MainPID")
        # The head stops first; the worker may leave on its own a moment before its SIGTERM
        # ("pair broken: local-head is stopping", exit 4 while a stop job runs: failed).
        assert p["MainPID"] == "0" and p["ActiveState"] in ("inactive", "failed"), (unit, p)
    assert app.box.show("dspark-head.service", "ActiveState")["ActiveState"] == "inactive"
    left = app.box.run("pgrep", "-af", CLUSTER_DIR, timeout=10).stdout.strip()
    assert left == "", left
    assert app.state(HEAD_NAME, timeout=1) is None and app.state(WORKER_NAME, timeout=1) is None
