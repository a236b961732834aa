"""`dspark serve` as a real process, with a stand-in for vLLM: readiness, sd_notify,
signals, escalation and exit codes. (The real vLLM pair is in test_local_pair.py.)"""

import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest

from dspark.node.policy import EXIT_CONFIG, EXIT_DIED, EXIT_NEVER_READY, EXIT_OK
from tests.harness.pair import dspark_cmd, run_dspark
from tests.harness.standin import STANDIN, Serve, alive, free_port, write_cluster  # noqa: F401 (Serve: used through the fixture)


def test_head_ready_after_a_real_completion_then_clean_stop(tmp_path, serve):
    cluster = write_cluster(tmp_path)
    env_file, child_file = tmp_path / "env.json", tmp_path / "child.pid"
    s = serve(cluster, "h", STANDIN_ENV_FILE=env_file, STANDIN_CHILD_FILE=child_file, STANDIN_READY_DELAY=1.0)
    msgs = s.read(until="READY=1")
    statuses = [m for m in msgs if m.startswith("STATUS=")]
    assert statuses[0].startswith("STATUS=starting")
    assert any("EXTEND_TIMEOUT_USEC=" in m for m in msgs)
    assert msgs[-1] == f"READY=1\nSTATUS=serving: API on {s.node.api_url}"
    st = s.state()
    assert st["state"] == "serving" and st["liveness"]["ok"] and st["vllm_version"] == "0.28.0-standin"
    assert set(st["hardware"]) == {"gpus", "nvme_temperature_c"}  # read by the dashboard on the head
    s.read(until="WATCHDOG=1", timeout=10)  # pinged while liveness holds
    # vLLM's environment: the config's, without the notify protocol's variables
    child_env = json.loads(env_file.read_text())
    assert child_env["FROM_CONFIG"] == "1" and child_env["VLLM_HOST_IP"] == "127.0.0.1"
    assert not {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"} & set(child_env)
    grandchild = int(child_file.read_text())
    vllm_pid = st["vllm_pid"]
    s.proc.send_signal(signal.SIGTERM)
    assert s.wait() == EXIT_OK
    assert any(m.startswith("STOPPING=1") for m in s.messages)
    assert not alive(vllm_pid) and not alive(grandchild)  # the whole process group is gone


@pytest.mark.parametrize("drain_s", [0.0, 1.0])
def test_sigkill_after_the_grace_period(tmp_path, serve, drain_s):
    """Without a drain: SIGKILL after stop_grace_s. With one: a vLLM that does
    not exit on the drain's SIGTERM is killed once drain_s + stop_grace_s are up."""
    cluster = write_cluster(tmp_path, stop_grace_s=1.5, drain_s=drain_s)
    s = serve(cluster, "h", STANDIN_IGNORE_TERM=1)
    s.read(until="READY=1")
    pid = s.state()["vllm_pid"]
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGINT)
    assert s.wait() == EXIT_OK
    took = time.monotonic() - t0
    assert not alive(pid) and drain_s + 1.4 < took < drain_s + 10, took


def test_never_ready_exit_code(tmp_path, serve):
    s = serve(write_cluster(tmp_path), "h", STANDIN_EXIT_AFTER=0.1, STANDIN_READY_DELAY=5)
    assert s.wait() == EXIT_NEVER_READY
    assert not any(m.startswith("READY=1") for m in s.messages)
    assert "before becoming ready" in s.messages[-1]


def test_vllm_exit_while_serving(tmp_path, serve):
    s = serve(write_cluster(tmp_path), "h", STANDIN_EXIT_AFTER=4)
    s.read(until="READY=1")
    assert s.wait() == EXIT_DIED
    assert "while serving" in s.messages[-1]


def test_liveness_lost_although_health_answers(tmp_path, serve):
    # /health keeps answering 200; only real completions fail (as after a worker died).
    s = serve(write_cluster(tmp_path), "h", STANDIN_FAIL_AFTER=3)
    s.read(until="READY=1")
    t_fail = s.standin_t0() + 3
    # Judged when the supervisor says so (STOPPING=1 with the reason), not when it has exited:
    # the stop's own duration on a loaded host is not the detection's.
    s.read(until="liveness lost", timeout=30)
    detected = time.monotonic() - t_fail
    assert s.wait(timeout=30) == EXIT_DIED
    assert "liveness lost" in s.messages[-1]
    assert detected < 10, detected


def test_worker_ready_in_the_rendezvous_and_leaves_when_the_head_is_gone(tmp_path, serve):
    cluster = write_cluster(tmp_path, nodes=2)
    w = serve(cluster, "w")
    msgs = w.read(until="READY=1")
    assert "rendezvous" in msgs[-1] or "loading" in msgs[-1] or "warming" in msgs[-1]
    h = serve(cluster, "h")
    h.read(until="READY=1")
    deadline = time.monotonic() + 10
    while w.state()["state"] != "serving" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert w.state()["state"] == "serving"
    h.proc.send_signal(signal.SIGKILL)  # the head vanishes without a word
    h.proc.wait()
    assert w.wait(timeout=20) == EXIT_DIED
    assert "pair broken" in w.messages[-1]


def test_head_waits_for_the_worker_before_starting_vllm(tmp_path, serve):
    cluster = write_cluster(tmp_path, nodes=2)
    env_file = tmp_path / "head-env.json"
    h = serve(cluster, "h", STANDIN_ENV_FILE=env_file)
    h.read(until="waiting for w", timeout=10)
    time.sleep(1.5)
    assert not env_file.exists() and h.state()["state"] == "rendezvous"
    serve(cluster, "w").read(until="READY=1")
    h.read(until="READY=1")
    assert env_file.exists()


def test_refuses_a_plan_that_does_not_fit(tmp_path):
    cluster = write_cluster(tmp_path)
    (tmp_path / "model" / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
        "intermediate_size": 28672, "num_attention_heads": 64, "num_key_value_heads": 8,
        "num_hidden_layers": 80, "vocab_size": 128256, "torch_dtype": "bfloat16",
        "max_position_embeddings": 8192}))
    text = cluster.read_text().replace("[serving]", "[serving]\nusable_memory_gib = 0.5\nmax_model_len = 8192")
    cluster.write_text(text)
    env_file = tmp_path / "env.json"
    r = subprocess.run(dspark_cmd("serve", "--config", str(cluster), "--node", "h"), capture_output=True, text=True,
                       env={**os.environ, "STANDIN_ENV_FILE": str(env_file)}, timeout=60)
    assert r.returncode == EXIT_CONFIG, r.stderr
    assert "refusing to start" in r.stderr and "Traceback" not in r.stderr
    assert not env_file.exists()  # vLLM was never started


def completions(api_url: str, n: int, max_tokens: int, timeout: float = 60) -> tuple[list, list[threading.Thread]]:
    """`n` concurrent completions in threads; each result lands in the returned list."""
    results: list = []

    def one():
        body = json.dumps({"model": "m", "prompt": [1, 2, 3], "max_tokens": max_tokens}).encode()
        req = urllib.request.Request(api_url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                results.append(r.status)
        except (urllib.error.URLError, OSError) as e:
            results.append(repr(e))

    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return results, threads


def test_a_saturated_head_is_alive_on_progress_and_keeps_its_requests(tmp_path, serve):
    # 2 slots, 4 requests of 100 tokens at 50 ms: the queue is full for ~10 s, more than
    # 3 x (interval + timeout). A 1-token probe would wait behind it and time out.
    s = serve(write_cluster(tmp_path, stall_s=5.0), "h", STANDIN_SLOTS=2, STANDIN_TOKEN_S=0.05)
    s.read(until="READY=1")
    t0 = time.monotonic()
    results, threads = completions(s.node.api_url, 4, max_tokens=100)
    proofs, status = set(), None
    while any(t.is_alive() for t in threads) and time.monotonic() - t0 < 40:
        live = s.state()["liveness"]
        proofs.add(live["proof"])
        assert s.state()["state"] == "serving", s.state()
        if status is None and time.monotonic() - t0 > 3:
            status = run_dspark("status", "--config", str(tmp_path / "cluster.toml")).stdout
        time.sleep(0.3)
    assert "liveness (h): alive; last proof: progress" in status, status
    assert results == [200] * 4
    assert time.monotonic() - t0 > 3 * (0.5 + 1.0)
    assert "progress" in proofs
    assert s.proc.poll() is None and s.state()["state"] == "serving"
    pings = [m for m in s.read(timeout=3) if m == "WATCHDOG=1"]
    assert pings  # the watchdog is fed on progress too


def test_a_stalled_engine_is_detected_within_stall_s_while_health_answers(tmp_path, serve):
    stall_s, interval = 3.0, 0.5
    s = serve(write_cluster(tmp_path, stall_s=stall_s, liveness_interval_s=interval), "h",
              STANDIN_TOKEN_S=0.05, STANDIN_STALL_AFTER=4)
    s.read(until="READY=1")
    completions(s.node.api_url, 3, max_tokens=1000)
    t_stall = s.standin_t0() + 4  # when the stand-in's engine stalls
    worst = 0.0  # the slowest answer of the supervisor's agent: how late this host runs it now
    while time.monotonic() < t_stall:
        t = time.monotonic()
        assert s.state()["state"] == "serving"
        worst = max(worst, time.monotonic() - t)
        time.sleep(0.2)
    # Detected when the supervisor says so (STOPPING=1 with the reason, sent before it
    # stops vLLM), so the stop's own duration on a loaded host is not counted.
    s.read(until="engine stalled", timeout=30)
    detected = time.monotonic() - t_stall
    assert s.wait(timeout=30) == EXIT_DIED
    assert "engine stalled: 3 running" in s.messages[-1], s.messages[-1]
    # stall_s, then at most a round, plus a loaded host's slack: 4 s, and twice the slowest
    # answer measured above (the detection waits on one /metrics poll and one wake of the
    # supervisor's loop, each as late as the host runs that process).
    assert detected < stall_s + interval + 4.0 + 2 * worst, (detected, worst)


def test_a_hung_idle_engine_is_caught_by_the_probe_and_the_watchdog_is_starved(tmp_path, serve):
    s = serve(write_cluster(tmp_path, stall_s=30.0), "h", STANDIN_STALL_AFTER=3)
    s.read(until="READY=1")
    s.read(until="liveness lost", timeout=20)
    st = s.state()
    assert st["state"] == "failed" and "probe failed (2/2)" in st["detail"]
    assert st["liveness"]["proof"] == "probe"
    # Under the watchdog a hung vLLM is systemd's to kill: no ping after the verdict.
    n = len(s.messages)
    assert "WATCHDOG=1" not in s.read(timeout=5)[n:]
