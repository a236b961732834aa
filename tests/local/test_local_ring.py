"""Against the real four-node local appliance (`dspark local up --nodes 4`: vLLM CPU build, TP=4
over four processes on 127.0.0.1 .. 127.0.0.4): it starts in order, serves, and every client
(status, wait-worker, the dashboard) sees every rank."""

import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from dspark.engine import facts as F
from dspark.local import cluster as L
from tests.harness.pair import get_json, run_dspark

pytestmark = pytest.mark.pair

RANKS = 4


def post(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def test_four_ranks_serve_a_token_id_completion_over_tensor_parallel_4(local_ring):
    out = post(local_ring.api_url + "/v1/completions",
               {"model": L.SERVED_NAME, "prompt": [5, 6, 7, 8], "max_tokens": 6, "return_token_ids": True})
    assert out["usage"]["completion_tokens"] == 6 and len(out["choices"][0]["token_ids"]) == 6
    # vLLM names the parallel layout it runs in its fingerprint: four tensor-parallel ranks.
    assert "tp4" in out["system_fingerprint"], out["system_fingerprint"]


def test_four_ranks_serve_a_chat_plain_and_streamed_with_the_openai_sdk(local_ring):
    import openai

    client = openai.OpenAI(base_url=local_ring.api_url + "/v1", api_key="none", timeout=120, max_retries=0)
    chat = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello!"}]
    reply = client.chat.completions.create(model=L.SERVED_NAME, messages=chat, max_tokens=12)
    assert reply.choices[0].message.role == "assistant" and isinstance(reply.choices[0].message.content, str)
    assert 1 <= reply.usage.completion_tokens <= 12
    # The chat template's prompt: <s><|system|>\n...</s><|user|>\n...</s><|assistant|>\n, tokenized.
    assert reply.usage.prompt_tokens > 8
    chunks = list(client.chat.completions.create(model=L.SERVED_NAME, messages=chat, max_tokens=12, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length"), chunks[-1]
    assert isinstance(text, str) and len(chunks) >= 2


def test_every_worker_was_in_the_rendezvous_before_the_head_started(local_ring):
    log = local_ring.log()
    head_start = log.index("starting the head")
    names = local_ring.names
    assert names == ["local-head", "local-worker", "local-worker-2", "local-worker-3"]
    for w in names[1:]:
        m = re.search(rf"^  {re.escape(w)}\s+rendezvous\s", log, re.M)
        assert m and m.start() < head_start, (w, log)
    head = local_ring.state("local-head")
    for w in names[1:]:
        assert local_ring.state(w)["started_at"] < head["started_at"], w
    # Each rank has its own address: the head's agent lists every worker as its peer.
    assert [local_ring.agent_url(n).split("//")[1].split(":")[0] for n in names] == [
        "127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4"]


def test_status_shows_every_rank_serving(local_ring):
    r = run_dspark("status", "--config", str(local_ring.cluster_file), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    snap = json.loads(r.stdout)
    assert [(n["name"], n["rank"], n["state"]) for n in snap["nodes"]] == [
        (name, rank, "serving") for rank, name in enumerate(local_ring.names)]
    assert snap["serving"] and snap["api"]["version"] == F.VLLM_RELEASE
    assert all(n["vllm_pid"] > 0 for n in snap["nodes"])
    table = run_dspark("status", "--config", str(local_ring.cluster_file)).stdout
    for name in local_ring.names:
        assert re.search(rf"^{re.escape(name)}\s+\d\s+serving\s", table, re.M), table


def test_wait_worker_names_every_worker(local_ring):
    r = run_dspark("wait-worker", "--config", str(local_ring.cluster_file), "--timeout", "10")
    assert r.returncode == 0, r.stdout + r.stderr
    for w in local_ring.names[1:]:
        assert f"{w} serving" in r.stdout, r.stdout


@pytest.fixture(scope="module")
def ring_dashboard(local_ring):
    """`dspark dashboard` on the ring's cluster file; its URL once it shows every rank serving."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen([sys.executable, "-m", "dspark", "dashboard", "--config", str(local_ring.cluster_file),
                          "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def snapshot_nodes(url: str, timeout: float = 60) -> list[dict]:
    nodes: list[dict] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            nodes = get_json(url + "/api/v1/snapshot", timeout=5).get("nodes") or []
        except OSError:
            nodes = []
        if len(nodes) == RANKS and all(n.get("state") == "serving" for n in nodes):
            break
        time.sleep(1)
    return nodes


def test_the_dashboard_shows_every_rank(local_ring, ring_dashboard):
    nodes = snapshot_nodes(ring_dashboard)
    assert [(n["name"], n["rank"], n["state"]) for n in nodes] == [
        (name, rank, "serving") for rank, name in enumerate(local_ring.names)], nodes


@pytest.mark.browser
def test_the_dashboard_page_lays_every_rank_out_in_one_row_above_the_rest(local_ring, ring_dashboard, browser):
    from tests.harness.browser import wait_for

    snapshot_nodes(ring_dashboard)
    browser.get(ring_dashboard + "/")
    page = wait_for(browser, lambda p: len(p["nodes"]) == RANKS and all(
        n.get("state") == "serving" for n in p["nodes"].values()), timeout=30)
    assert list(page["nodes"]) == local_ring.names
    boxes = browser.execute_script(
        "return Array.from(document.querySelectorAll('.node')).map(e => e.getBoundingClientRect().toJSON())")
    chart = browser.execute_script("return document.getElementById('chart').getBoundingClientRect().toJSON()")
    # Four cards side by side (one row, the page's width shared), all above the throughput chart:
    # a ring's state is seen at a glance, without scrolling past the figures.
    assert len({round(b["top"]) for b in boxes}) == 1, boxes
    assert all(b["bottom"] <= chart["top"] for b in boxes), (boxes, chart)
    assert boxes[-1]["right"] <= browser.execute_script("return document.documentElement.clientWidth"), boxes
