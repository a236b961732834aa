from __future__ import annotations

import pytest

from dspark.node import agent as A
from dspark.node.states import SERVING, NodeState
from tests.harness.dashboard import MetricsStandIn


@pytest.fixture
def metrics_stand_in():
    s = MetricsStandIn()
    yield s
    s.close()


@pytest.fixture
def agents():
    """Two real node agents (dspark.node.agent.Agent) on loopback, serving states the test sets."""
    states = {
        "node-a": NodeState(node="node-a", rank=0, role="head", state=SERVING, vllm_pid=4242,
                              vllm_version="0.28.0", api_url="http://127.0.0.1:1"),
        "node-b": NodeState(node="node-b", rank=1, role="worker", state=SERVING, vllm_pid=4343,
                              vllm_version="0.28.0", restarts=2),
    }
    running = {name: A.Agent("127.0.0.1", 0, st.snapshot).start() for name, st in states.items()}
    yield states, running
    for a in running.values():
        try:
            a.stop()
        except OSError:
            pass

