"""The head's API key under a real systemd, with the credential lines the NixOS module writes
(modules/dspark.nix; tests/nix/test_module.py checks the module writes exactly these): where the
key file is missing, the head's start ends with dspark's own refusal naming the file (exit 2,
not restarted), not systemd's bare 243/CREDENTIALS, which the same lines without the
SetCredential= fallback give. No vLLM is started: serve refuses before it."""

from __future__ import annotations

import time

import pytest

from dspark.config import credentials
from dspark.local.cluster import HEAD_NAME
from tests.harness.appliance import bind_checkout, runtime
from tests.harness.nspawn_container import Container, missing_requirements

pytestmark = [pytest.mark.systemd,
              pytest.mark.skipif(missing_requirements() is not None, reason=f"systemd tests: {missing_requirements()}")]

CLUSTER_DIR = "/srv/dspark-key"  # inside the container, outside /tmp (PrivateTmp hides that)
KEY_FILE = "/srv/secrets/dspark-api-key"  # never created: the missing key file
HEAD = "dspark-head.service"
WAIT = "dspark-wait-worker.service"


def settle(box: Container, unit: str) -> dict[str, str]:
    """The unit's state once its start has ended (bounded: 60 s)."""
    for _ in range(60):
        state = box.show(unit, "ActiveState", "SubState")
        if state["ActiveState"] != "activating":
            break
        time.sleep(1)
    return box.show(unit, "ActiveState", "Result", "ExecMainStatus", "NRestarts")


def test_a_missing_key_file_is_a_refusal_by_name_not_243():
    with Container(name="dspark-key") as box:
        python, dspark, _ = runtime(box)
        box.run(python, "-c", "from pathlib import Path; from dspark.local.cluster import prepare, LocalPorts; "
                f"prepare(Path({CLUSTER_DIR!r}), LocalPorts(api=28121, master=28122, agent=28123))",
                timeout=60, check=True)
        box.run(dspark, "systemd", "install", "--node", HEAD_NAME, "--config", f"{CLUSTER_DIR}/cluster.toml",
                "--dspark-bin", dspark, timeout=60, check=True)
        # No worker in this test: the oneshot the head requires passes at once.
        wait = box.path(f"/etc/systemd/system/{WAIT}.d")
        wait.mkdir(parents=True, exist_ok=True)
        (wait / "90-test-no-worker.conf").write_text("[Service]\nExecStart=\nExecStart=/bin/true\n")
        dropin = box.path(f"/etc/systemd/system/{HEAD}.d")
        dropin.mkdir(parents=True, exist_ok=True)
        module_lines = [f'Environment="DSPARK_API_KEY_FILE={KEY_FILE}"', f"LoadCredential=api-key:{KEY_FILE}"]
        fallback = f"SetCredential=api-key:{credentials.NO_KEY_FILE}"
        (dropin / "80-module-key.conf").write_text("[Service]\n" + "\n".join(module_lines + [fallback]) + "\n")
        bind_checkout(box, [HEAD, WAIT])
        box.systemctl("daemon-reload", check=True)

        started = box.systemctl("start", HEAD, timeout=120)
        assert started.returncode != 0
        time.sleep(6)  # three times RestartSec=: a restart would have happened by now
        props = settle(box, HEAD)
        assert props == {"ActiveState": "failed", "Result": "exit-code", "ExecMainStatus": "2", "NRestarts": "0"}
        status = box.systemctl("status", "--no-pager", "--full", "--lines=5", HEAD, timeout=20).stdout
        assert f"refusing to start: the API key file {KEY_FILE} " in status and "does not exist" in status, status
        assert not any("starting vLLM" in m for _, m in box.journal(HEAD))

        # The same lines without the fallback (the module before): systemd fails the start itself.
        (dropin / "80-module-key.conf").write_text("[Service]\n" + "\n".join(module_lines) + "\n")
        box.systemctl("daemon-reload", check=True)
        box.systemctl("reset-failed", HEAD)
        box.systemctl("start", HEAD, timeout=120)
        status = box.show(HEAD, "ExecMainStatus")["ExecMainStatus"]
        box.systemctl("stop", HEAD, timeout=120)  # Restart=on-failure would try again
        assert status == "243", status
