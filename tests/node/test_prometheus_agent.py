"""The agent's /metrics (dspark.node.agent): a prometheus_client Collector registered once in the
agent's own registry reads the supervisor's snapshot at each scrape. Its metric names and labels
are those the agent has always served (the dashboard and the pair tests read them); a node's
memory, where the snapshot carries one, adds three gauges. A real agent on loopback."""

from __future__ import annotations

import threading
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dspark.node.agent import Agent, metrics_text
from dspark.node.states import STATES, Liveness, NodeState

IDENT = {"node": "spark-a", "rank": "0", "role": "head"}
# Every family the agent serves for a head with a full liveness round, with its label names.
FAMILIES = {
    "dspark_node_info": {"node", "rank", "role", "vllm_version", "dspark_version"},
    "dspark_node_state": {"node", "rank", "role", "state"},
    "dspark_node_restarts": {"node", "rank", "role"},
    "dspark_node_uptime_seconds": {"node", "rank", "role"},
    "dspark_node_vllm_pid": {"node", "rank", "role"},
    "dspark_node_liveness_ok": {"node", "rank", "role"},
    "dspark_node_liveness_timestamp_seconds": {"node", "rank", "role"},
    "dspark_node_liveness_proof_timestamp_seconds": {"node", "rank", "role"},
    "dspark_node_liveness_proof": {"node", "rank", "role", "proof"},
    "dspark_node_liveness_latency_seconds": {"node", "rank", "role"},
}
MEMORY = {"dspark_node_memory_total_bytes": "total_bytes", "dspark_node_memory_used_bytes": "used_bytes",
          "dspark_node_memory_available_bytes": "available_bytes"}


def head_state() -> NodeState:
    s = NodeState(node="spark-a", rank=0, role="head", state="serving", vllm_pid=4242, vllm_version="0.28.0",
                  restarts=3)
    s.liveness = Liveness(ok=True, at=1_700_000_000.5, latency_s=0.022, proof="probe", proof_at=1_700_000_000.25)
    return s


class Snapshots:
    """The supervisor's side: a state the test changes, and how often the agent read it. The
    snapshot's `memory` is this host's (dspark.node.host_memory) unless the test gives one or takes it
    out (memory=ABSENT)."""

    def __init__(self, state: NodeState, memory: object = None, **extra):
        self.state, self.memory, self.extra, self.reads = state, memory, extra, 0
        self.lock = threading.Lock()

    def __call__(self) -> dict:
        with self.lock:
            self.reads += 1
            snap = {**self.state.snapshot(), **self.extra}
            if self.memory is ABSENT:
                snap.pop("memory", None)
            elif self.memory is not None:
                snap["memory"] = self.memory
            return snap


ABSENT = object()


@pytest.fixture
def agent_for():
    started: list[Agent] = []

    def start(snapshots: Snapshots) -> Agent:
        a = Agent("127.0.0.1", 0, snapshots).start()
        started.append(a)
        return a

    yield start
    for a in started:
        a.stop()


def scrape(agent: Agent) -> tuple[dict, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{agent.port}/metrics", timeout=10) as r:
        text, ctype = r.read().decode(), r.headers["Content-Type"]
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    return fams, ctype


def test_names_labels_and_values_of_a_serving_head(agent_for):
    agent = agent_for(Snapshots(head_state(), memory=ABSENT))
    fams, ctype = scrape(agent)
    assert ctype.startswith("text/plain; version=0.0.4")
    assert {name: {k for s in f.samples for k in s.labels} for name, f in fams.items()} == FAMILIES
    assert all(f.type == "gauge" for f in fams.values())
    value = {name: f.samples[0].value for name, f in fams.items() if len(f.samples) == 1}
    assert value["dspark_node_restarts"] == 3 and value["dspark_node_vllm_pid"] == 4242
    assert value["dspark_node_liveness_ok"] == 1 and value["dspark_node_liveness_latency_seconds"] == 0.022
    assert value["dspark_node_liveness_proof_timestamp_seconds"] == 1_700_000_000.25
    states = {s.labels["state"]: s.value for s in fams["dspark_node_state"].samples}
    assert list(states) == list(STATES) and states["serving"] == 1 and sum(states.values()) == 1
    assert {s.labels["proof"]: s.value for s in fams["dspark_node_liveness_proof"].samples} == \
        {"progress": 0, "probe": 1}
    info = fams["dspark_node_info"].samples[0].labels
    assert info["vllm_version"] == "0.28.0" and {k: info[k] for k in IDENT} == IDENT


def test_the_collector_reads_the_snapshot_at_each_scrape_from_one_registry(agent_for):
    snaps = Snapshots(head_state())
    agent = agent_for(snaps)
    registry = agent.registry
    assert snaps.reads == 0  # registering the collector reads nothing
    scrape(agent)
    assert snaps.reads == 1
    snaps.state.state, snaps.state.restarts, snaps.state.vllm_pid = "failed", 4, None
    fams, _ = scrape(agent)
    assert snaps.reads == 2 and agent.registry is registry
    states = {s.labels["state"]: s.value for s in fams["dspark_node_state"].samples}
    assert states["failed"] == 1 and states["serving"] == 0
    assert fams["dspark_node_restarts"].samples[0].value == 4
    assert fams["dspark_node_vllm_pid"].samples[0].value == 0
    # No series left over from earlier scrapes: one sample per state, one per gauge.
    assert len(fams["dspark_node_state"].samples) == len(STATES)


def test_a_worker_without_liveness_serves_no_liveness_gauges(agent_for):
    worker = NodeState(node="spark-b", rank=1, role="worker", state="rendezvous")
    fams, _ = scrape(agent_for(Snapshots(worker, memory=ABSENT)))
    assert set(fams) == {"dspark_node_info", "dspark_node_state", "dspark_node_restarts",
                         "dspark_node_uptime_seconds", "dspark_node_vllm_pid"}
    assert fams["dspark_node_state"].samples[0].labels["role"] == "worker"
    assert fams["dspark_node_info"].samples[0].labels["vllm_version"] == ""


def test_memory_in_the_snapshot_becomes_three_gauges(agent_for):
    memory = {"total_bytes": 128_526_278_656, "used_bytes": 101_000_000_000, "available_bytes": 27_526_278_656,
              "source": "nvml"}
    fams, _ = scrape(agent_for(Snapshots(head_state(), memory=memory, events=[{"at": 1.0, "kind": "start"}])))
    for name, key in MEMORY.items():
        (sample,) = fams[name].samples
        assert sample.value == memory[key] and sample.labels == {**IDENT, "source": "nvml"}
        assert fams[name].type == "gauge"
    assert not [n for n in fams if "event" in n]  # the events list is for /state, not a metric


def test_the_supervisors_own_snapshot_serves_this_hosts_memory(agent_for):
    """NodeState.snapshot() as the supervisor serves it; where it reports this host's memory (a
    dict), the gauges carry it, else there are none."""
    snaps = Snapshots(head_state())
    memory = snaps().get("memory")
    fams, _ = scrape(agent_for(snaps))
    if not isinstance(memory, dict):
        assert not set(MEMORY) & set(fams)
        return
    (total,) = fams["dspark_node_memory_total_bytes"].samples
    assert total.value == memory["total_bytes"] and total.labels == {**IDENT, "source": memory["source"]}
    assert set(MEMORY) <= set(fams)


def test_no_memory_no_gauge_and_a_missing_figure_is_left_out(agent_for):
    fams, _ = scrape(agent_for(Snapshots(head_state(), memory=ABSENT)))
    assert not set(MEMORY) & set(fams)
    fams, _ = scrape(agent_for(Snapshots(head_state(), memory="unreadable")))  # not a dict: no gauge
    assert not set(MEMORY) & set(fams)
    partial = {"total_bytes": 64 * 2**30, "used_bytes": None, "available_bytes": 32 * 2**30, "source": "/proc/meminfo"}
    fams, _ = scrape(agent_for(Snapshots(head_state(), memory=partial)))
    assert "dspark_node_memory_used_bytes" not in fams
    assert fams["dspark_node_memory_total_bytes"].samples[0].value == 64 * 2**30
    assert fams["dspark_node_memory_available_bytes"].samples[0].labels["source"] == "/proc/meminfo"


def test_metrics_text_is_what_the_agent_serves(agent_for):
    fixed = Snapshots(head_state(), memory={"total_bytes": 1, "used_bytes": 1, "available_bytes": 0,
                                            "source": "host"})()
    agent = Agent("127.0.0.1", 0, lambda: fixed).start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{agent.port}/metrics", timeout=10) as r:
            served = r.read().decode()
    finally:
        agent.stop()
    assert served == metrics_text(fixed)
