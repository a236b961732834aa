"""The environment the supervisor gives vLLM: the rendered launch's, over the one the supervisor
was given; PYTHONPATH joins them (dspark's API guard first, then what the service or a test set:
the offline-pair test's audit hook reaches vLLM that way). Through `dspark serve` and the
stand-in vLLM, which writes the environment it got (STANDIN_ENV_FILE)."""

from __future__ import annotations

import json

from dspark.node.launch import API_GUARD_DIR
from tests.harness.standin import write_cluster


def test_vllm_gets_the_guard_first_then_the_inherited_path(tmp_path, serve):
    cluster = write_cluster(tmp_path)
    env_file = tmp_path / "vllm-env.json"
    s = serve(cluster, "h", STANDIN_ENV_FILE=str(env_file), PYTHONPATH="/opt/hook")
    s.read(until="READY=1", timeout=120)
    got = json.loads(env_file.read_text())
    assert got["PYTHONPATH"].split(":") == [str(API_GUARD_DIR), "/opt/hook"]
    assert got["FROM_CONFIG"] == "1"  # the cluster file's env is there too
