"""Liveness on the real local pair (the shared one: the load changes nothing): a pair
saturated for longer than three liveness windows keeps serving every request, judged alive on
the progress vLLM's own /metrics show, and no node is restarted.

A wedged engine (stopped with its requests running) and a hung idle one are the supervisor's to
find whatever vLLM runs: that is proven on the stand-in vLLM, which stops advancing on cue
(tests/node/test_supervisor.py: within stall_s, and by the 1-token probe with the watchdog starved),
and on a fake clock (tests/node/test_liveness.py, tests/node/test_node_policy.py)."""

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from dspark.config import validate as C
from dspark.engine import facts as F
from dspark.local import cluster as L
from dspark.node.liveness import read_progress

pytestmark = pytest.mark.pair


def complete(api_url: str, max_tokens: int, timeout: float = 600) -> str:
    """One completion of exactly `max_tokens` tokens; 'ok' or what went wrong."""
    body = json.dumps({"model": L.SERVED_NAME, "prompt": [1, 2, 3, 4], "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(api_url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out = json.loads(r.read())
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:
        return repr(e)
    n = out["usage"]["completion_tokens"]
    return "ok" if n == max_tokens else f"{n} of {max_tokens} tokens"


def load(api_url: str, clients: int, until: float, max_tokens: int) -> tuple[list[str], list[threading.Thread]]:
    """`clients` threads sending completions back to back until monotonic time `until`."""
    results: list[str] = []

    def client():
        while time.monotonic() < until:
            results.append(complete(api_url, max_tokens))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    return results, threads


def metrics(api_url: str):
    with urllib.request.urlopen(api_url + F.METRICS, timeout=10) as r:
        return read_progress(r.read().decode())


def test_saturation_for_longer_than_three_liveness_windows_loses_nothing(local_pair):
    cluster = C.load(local_pair.cluster_file)
    sup, max_seqs = cluster.supervisor, cluster.serving.max_num_seqs
    window = sup.liveness_interval_s + sup.liveness_timeout_s
    before = {node: local_pair.state(node) for node in ("local-head", "local-worker")}
    t0 = time.monotonic()
    results, threads = load(local_pair.api_url, 2 * max_seqs, t0 + 3 * window + 5, max_tokens=400)
    seen_waiting, proofs = 0.0, set()
    # On a saturated 2-core host this test's own reads of an agent may time out (its loop also
    # waits on /metrics); the judge of a silent agent is the product: a peer silent past
    # head_lost_s breaks the pair, and the nodes restart. So every answer must say "serving",
    # and after the load both nodes run the vLLM and the supervisor run they ran before.
    reads = {node: 0 for node in before}
    while any(t.is_alive() for t in threads):
        assert time.monotonic() - t0 < 900, "the load did not finish"
        states = {}
        for node in reads:
            try:
                states[node] = local_pair.state(node)
                reads[node] += 1
            except OSError:  # a read timed out (TimeoutError, URLError)
                pass
        for st in states.values():
            assert st["state"] == "serving", st          # never declared dead while busy
        if "local-head" in states:
            proofs.add((states["local-head"]["liveness"] or {}).get("proof"))
        seen_waiting = max(seen_waiting, metrics(local_pair.api_url).waiting)
        time.sleep(1.0)
    took = time.monotonic() - t0
    assert took > 3 * window
    assert seen_waiting > 0, "the queue never filled: not a saturation"
    assert results and set(results) == {"ok"}, [r for r in results if r != "ok"][:5]
    assert "progress" in proofs
    assert min(reads.values()) >= 3, reads               # the answers above say something
    for node, st in before.items():
        now = local_pair.state(node)
        assert now["state"] == "serving", now
        assert (now["vllm_pid"], now["started_at"], now["restarts"]) == (st["vllm_pid"], st["started_at"],
                                                                        st["restarts"]), (node, st, now)
