"""The project's own units under a real systemd (in a systemd-nspawn container made for this
module and always removed), running the local pair with the stand-in vLLM (tests/harness/standin_vllm.py,
appliance.use_standin) in place of vLLM: what is proven here is systemd's and the supervisors'
part (ordering, readiness, the watchdog, restarts, the journal), which does not depend on what
the engine computes, so the pair starts in seconds instead of minutes. The units are installed
as shipped (user dspark, the full sandbox); the real vLLM pair under the same units is
test_switch_under_systemd.py.

The tests run in file order against one container and one installed appliance: start (the head
pulls in the worker-ready target and waits for it), a worker's vLLM killed, a hung head, a wedged
worker (the stand-in's collective: the head's engine stalls while a rank is silent), a runtime
line that cannot start rolled back inside the units, the journal's priorities, the head started
alone (cross-host ordering), stop.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from dspark.local.cluster import HEAD_NAME, SERVED_NAME, WORKER_NAME
from tests.harness.appliance import CLUSTER_DIR, STANDIN, UNITS, Appliance, install, use_standin
from tests.harness.nspawn_container import Container, missing_requirements

pytestmark = [pytest.mark.systemd,
              pytest.mark.skipif(missing_requirements() is not None, reason=f"systemd tests: {missing_requirements()}")]

START_S = 300      # a stand-in pair's start (seconds when idle; generous for a loaded 2-core host)
DETECT_S = 15      # the bound for detecting a worker death
COLLECTIVE_S = 5.0  # the stand-in head's engine stalls once a worker's vLLM is silent this long (beats every 0.1 s:
                   # a loaded host's scheduling gaps stay far below it)
STALL_S = 10.0     # the cluster file's supervisor.stall_s here (the local appliance's is 30 s)
TOKEN_S = 0.02     # the stand-in's seconds per token: a 2000-token request runs 40 s
A, B = "v0.28.0", "v0.32.0"  # the default line (the stand-in) and a line whose install is broken
STATE_DIR = "/var/lib/dspark/head"  # the head unit's StateDirectory: dspark switch's default
SWITCH_WAIT_S = 120  # dspark switch --timeout: each wait for the pair to serve (the new line, the way back);
                     # a stand-in pair serves again within seconds (4 s in a run here)
BROKEN = "/opt/dspark/standin/broken-vllm"
BROKEN_SCRIPT = """#!/bin/sh
# Runtime line v0.32.0 as the rollback test sees it: an install whose vLLM cannot even import.
echo "ImportError: vllm is broken in this install (a test of dspark switch)" >&2
exit 1
"""


@pytest.fixture(scope="module")
def app():
    box = Container()
    try:
        box.start()
        a = install(box)
        broken = box.path(BROKEN)
        broken.parent.mkdir(parents=True, exist_ok=True)
        broken.write_text(BROKEN_SCRIPT)
        broken.chmod(0o755)
        command = use_standin(a, env={"STANDIN_COLLECTIVE_S": str(COLLECTIVE_S), "STANDIN_TOKEN_S": str(TOKEN_S)},
                              supervisor={"stall_s": STALL_S}, line_commands={B: [BROKEN]})
        a.command = command
        yield a
    finally:
        box.stop()


def usec() -> int:
    """The container's realtime clock, in µs (it is the host's clock)."""
    return time.time_ns() // 1000


def first(lines: list[tuple[float, str]], text: str) -> float | None:
    return next((t for t, line in lines if text in line), None)


def assert_worker_first(app: Appliance, since: int) -> None:
    """The worker entered the rendezvous (after `since`) before the head started its vLLM."""
    worker_ready = first(app.box.journal("dspark-worker.service", since), "ready (in the rendezvous)")
    head_vllm = first(app.box.journal("dspark-head.service", since), "starting vLLM")
    assert worker_ready is not None and head_vllm is not None and worker_ready < head_vllm, (worker_ready, head_vllm)


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
    # What serves is the stand-in, run by the units' user under the units as shipped.
    for node in (HEAD_NAME, WORKER_NAME):
        pid = str(app.state(node)["vllm_pid"])
        ps = app.box.run("ps", "-o", "user=,args=", "-p", pid, timeout=30).stdout.split()
        assert ps[:3] == ["dspark", *app.command], (node, ps)
        assert STANDIN in ps, ps


def test_worker_vllm_killed_is_detected_and_the_pair_recovers_worker_first(app: Appliance):
    app.wait_serving(60)
    restarts = {u: app.main_pid_restarts(u) for u in ("dspark-head.service", "dspark-worker.service")}
    since = usec()
    detected = app.kill_vllm_until_the_head_leaves(WORKER_NAME)
    assert detected is not None and detected < DETECT_S, "head still serving 60 s after the kill"
    back = app.wait_serving(START_S)
    for unit, n in restarts.items():
        assert app.main_pid_restarts(unit) > n, unit
    assert_worker_first(app, since)
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
    assert_worker_first(app, since)


def test_wedged_worker_is_a_stall_and_the_pair_recovers_worker_first(app: Appliance):
    """The worker's vLLM stopped (SIGSTOP) while requests run: the head's /health and /metrics
    still answer, nothing advances (the stand-in's collective waits on the silent rank); the head
    calls it a stall within stall_s and both restart."""
    app.wait_serving(START_S)
    stall_s, interval = app.cluster.supervisor.stall_s, app.cluster.supervisor.liveness_interval_s
    assert stall_s == STALL_S
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
        while time.monotonic() - t0 < COLLECTIVE_S + stall_s + 60:
            s = app.state(HEAD_NAME, timeout=1.0)
            if s is None or s["state"] != "serving":
                detected = time.monotonic() - t0
                break
            time.sleep(0.2)
    finally:
        stop.set()
    assert detected is not None and detected <= COLLECTIVE_S + stall_s + interval + 5, detected
    back = app.wait_serving(START_S)
    head_journal = app.box.journal("dspark-head.service", since)
    assert first(head_journal, "engine stalled"), "\n".join(line for _, line in head_journal[-30:])
    for unit, n in restarts.items():
        assert app.main_pid_restarts(unit) > n, unit
    assert_worker_first(app, since)
    print(f"worker wedge: detected after {detected:.1f} s (stall_s {stall_s:g}), "
          f"serving again {back + detected:.0f} s after the SIGSTOP")


def test_a_line_that_cannot_start_is_rolled_back_inside_the_running_units(app: Appliance):
    """`dspark switch` to a line whose vLLM cannot start (--no-bench: the start alone decides):
    rolled back, the pair serving the old line again, in the supervisors the units started (the
    same MainPIDs, no restart, no watchdog kill through the drain, the failed start and the way
    back). The kept switch on real vLLM lines is test_switch_under_systemd.py's."""
    app.wait_serving(START_S)
    node_units = ("dspark-head.service", "dspark-worker.service")
    before = {u: app.box.show(u, "MainPID", "NRestarts") for u in node_units}
    since = usec()
    r = app.box.run(app.dspark, "switch", B, "--no-bench", "--timeout", str(SWITCH_WAIT_S), "--config",
                    f"{CLUSTER_DIR}/cluster.toml", "--state-dir", STATE_DIR, timeout=2 * SWITCH_WAIT_S + 120)
    out = r.stdout + r.stderr
    assert r.returncode == 1 and f"rolled back: serving on {A} again" in out, out + app.diagnose()
    rec = json.loads(app.box.path(f"{STATE_DIR}/switch-history.json").read_text())[-1]
    assert rec["verdict"] == "rolled back" and f"failed on {B}" in rec["reason"] and rec["serving_on"] == A, rec
    assert "broken in this install" in "\n".join(m for _, m in app.box.journal("dspark-worker.service", since))
    states = {n: app.state(n, timeout=10) or {} for n in app.names}
    assert {n: (s.get("state"), s.get("runtime_line")) for n, s in states.items()} == \
        {n: ("serving", A) for n in app.names}, states
    assert app.complete()[0] == 200
    assert {u: app.box.show(u, "MainPID", "NRestarts") for u in node_units} == before
    for unit in node_units:
        text = "\n".join(m for _, m in app.box.journal(unit, since))
        assert "Watchdog timeout" not in text and "Main process exited" not in text, text[-3000:]


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
    assert not any("starting vLLM" in x or "serving: API on" in x or "standin" in x for x in warnings), warnings[-30:]
    notices = lines("-p", "notice")
    assert any("serving: API on" in x for x in notices) and not any("starting vLLM" in x for x in notices)
    records = [json.loads(x) for x in lines("-o", "json") if x.startswith("{")]
    messages = [(r.get("MESSAGE"), r.get("PRIORITY")) for r in records if isinstance(r.get("MESSAGE"), str)]
    assert not any(m.startswith(("<3>", "<4>", "<5>", "<6>")) for m, _ in messages)  # read and stripped
    assert {p for m, p in messages if m.startswith("dspark[") and ": failed: " in m} == {"3"}
    assert {p for m, p in messages if m.startswith("dspark[") and ": starting vLLM" in m} == {"6"}
    assert {p for m, p in messages if m.startswith("INFO standin ")} == {"6"}  # the (stand-in) vLLM's own lines


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
    app.drop_local_ordering()
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
    left = app.box.run("pgrep", "-af", STANDIN, timeout=10).stdout.strip()
    assert left == "", left
    assert app.state(HEAD_NAME, timeout=1) is None and app.state(WORKER_NAME, timeout=1) is None
