"""dspark check under a real systemd: the worker unit runs `dspark serve --check`; a failing
check ends the start with exit 2, systemd does not restart it (RestartPreventExitStatus=2),
and `systemctl status` shows why. No vLLM is started: the check refuses before it. And
`dspark systemd install` says when the units' user cannot execute what the units start."""

from __future__ import annotations

import time

import pytest

from dspark.local.cluster import WORKER_NAME
from tests.harness.appliance import DSPARK, PYTHON, _dspark_can_execute, bind_checkout, runtime
from tests.harness.nspawn_container import Container, missing_requirements

pytestmark = [pytest.mark.systemd,
              pytest.mark.skipif(missing_requirements() is not None, reason=f"systemd tests: {missing_requirements()}")]

CLUSTER_DIR = "/srv/dspark-check"  # inside the container, outside /tmp (PrivateTmp hides that)
UNIT = "dspark-worker.service"


def test_failed_check_refuses_the_start_without_restarts():
    with Container(name="dspark-check") as box:
        # The unit runs as shipped: as the dspark user, from an interpreter that user can execute.
        python, dspark, _ = runtime(box)
        box.run(python, "-c", "from pathlib import Path; from dspark.local.cluster import prepare, LocalPorts; "
                f"prepare(Path({CLUSTER_DIR!r}), LocalPorts(api=28101, master=28102, agent=28103))",
                timeout=60, check=True)
        box.run("rm", f"{CLUSTER_DIR}/model/config.json", check=True)  # the model directory is broken
        box.run(dspark, "systemd", "install", "--node", WORKER_NAME, "--config", f"{CLUSTER_DIR}/cluster.toml",
                "--dspark-bin", dspark, timeout=60, check=True)
        bind_checkout(box, [UNIT])
        assert box.show(UNIT, "User")["User"] == "dspark"
        started = box.systemctl("start", UNIT, timeout=120)
        assert started.returncode != 0
        time.sleep(6)  # three times RestartSec=: a restart would have happened by now
        # On a loaded host the start itself may still run (the check is slow to start): wait
        # for it to end, but not through a restart (SubState auto-restart), which must fail.
        for _ in range(60):
            state = box.show(UNIT, "ActiveState", "SubState")
            if state["ActiveState"] != "activating" or state["SubState"] == "auto-restart":
                break
            time.sleep(1)
        props = box.show(UNIT, "ActiveState", "Result", "ExecMainStatus", "NRestarts")
        assert props == {"ActiveState": "failed", "Result": "exit-code", "ExecMainStatus": "2", "NRestarts": "0"}
        status = box.systemctl("status", "--no-pager", "--full", "--lines=5", UNIT, timeout=20).stdout
        assert "refusing to start: dspark check failed: model.dir" in status, status
        lines = [m for _, m in box.journal(UNIT)]
        assert any("check warn  gpu" in m for m in lines)  # warnings are logged too
        # Under the hardened unit: the nvidia_uvm check runs (no driver here),
        # and the OOM-killer check says that ProtectProc=invisible hides root's processes.
        assert any("gpu.uvm" in m and "no NVIDIA driver" in m for m in lines), lines
        assert any("memory.oom-killers" in m and "not seen" in m for m in lines), lines
        assert not any("starting vLLM" in m for m in lines)


def test_install_says_when_the_service_user_cannot_execute_what_the_units_start():
    with Container(name="dspark-install") as box:
        python, dspark, _ = runtime(box)  # the dspark user exists from here on
        box.run(python, "-c", "from pathlib import Path; from dspark.local.cluster import prepare, LocalPorts; "
                f"prepare(Path({CLUSTER_DIR!r}), LocalPorts(api=28111, master=28112, agent=28113))",
                timeout=60, check=True)
        install = ("systemd", "install", "--node", WORKER_NAME, "--config", f"{CLUSTER_DIR}/cluster.toml")
        # The checkout's own dspark (its #! names the checkout venv's Python): whether the dspark
        # user can run it is asked of the kernel by a real exec as that user, and the warning
        # from the mode bits must agree.
        reachable = _dspark_can_execute(box, PYTHON)
        r = box.run(DSPARK, *install, timeout=60)
        assert r.returncode == 0, r.stderr
        assert ("cannot execute" in r.stderr) == (not reachable), (reachable, r.stderr)
        if not reachable:
            assert "--dspark-bin" in r.stderr and "Traceback" not in r.stderr, r.stderr
        # What the units run as shipped (runtime() checked it with a real exec): no warning.
        r = box.run(dspark, *install, "--dspark-bin", dspark, timeout=60)
        assert r.returncode == 0 and "cannot execute" not in r.stderr, r.stderr
