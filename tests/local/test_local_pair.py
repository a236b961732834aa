"""Against the real local pair (vLLM CPU build, TP=2 over two processes on 127.0.0.1/2)."""

import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dspark.config import validate as C
from dspark.engine import facts as F
from dspark.engine.log import SHUTDOWN_ABORT_LINE
from dspark.local import cluster as L
from tests.harness.pair import dspark_cmd, get_json, kill_leftovers, pick_ports, run_dspark

pytestmark = pytest.mark.pair


def completion(api_url: str, prompt: list[int], max_tokens: int = 4) -> dict:
    body = json.dumps({"model": L.SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(api_url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def gauge(api_url: str, family: str) -> float:
    with urllib.request.urlopen(api_url + F.METRICS, timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) if fam.name == family for s in fam.samples)


def counter(metrics_text: str, family: str) -> float:
    for fam in text_string_to_metric_families(metrics_text):
        if fam.name == family:
            return sum(s.value for s in fam.samples if s.name.endswith("_total"))
    raise KeyError(family)


def test_pair_serves_real_requests(local_pair):
    out = completion(local_pair.api_url, [1, 2, 3, 4], max_tokens=5)
    assert out["usage"] == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9,
                            "prompt_tokens_details": None} or out["usage"]["completion_tokens"] == 5


def test_worker_reached_the_rendezvous_before_the_head_started(local_pair):
    log = local_pair.log()
    assert log.index("local-worker  rendezvous") < log.index("starting the head")
    head, worker = local_pair.state("local-head"), local_pair.state("local-worker")
    assert worker["started_at"] < head["started_at"]


def test_status_while_serving(local_pair):
    r = run_dspark("status", "--config", str(local_pair.cluster_file))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "pair: SERVING" in r.stdout and "local-worker" in r.stdout
    r = run_dspark("status", "--config", str(local_pair.cluster_file), "--json")
    snap = json.loads(r.stdout)
    assert snap["serving"] and snap["api"]["health"] == 200 and snap["api"]["version"] == F.VLLM_RELEASE
    assert [(n["name"], n["state"]) for n in snap["nodes"]] == [("local-head", "serving"), ("local-worker", "serving")]
    head = snap["nodes"][0]
    assert head["liveness"]["ok"] and head["vllm_version"] == F.VLLM_RELEASE and head["vllm_pid"] > 0


def test_agents_are_read_only_and_export_metrics(local_pair):
    url = local_pair.agent_url("local-worker")
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    state = {s.labels["state"]: s.value for s in fams["dspark_node_state"].samples}
    assert state["serving"] == 1 and sum(state.values()) == 1
    req = urllib.request.Request(url + "/state", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code == 405
    e.value.close()


def test_wait_worker_returns_at_once_when_the_worker_is_in_the_pair(local_pair):
    r = run_dspark("wait-worker", "--config", str(local_pair.cluster_file), "--timeout", "10")
    assert r.returncode == 0 and "local-worker serving" in r.stdout


def test_ports_in_use_are_refused_before_anything_starts(local_pair, tmp_path):
    try:
        r = run_dspark("local", "up", "--dir", str(tmp_path), "--api-port", str(local_pair.ports.api),
                       "--agent-port", str(local_pair.ports.agent), "--master-port", str(local_pair.ports.master))
    finally:
        kill_leftovers(tmp_path)  # should the refusal fail, the nodes it started must not outlive the test
    assert r.returncode == 1 and "is not free" in r.stderr and "Traceback" not in r.stderr


def test_bad_config_refused_before_anything_starts(tmp_path):
    ports = pick_ports()
    path = L.prepare(tmp_path, ports)
    path.write_text(path.read_text().replace("rank = 1", "rank = 0"))
    r = run_dspark("serve", "--config", str(path), "--node", "local-worker")
    assert r.returncode == 2 and "rank 0 is given to more than one node" in r.stderr
    with socket.socket() as s:  # nothing bound the agent port
        s.bind(("127.0.0.2", ports.agent))


def test_ready_only_after_a_real_completion_and_clean_stop(tmp_path):
    """The two supervisors by hand, with real notify sockets, as systemd would run them."""
    ports = pick_ports()
    cluster_file = L.prepare(tmp_path, ports)
    text = cluster_file.read_text()
    assert text.count("[supervisor]\n") == 1 and "drain_s" not in text
    cluster_file.write_text(text.replace("[supervisor]\n", "[supervisor]\ndrain_s = 2.0\n"))
    cluster = C.load(cluster_file)
    assert cluster.supervisor.drain_s == 2.0
    socks, procs = {}, {}
    try:
        for node in ("local-worker", "local-head"):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            s.bind(str(tmp_path / f"{node}.sock"))
            s.settimeout(1)
            socks[node] = s
            env = {**os.environ, "NOTIFY_SOCKET": str(tmp_path / f"{node}.sock")}
            with open(tmp_path / f"{node}.log", "w") as log:
                procs[node] = subprocess.Popen(dspark_cmd("serve", "--config", str(cluster_file), "--node", node),
                                               env=env, stdout=log, stderr=subprocess.STDOUT)

        def wait_ready(node: str, timeout: float = 600) -> list[str]:
            msgs, deadline = [], time.monotonic() + timeout
            while time.monotonic() < deadline:
                assert procs[node].poll() is None, (tmp_path / f"{node}.log").read_text()[-3000:]
                try:
                    msgs.append(socks[node].recv(4096).decode())
                except TimeoutError:
                    continue
                if msgs[-1].startswith("READY=1"):
                    return msgs
            raise AssertionError(f"{node} not ready: {msgs}")

        wait_ready("local-worker")
        msgs = wait_ready("local-head")
        # READY=1 came after a real completion: vLLM's own counters already show it.
        with urllib.request.urlopen(cluster.head.api_url + F.METRICS, timeout=10) as r:
            metrics = r.read().decode()
        assert counter(metrics, F.REQUEST_SUCCESS) >= 1 and counter(metrics, F.GENERATION_TOKENS) >= 1
        assert any(m.startswith("STATUS=rendezvous") for m in msgs)
        pids = [get_json(n.agent_url + "/state")["vllm_pid"] for n in cluster.nodes]

        # Requests in flight at the stop, longer than the head's drain (2 s, set above): vLLM aborts
        # them (EngineDeadError in its output handler).
        answers: list[str] = []

        def long_request():
            body = json.dumps({"model": L.SERVED_NAME, "prompt": [5, 6, 7], "max_tokens": 3000,
                               "ignore_eos": True}).encode()  # random weights may end early otherwise
            req = urllib.request.Request(cluster.head.api_url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    r.read()
                answers.append("done")
            except Exception as e:  # the abort's HTTP 500, or the connection closing
                answers.append(type(e).__name__)

        inflight = [threading.Thread(target=long_request) for _ in range(2)]
        for t in inflight:
            t.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and gauge(cluster.head.api_url, F.RUNNING) < 2:
            time.sleep(0.2)
        # The head first, as local up stops them: a worker stopped under a draining head would break
        # its collectives. The worker then leaves by itself ("pair broken: local-head: it is stopped",
        # code 4) or on its SIGTERM (0).
        procs["local-head"].send_signal(signal.SIGTERM)
        assert procs["local-head"].wait(timeout=150) == 0
        procs["local-worker"].send_signal(signal.SIGTERM)
        rc = procs["local-worker"].wait(timeout=60)
        assert rc == 0 or (rc == 4 and "pair broken: local-head: it is stopped"
                           in (tmp_path / "local-worker.log").read_text()), rc
        for t in inflight:
            t.join(timeout=60)
        # A requested stop reads as clean: vLLM's abort is one line, never a traceback.
        head_log = (tmp_path / "local-head.log").read_text()
        assert "Traceback" not in head_log, head_log[-6000:]
        assert "done" not in answers, answers
        # vLLM 0.28.0 (CPU) aborts them and exits (one line, SHUTDOWN_ABORT_LINE), or, seen in 3 of 5
        # runs here, hangs in its shutdown past the drain until the supervisor kills it at
        # drain_s + stop_grace_s: either way no traceback (above) and nothing left behind (below).
        overran = "drain overran" in head_log and "after SIGTERM (drain_s + stop_grace_s): killed" in head_log
        assert SHUTDOWN_ABORT_LINE in head_log or overran, head_log[-6000:]
        for pid in pids:  # no vLLM process left behind
            assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2]
        leftover = subprocess.run(["pgrep", "-f", str(tmp_path / "model")], capture_output=True, text=True).stdout
        assert leftover == ""
        r = run_dspark("status", "--config", str(cluster_file))
        assert r.returncode == 1 and "pair: NOT SERVING" in r.stdout and "unreachable" in r.stdout
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        for s in socks.values():
            s.close()
