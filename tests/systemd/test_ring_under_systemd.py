"""A ring of four nodes under a real systemd: the local 4-node appliance (head on 127.0.0.1,
workers on 127.0.0.2-4, TP=4) installed with the project's own units in one systemd-nspawn
container (made for this module and always removed), the three workers as instances of
dspark-worker@.service, with the stand-in vLLM (tests/harness/standin_vllm.py, appliance.use_standin) in
place of vLLM: the units' and the supervisors' ordering of a ring does not depend on what the
engine computes, so the ring starts in seconds. The real four-node ring (TP=4) is
tests/local/test_local_ring.py's; real vLLM under these units, test_switch_under_systemd.py's.

The tests run in file order against one container: the units as installed, the start (every
worker in the rendezvous before the head's vLLM starts), one worker's vLLM killed (the head
leaves serving and the ring comes back, workers first), the same in the cross-host shape (no
ordering between the units: the head's supervisor alone waits for every worker, one of them late
into the rendezvous), and a stop that leaves nothing behind.
"""

from __future__ import annotations

import time

import pytest

from dspark.local.cluster import HEAD_NAME, node_name
from tests.harness.appliance import CLUSTER_DIR, STANDIN, Appliance, install, use_standin
from tests.harness.nspawn_container import Container, missing_requirements

pytestmark = [pytest.mark.systemd,
              pytest.mark.skipif(missing_requirements() is not None, reason=f"systemd tests: {missing_requirements()}")]

NODES = 4
START_S = 300      # a stand-in ring's start (seconds when idle; generous for a loaded 2-core host)
DETECT_S = 15      # the bound for detecting a worker death (as for the pair)
KILLED = node_name(2)  # the worker whose vLLM is killed: neither the head nor the pair's one worker
# In the cross-host test the last worker's (stand-in) vLLM takes this long to enter the
# rendezvous, as a slow import of vLLM would: a head that started on fewer than every worker
# would start its vLLM before it.
LATE = node_name(3)
LATE_S = 20.0  # longer than the head takes to come back after the kill (about 9 s in a run here)

WORKER_READY = "ready (in the rendezvous)"  # a worker's supervisor, once its vLLM waits in the rendezvous
HEAD_STARTS_VLLM = "starting vLLM: "        # the head's supervisor, once every worker is in it


@pytest.fixture(scope="module")
def ring():
    box = Container(name="dspark-ring")
    try:
        box.start()
        r = install(box, nodes=NODES)
        use_standin(r)
        yield r
    finally:
        box.stop()


def usec() -> int:
    """The container's realtime clock, in µs (it is the host's clock)."""
    return time.time_ns() // 1000


def lines_with(ring: Appliance, node: str, text: str, since: int) -> list[float]:
    return [t for t, line in ring.box.journal(ring.unit(node), since) if text in line]


def assert_workers_first(ring: Appliance, since: int) -> dict[str, float]:
    """Every worker entered the rendezvous (after `since`) before the head started the vLLM it
    serves with now (its last start). Returns each worker's lead over that start, in seconds."""
    head_starts = lines_with(ring, HEAD_NAME, HEAD_STARTS_VLLM, since)
    assert head_starts, f"the head's journal has no {HEAD_STARTS_VLLM!r} since the start"
    head_vllm = head_starts[-1]
    lead = {}
    for w in ring.workers:
        ready = [t for t in lines_with(ring, w, WORKER_READY, since) if t < head_vllm]
        assert ready, (f"{w} ({ring.unit(w)}) did not report {WORKER_READY!r} before the head's vLLM started; "
                       f"its lines: {lines_with(ring, w, WORKER_READY, since)}, the head's start {head_vllm}")
        lead[w] = head_vllm - ready[-1]
    return lead


def test_each_worker_runs_as_an_instance_of_the_template(ring: Appliance):
    assert ring.workers == ["local-worker", "local-worker-2", "local-worker-3"]
    instances = [ring.unit(w) for w in ring.workers]
    assert instances == [f"dspark-worker@{w}.service" for w in ring.workers]
    out = ring.box.run("systemd-analyze", "verify", *instances, "dspark-head.service", "dspark-wait-worker.service",
                       "dspark-worker-ready.target", timeout=120)
    assert out.returncode == 0 and not out.stderr.strip(), out.stderr
    for w in ring.workers:
        p = ring.box.show(ring.unit(w), "Environment", "User", "ProtectSystem", "PrivateTmp", "StateDirectory")
        assert f"DSPARK_NODE={w}" in p["Environment"].split() and p["User"] == "dspark", p
        assert p["ProtectSystem"] == "strict" and p["PrivateTmp"] == "no", p  # one /tmp for one host's vLLMs
        assert p["StateDirectory"].split() == ["dspark", f"dspark/worker-{w}"], p
    head = ring.box.show("dspark-head.service", "Wants", "After")
    for unit in instances:
        assert unit in head["Wants"].split() and unit in head["After"].split(), (unit, head)


def test_start_brings_every_worker_into_the_rendezvous_before_the_head(ring: Appliance):
    since = usec()
    t0 = time.monotonic()
    r = ring.box.systemctl("start", "dspark-head", timeout=START_S)  # pulls in this host's workers
    assert r.returncode == 0, r.stderr + ring.diagnose()
    started = time.monotonic() - t0
    props = {u: ring.box.show(u, "ActiveState", "ActiveEnterTimestampMonotonic", "ExecMainStartTimestampMonotonic")
             for u in ring.units}
    assert all(p["ActiveState"] == "active" for p in props.values()), props
    # systemd's order: each worker ready (READY=1: in the rendezvous) -> target -> head started.
    target = int(props["dspark-worker-ready.target"]["ActiveEnterTimestampMonotonic"])
    head_started = int(props["dspark-head.service"]["ExecMainStartTimestampMonotonic"])
    for w in ring.workers:
        assert int(props[ring.unit(w)]["ActiveEnterTimestampMonotonic"]) <= target <= head_started, (w, props)
    # The supervisors' own record: the head's vLLM started after every worker's was in the rendezvous.
    assert_workers_first(ring, since)
    status, detail = ring.complete()  # `systemctl start` returned once the head was READY: it serves
    assert status == 200, detail
    ring.wait_serving(120)  # the workers follow their head into serving
    for node in ring.names:  # what each unit runs is the stand-in (use_standin), as user dspark
        ps = ring.box.run("ps", "-o", "user=,args=", "-p", str(ring.state(node)["vllm_pid"]), timeout=30).stdout
        assert ps.split()[0] == "dspark" and STANDIN in ps, (node, ps)
    print(f"ring of {NODES}: serving {started:.0f} s after systemctl start")


def test_one_worker_vllm_killed_the_head_leaves_and_the_ring_comes_back_workers_first(ring: Appliance):
    ring.wait_serving(120)
    node_units = [ring.unit(n) for n in ring.names]
    restarts = {u: ring.main_pid_restarts(u) for u in node_units}
    since = usec()
    detected = ring.kill_vllm_until_the_head_leaves(KILLED)
    assert detected is not None and detected < DETECT_S, "head still serving 60 s after the kill"
    back = ring.wait_serving(START_S)
    # Every node went through a restart: the killed worker, the head that saw it, and the
    # workers that saw their head leave; each left with exit 4 (died or lost its pair), or,
    # on a host loaded enough to delay a supervisor's loop, through its watchdog (a restart all
    # the same: what matters is that no node stays up in a broken ring).
    for unit, n in restarts.items():
        assert ring.main_pid_restarts(unit) > n, (unit, ring.box.status(unit))
    for node in ring.names:
        exits = (lines_with(ring, node, "Main process exited, code=exited, status=4", since)
                 + lines_with(ring, node, "Watchdog timeout", since))
        assert exits, f"{node}: neither an exit 4 nor a watchdog restart in its journal since the kill"
    assert lines_with(ring, KILLED, "vLLM exited with code", since)
    # In order: every worker back in the rendezvous before the head's new vLLM.
    lead = assert_workers_first(ring, since)
    status, detail = ring.complete(max_tokens=4)
    assert status == 200, detail
    print(f"{KILLED} killed: head left serving after {detected:.1f} s, ring serving again "
          f"{back + detected:.0f} s after the kill; workers ready ahead of the head's vLLM by "
          + ", ".join(f"{w} {s:.1f} s" for w, s in lead.items()))


def test_without_systemds_order_the_heads_supervisor_waits_for_every_worker_after_a_kill(ring: Appliance):
    """The cross-host shape (no Wants=/After= between the head and the workers: they would run on
    other hosts): after a worker's vLLM is killed, the head's unit restarts on its own, and only
    its supervisor keeps its vLLM until every worker is in the rendezvous again (here LATE
    enters LATE_S after its start). On one host the drop-in's After= orders the same restart."""
    box = ring.box
    box.systemctl("stop", "dspark-head.service", "dspark-worker@*.service", timeout=300, check=True)
    box.systemctl("reset-failed", timeout=30)
    ring.drop_local_ordering()
    use_standin(ring, node_env={LATE: {"STANDIN_LAUNCH_DELAY": str(LATE_S)}})  # read at each start
    head = box.show("dspark-head.service", "Wants", "After")
    assert not any(ring.unit(w) in (head["Wants"] + " " + head["After"]).split() for w in ring.workers), head
    box.systemctl("start", "--no-block", *(ring.unit(w) for w in ring.workers), "dspark-head.service", check=True)
    ring.wait_serving(START_S)
    since = usec()
    detected = ring.kill_vllm_until_the_head_leaves(KILLED)
    assert detected is not None and detected < DETECT_S, "head still serving 60 s after the kill"
    ring.wait_serving(START_S)
    # The head's new run waited in the rendezvous while LATE was not in it yet...
    head_waits = [t for t, line in ring.box.journal(ring.unit(HEAD_NAME), since)
                  if "waiting for" in line and LATE in line]
    late_ready = lines_with(ring, LATE, WORKER_READY, since)
    assert head_waits and late_ready and head_waits[0] < late_ready[-1], (head_waits, late_ready)
    # ...and started its vLLM only once every worker was in.
    assert_workers_first(ring, since)


def test_systemctl_stop_of_every_node_leaves_no_process(ring: Appliance):
    node_units = [ring.unit(n) for n in ring.names]
    r = ring.box.systemctl("stop", "dspark-head.service", "dspark-worker@*.service", timeout=300)
    assert r.returncode == 0, r.stderr
    for unit in node_units:
        p = ring.box.show(unit, "ActiveState", "MainPID")
        # A worker may leave on its own a moment before its SIGTERM ("pair broken: local-head
        # is stopping", exit 4 while a stop job runs: failed).
        assert p["MainPID"] == "0" and p["ActiveState"] in ("inactive", "failed"), (unit, p)
    assert ring.box.show("dspark-head.service", "ActiveState")["ActiveState"] == "inactive"
    left = ring.box.run("pgrep", "-af", CLUSTER_DIR, timeout=10).stdout.strip()
    assert left == "", left
    left = ring.box.run("pgrep", "-af", STANDIN, timeout=10).stdout.strip()
    assert left == "", left
    assert all(ring.state(n, timeout=1) is None for n in ring.names)
