"""A planned stop drains, on the real local pair (the shared one, as the last test of its session:
the stop that ends it): Ctrl-C of `dspark local up`
(SIGTERM to the head's supervisor) lets every request in flight finish with its full output,
turns new requests away at once, and exits 0 within the drain. (A fault under load, kill -9 of the
worker's vLLM, still stops the head at once: tests/local/test_no_orphans.py, on a pair of its own.)

The policy side (which events end a drain, and how) is driven on a fake clock below, with the
helpers of test_node_policy.py."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from dspark.config import validate as C
from dspark.engine.facts import RUNNING
from dspark.engine.metrics import parse_samples
from dspark.local import cluster as L
from dspark.node import states as S
from dspark.node.events import Events
from dspark.node.policy import EXIT_DIED, EXIT_OK
from tests.local.test_no_orphans import run_of, wait_until
from tests.node.test_node_policy import agent, exit_of, good_probe, head_peer, kinds, policy, state_of, worker_peer

IN_FLIGHT = 6
MAX_TOKENS = 300  # 6 at once take ~15 s on the loaded 2-core host: in flight at the stop, done well within the drain


# ------------------------------------------------------------------ the policy, on a fake clock
def draining_head(drain_s: float = 60.0, stop_grace_s: float = 15.0):
    """A serving head of a pair that has just been sent SIGTERM (at t=2)."""
    p = policy(peers=[worker_peer()], limits={"drain_s": drain_s, "stop_grace_s": stop_grace_s})
    p.start(0.0)
    assert "start_vllm" in kinds(p.step(0.1, Events(peers={"w": agent(S.RENDEZVOUS)})))
    p.step(0.5, Events(stage="warming", ready_probe=good_probe(0.5)))
    p.step(1.0, Events(stage="warming", peers={"w": agent(S.SERVING)}))
    assert p.ready and p.state == S.SERVING
    out = p.step(2.0, Events(signal=signal.SIGTERM, stage="warming"))
    return p, out


def stops(out) -> bool:
    return "stop" in kinds(out) and exit_of(out) is not None and kinds(out).index("stop") < kinds(out).index("exit")


def test_a_planned_stop_of_a_serving_head_drains_and_exits_0_once_vllm_is_gone():
    p, out = draining_head()
    assert kinds(out) == ["state", "drain"], out
    assert state_of(out)[0] == S.STOPPING and "draining" in state_of(out)[1]
    # While vLLM drains: no liveness round (its completion would be turned away), no exit.
    out = p.step(30.0, Events(stage="warming", peers={"w": agent(S.SERVING)}))
    assert "liveness_round" not in kinds(out) and exit_of(out) is None and "stop" not in kinds(out)
    out = p.step(31.0, Events(stage="warming", vllm_exit=0))
    assert "stop" not in kinds(out)  # it has stopped by itself: only the sweep (the supervisor's)
    assert exit_of(out).code == EXIT_OK and state_of(out)[0] == S.STOPPED


def test_a_drain_that_overruns_is_cut_short_by_the_stop():
    p, _ = draining_head(drain_s=60.0, stop_grace_s=15.0)
    assert exit_of(p.step(2.0 + 60.0 + 14.0, Events(stage="warming"))) is None
    out = p.step(2.0 + 60.0 + 15.5, Events(stage="warming"))
    assert stops(out) and exit_of(out).code == EXIT_OK
    assert next(a for a in out if a.kind == "stop").at_once  # it had its time: SIGKILL now


@pytest.mark.parametrize("event, code", [
    (Events(signal=signal.SIGTERM), EXIT_OK),           # a second SIGTERM/Ctrl-C: stop now
    (Events(signal=signal.SIGHUP), EXIT_DIED),          # a restart asked for
    (Events(peers={"w": agent(S.STOPPING)}), EXIT_OK),  # the worker left: the pair is broken
])
def test_during_a_drain_a_second_signal_or_a_fault_stops_at_once(event, code):
    p, _ = draining_head()
    out = p.step(5.0, event)
    assert stops(out), out
    assert exit_of(out).code == code


def test_a_worker_keeps_its_vllm_while_its_head_drains_and_leaves_once_the_head_has_stopped():
    p = policy(is_head=False, peers=[head_peer()])
    p.start(0.0)
    p.step(1.0, Events(stage="rendezvous"))
    p.step(2.0, Events(stage="loading", peers={"h": agent(S.SERVING)}))
    out = p.step(3.0, Events(stage="loading", peers={"h": agent(S.STOPPING)}))
    assert exit_of(out) is None and "stop" not in kinds(out)
    out = p.step(4.0, Events(stage="loading", peers={"h": agent(S.STOPPED)}))
    assert exit_of(out) is not None and "stop" in kinds(out)


def test_a_head_that_is_not_serving_yet_or_has_no_drain_stops_at_once():
    p = policy(peers=[worker_peer()], limits={"drain_s": 60.0})
    p.start(0.0)
    p.step(0.5, Events(peers={"w": agent(S.RENDEZVOUS)}))  # the workers are in: vLLM starts
    out = p.step(1.0, Events(signal=signal.SIGTERM, stage="loading"))
    assert "drain" not in kinds(out) and stops(out)
    p, out = draining_head(drain_s=0.0)
    assert "drain" not in kinds(out) and stops(out)


# ------------------------------------------------------------------ the real pair
class Clients:
    """`n` completions with `max_tokens` each, half of them streamed, each in a thread of its own;
    `results[i]` is (HTTP status or error name, tokens generated, finish reason)."""

    def __init__(self, api_url: str, n: int, max_tokens: int, first: int = 0):
        self.api_url, self.max_tokens = api_url, max_tokens
        self.results: dict[int, tuple] = {}
        self.threads = [threading.Thread(target=self._one, args=(first + i, i % 2 == 1), daemon=True)
                        for i in range(n)]
        for t in self.threads:
            t.start()

    def _one(self, i: int, stream: bool) -> None:
        body = {"model": L.SERVED_NAME, "prompt": [1 + i, 2, 3], "max_tokens": self.max_tokens,
                "ignore_eos": True, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        req = urllib.request.Request(self.api_url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                text = r.read().decode()
                status = r.status
        except urllib.error.HTTPError as e:
            self.results[i] = (e.code, 0, None)
            return
        except (urllib.error.URLError, OSError, ValueError) as e:
            self.results[i] = (type(e).__name__, 0, None)
            return
        try:
            if stream:
                chunks = [json.loads(line[6:]) for line in text.splitlines()
                          if line.startswith("data: {")]
                done = text.rstrip().endswith("data: [DONE]")
                usage = next((c["usage"] for c in reversed(chunks) if c.get("usage")), None)
                reasons = [ch["finish_reason"] for c in chunks for ch in c.get("choices", [])
                           if ch.get("finish_reason")]
                tokens = usage["completion_tokens"] if usage and done else 0
                self.results[i] = (status, tokens, reasons[-1] if reasons else None)
            else:
                d = json.loads(text)
                self.results[i] = (status, d["usage"]["completion_tokens"], d["choices"][0]["finish_reason"])
        except (ValueError, KeyError, IndexError, TypeError) as e:
            self.results[i] = (f"bad answer: {e}", 0, None)

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(timeout=max(0.1, deadline - time.monotonic()))


def running(api_url: str) -> float:
    try:
        with urllib.request.urlopen(api_url + "/metrics", timeout=5) as r:
            return parse_samples(r.read().decode()).gauge(RUNNING) or 0.0
    except (urllib.error.URLError, OSError, ValueError):
        return -1.0


@pytest.mark.shared_pair_last(5)
def test_ctrl_c_of_local_up_under_load_loses_no_request_in_flight(local_pair):
    """Changes the shared pair: it stops it, as its last test (on whichever line the switches left)."""
    pair = local_pair
    drain_s = getattr(C.load(pair.cluster_file).supervisor, "drain_s", 60.0)  # the local pair's drain
    run_of(pair, L.HEAD_NAME), run_of(pair, L.WORKER_NAME)  # their groups are swept at teardown
    clients = Clients(pair.api_url, IN_FLIGHT, MAX_TOKENS)
    assert wait_until(lambda: running(pair.api_url) >= IN_FLIGHT, 60, step=0.2), running(pair.api_url)
    t0 = time.monotonic()
    pair.proc.send_signal(signal.SIGINT)  # Ctrl-C: local up stops the head first, which drains
    # A request sent once the stop has begun is turned away at once, not served and not hung.
    assert wait_until(lambda: pair.state(L.HEAD_NAME)["state"] != S.SERVING, 30, step=0.1)
    late = Clients(pair.api_url, 1, MAX_TOKENS, first=100)
    late.join(timeout=30)
    late_took = time.monotonic() - t0
    clients.join(timeout=drain_s + 60)
    pair.proc.wait(timeout=drain_s + 120)
    took = time.monotonic() - t0
    finished = [r for r in clients.results.values() if r[0] == 200 and r[1] == MAX_TOKENS and r[2] == "length"]
    print(f"in flight at the stop: {IN_FLIGHT}; finished with full output: {len(finished)}; "
          f"results {sorted(clients.results.items())}; late request: {late.results} after {late_took:.1f} s; "
          f"local up exited {pair.proc.returncode} after {took:.1f} s")
    assert len(finished) == IN_FLIGHT, clients.results
    assert not late.threads[0].is_alive(), "a request sent during the drain hung"
    status, tokens, reason = late.results[100]
    assert tokens == 0 and (status != 200 or reason == "abort"), late.results  # turned away, nothing generated
    assert pair.proc.returncode == 0, pair.log()
    assert took < drain_s + 60, took
    assert "drain" in (pair.workdir / "logs" / f"{L.HEAD_NAME}.log").read_text(errors="replace")
