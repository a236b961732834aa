"""A port another user holds, under a real systemd (issue 33, item 4): the worker unit as shipped
(`dspark serve --check`, user dspark, the full sandbox; the stand-in vLLM), its agent port held by
a root process it cannot see. The start waits for the port (1, 2, 4 ... s, said in the journal
and in `systemctl status`), ends with exit 5, which systemd restarts (RestartPreventExitStatus=2
does not cover it), and the unit comes up once the port frees. Before, it ended with exit 2 and
stayed failed for good. A drop-in shortens the wait (--transient-wait) so the test takes
seconds."""

from __future__ import annotations

import socket
import time

import pytest

from dspark.local.cluster import WORKER_NAME
from tests.harness.appliance import install, use_standin
from tests.harness.nspawn_container import Container, missing_requirements

pytestmark = [pytest.mark.systemd,
              pytest.mark.skipif(missing_requirements() is not None, reason=f"systemd tests: {missing_requirements()}")]

UNIT = "dspark-worker.service"
WAIT_S = 4
START_S = 300  # generous for a loaded 2-core host


def wait_for(what: str, ok, timeout: float = START_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = ok()
        if got:
            return got
        time.sleep(1)
    raise AssertionError(f"{what}: not within {timeout} s")


def test_a_port_held_by_another_user_is_retried_and_the_unit_starts_once_it_frees():
    with Container(name="dspark-port") as box:
        app = install(box)
        use_standin(app)
        worker = app.cluster.node(WORKER_NAME)
        dropin = box.path(f"/etc/systemd/system/{UNIT}.d")
        dropin.mkdir(parents=True, exist_ok=True)
        (dropin / "92-test-transient-wait.conf").write_text(
            "# tests only: a shorter wait for a held port than the default 120 s\n[Service]\nExecStart=\n"
            f"ExecStart={app.dspark} serve --check --state-dir %S/dspark/worker --transient-wait {WAIT_S}\n")
        box.systemctl("daemon-reload", check=True)
        held = socket.socket()  # the container shares this host's network: a root process here holds it
        try:
            held.bind((worker.agent_bind, worker.agent_port))
            held.listen(1)
            box.systemctl("start", "--no-block", UNIT, check=True)
            wait_for("a restart after exit 5", lambda: int(box.show(UNIT, "NRestarts")["NRestarts"]) >= 1)
            props = box.show(UNIT, "ActiveState", "Result")
            assert props["ActiveState"] in ("activating", "deactivating"), props  # never failed for good
            lines = [m for _, m in box.journal(UNIT)]
            where = f"{worker.agent_bind}:{worker.agent_port}"
            assert any(f"port.agent: {where} is held by a process of user root that this user cannot see; "
                       "retrying in 1 s" in m for m in lines), lines[-20:]
            assert any("refusing to start for now" in m and "exit 5" in m for m in lines), lines[-20:]
            assert any("status=5/" in m for m in lines), lines[-20:]  # systemd's own line: the main process's exit
            assert not any("starting vLLM" in m for m in lines)
            status = wait_for("systemctl status saying the wait",
                              lambda: next((s for s in [box.status(UNIT)] if "retrying in" in s), None), timeout=60)
            assert where in status, status
        finally:
            held.close()
        wait_for("the unit active once the port is free",
                 lambda: box.show(UNIT, "ActiveState")["ActiveState"] == "active")
        lines = [m for _, m in box.journal(UNIT)]
        assert any("starting vLLM" in m for m in lines), lines[-20:]
        r = box.systemctl("stop", UNIT, timeout=120)
        assert r.returncode == 0, r.stderr
