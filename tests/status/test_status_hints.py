"""`dspark status` when nothing answers, and where it finds its cluster file (issue 34, item 4):
with no --config, no $DSPARK_CONFIG and no /etc/dspark/cluster.toml it reads the local
appliance's .dspark/local/cluster.toml (saying so); with none at all, one line saying how to
make either; and what to do when nothing answers, by the kind of cluster file: the local
appliance's command that starts it again (tests/local/test_local_dir_lock.py runs it), or the units.
Every cluster file here is on loopback, and nothing listens on its ports."""

from __future__ import annotations

import json
import time

import pytest

from dspark.config.schema import DEFAULT_CONFIG_PATH
from dspark.local import cluster as local
from tests.harness.dspark_cli import invoke_dspark
from tests.harness.pair import pick_ports
from tests.harness.standin import write_cluster

NO_ETC = pytest.mark.skipif(DEFAULT_CONFIG_PATH.exists(), reason=f"{DEFAULT_CONFIG_PATH} exists on this host")


@NO_ETC
def test_status_without_a_cluster_file_named_reads_the_local_appliances(tmp_path):
    ports = pick_ports()
    local.prepare(tmp_path / local.DEFAULT_DIR, ports)
    cluster = local.DEFAULT_DIR / "cluster.toml"  # as found: from the working directory
    r = invoke_dspark("status", env={"DSPARK_CONFIG": None}, cwd=tmp_path)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert f"reading the local appliance's {local.DEFAULT_DIR / 'cluster.toml'}" in r.stderr, r.stderr
    assert f"API http://127.0.0.1:{ports.api}" in r.stdout and "pair: NOT SERVING" in r.stdout, r.stdout
    hint = [line for line in r.stdout.splitlines() if line.startswith("what to do: ")]
    assert len(hint) == 1 and f"the local appliance of {cluster} is not running" in hint[0], r.stdout
    assert (f"local up --dir {cluster.parent} --api-port {ports.api} --agent-port {ports.agent} "
            f"--master-port {ports.master}") in hint[0], hint
    # --json: the same file, the hint in the snapshot, stdout JSON alone
    r = invoke_dspark("status", "--json", env={"DSPARK_CONFIG": None}, cwd=tmp_path)
    snap = json.loads(r.stdout)
    assert snap["hints"] and snap["hints"][0] in hint[0], snap


@NO_ETC
def test_status_with_no_cluster_file_anywhere_says_how_to_make_either(tmp_path):
    r = invoke_dspark("status", env={"DSPARK_CONFIG": None}, cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert str(DEFAULT_CONFIG_PATH) in r.stderr and "config init" in r.stderr and "local up" in r.stderr, r.stderr


def test_status_of_a_unit_cluster_with_nothing_running_says_to_start_the_units(tmp_path):
    cluster = write_cluster(tmp_path, nodes=2)  # a hand-written file (not local up's), on loopback
    r = invoke_dspark("status", "--config", str(cluster))
    assert r.returncode == 1
    rows = [line for line in r.stdout.splitlines() if line.startswith(("h ", "w "))]
    assert len(rows) == 2 and all("unreachable" in row and "Connection refused" in row for row in rows), r.stdout
    hint = [line for line in r.stdout.splitlines() if line.startswith("what to do: ")]
    assert len(hint) == 1, r.stdout
    assert "nothing answers" in hint[0] and "systemctl start dspark-worker.service" in hint[0], hint
    assert "systemctl start dspark-head.service" in hint[0] and "local up" not in hint[0], hint


def test_a_serving_answer_has_no_hint(tmp_path, serve):
    """Real supervisors (stand-in vLLM) serving: no hint; with the worker gone, the hint names it."""
    cluster = write_cluster(tmp_path, nodes=2)
    w = serve(cluster, "w")
    w.read(until="READY=1")
    h = serve(cluster, "h")
    h.read(until="READY=1")
    deadline = time.monotonic() + 60  # the worker follows its head into serving within a poll
    r = invoke_dspark("status", "--config", str(cluster))
    while r.returncode != 0 and time.monotonic() < deadline:
        assert "what to do" not in r.stdout, r.stdout  # every node answers: nothing to do
        time.sleep(0.5)
        r = invoke_dspark("status", "--config", str(cluster))
    assert r.returncode == 0 and "what to do" not in r.stdout, r.stdout
    w.proc.kill()
    w.proc.wait(timeout=30)
    r = invoke_dspark("status", "--config", str(cluster))
    hint = [line for line in r.stdout.splitlines() if line.startswith("what to do: ")]
    assert r.returncode == 1 and len(hint) == 1, r.stdout
    assert hint[0].startswith("what to do: w (127.0.0.2) does not answer") and "dspark-worker.service" in hint[0], hint
