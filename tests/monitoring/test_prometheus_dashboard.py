"""The Grafana dashboard (src/dspark/data/grafana/dspark.json): the file is what dspark.monitoring
writes; its structure is one Grafana loads (unique ids, panels on the 24-column grid without
overlap, every query on the dashboard's Prometheus data source); every metric it names is one that
vLLM (dspark.engine.facts, read from the real build) or a real agent serves; Prometheus' own parser
(promtool) accepts every query. tests/monitoring/test_prometheus_pair.py runs the queries against the real pair."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dspark import monitoring
from dspark.engine import facts as F
from dspark.node.agent import Agent
from dspark.node.states import Liveness, NodeState

PANEL_TYPES = {"stat", "timeseries", "state-timeline"}
# Names that are no metric in a query: PromQL's functions and keywords, and label names.
PROMQL_WORDS = {"sum", "max", "rate", "by", "histogram_quantile", "time", "changes", "le", "node", "on"}


def dashboard() -> dict:
    return json.loads(monitoring.DASHBOARD_FILE.read_text())


def test_the_file_is_what_dspark_monitoring_writes():
    assert monitoring.DASHBOARD_FILE.read_text() == monitoring.dashboard_text(), \
        "regenerate: .venv/bin/python -m dspark.monitoring dashboard > src/dspark/data/grafana/dspark.json"


def test_structure_grafana_loads():
    d = dashboard()
    assert d["uid"] == "dspark" and d["title"] and isinstance(d["schemaVersion"], int)
    (var,) = d["templating"]["list"]
    assert var["type"] == "datasource" and var["query"] == "prometheus" and var["name"] == "datasource"
    source = {"type": "prometheus", "uid": "${datasource}"}
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in d["panels"]:
        assert p["type"] in PANEL_TYPES and p["title"] and p["description"], p["title"]
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
        assert p["datasource"] == source and p["targets"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs))
        assert all(t["datasource"] == source and t["expr"] for t in p["targets"])
    for a in d["annotations"]["list"]:
        assert a["datasource"] == source and a["expr"]


def test_the_panels_the_dashboard_shows():
    titles = [p["title"] for p in dashboard()["panels"]]
    for wanted in ("Decode and prefill throughput", "Latency", "Queue", "KV-cache use", "Node state",
                   "Node states", "Restarts", "Liveness", "Agent up", "vLLM up", "Memory per node"):
        assert wanted in titles
    decode = next(p for p in dashboard()["panels"] if p["title"] == "Decode and prefill throughput")
    assert decode["targets"][0]["expr"] == \
        'sum(rate(vllm:generation_tokens_total{job="dspark-vllm"}[$__rate_interval]))'


def metric_names(expr: str) -> set[str]:
    expr = re.sub(r'\{[^}]*\}', "", expr)  # label matchers
    expr = re.sub(r'\[[^\]]*\]', "", expr)  # ranges
    expr = re.sub(r"\bby \([^)]*\)", "", expr)
    return {w for w in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr) if w not in PROMQL_WORDS}


def agent_metric_names() -> set[str]:
    """What a real agent serves for a head with a liveness round and this host's memory."""
    state = NodeState(node="a", rank=0, role="head", state="serving")
    state.liveness = Liveness(ok=True, at=1.0, latency_s=0.01, proof="probe", proof_at=1.0)
    memory = {"total_bytes": 2, "used_bytes": 1, "available_bytes": 1, "source": "meminfo"}
    agent = Agent("127.0.0.1", 0, lambda: {**state.snapshot(), "memory": memory}).start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{agent.port}/metrics", timeout=10) as r:
            text = r.read().decode()
    finally:
        agent.stop()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def vllm_metric_names() -> set[str]:
    """vLLM's sample names as dspark.engine.facts records them (counters with _total, histograms'
    _bucket, _sum and _count)."""
    counters = {F.GENERATION_TOKENS, F.PROMPT_TOKENS, F.REQUEST_SUCCESS}
    histograms = {F.TTFT, F.ITL, F.E2E}
    gauges = {F.RUNNING, F.WAITING, F.KV_USAGE}
    return ({c + "_total" for c in counters} | gauges
            | {h + suffix for h in histograms for suffix in ("_bucket", "_sum", "_count")})


def test_every_metric_a_query_names_is_served():
    served = agent_metric_names() | vllm_metric_names() | {"up"}
    for title, expr in monitoring.dashboard_queries(dashboard()):
        names = metric_names(expr)
        assert names, (title, expr)
        assert names <= served, f"{title}: {names - served} is served by neither vLLM nor the agent"
        for name in names:
            job = monitoring.JOB_VLLM if name.startswith("vllm:") else monitoring.JOB_AGENT
            if name != "up":
                assert f'{name}{{job="{job}"' in expr, f"{title}: {name} not selected by its job"


def test_promtool_parses_every_query(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian's prometheus: .ci/setup --system)")
    rules = [{"record": f"dspark:query_{i}", "expr": expr.replace("$__rate_interval", "1m")}
             for i, (_, expr) in enumerate(monitoring.dashboard_queries(dashboard()))]
    path = tmp_path / "rules.json"  # YAML's superset: JSON
    path.write_text(json.dumps({"groups": [{"name": "dspark-dashboard", "rules": rules}]}))
    r = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(rules)} rules found" in r.stdout


def test_scrape_configs_pass_promtool(tmp_path):
    """The jobs dspark.monitoring writes are a configuration Prometheus accepts (promtool check config)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian's prometheus: .ci/setup --system)")
    from dspark.config import validate as config

    key = tmp_path / "key"
    key.write_text("k\n")
    cluster = config.from_dict({"model": {"path": "/m"}, "nodes": [
        {"name": "a", "rank": 0, "address": "10.0.0.1"}, {"name": "b", "rank": 1, "address": "fd00::2"}]})
    path = tmp_path / "prometheus.yml"
    path.write_text(json.dumps({"scrape_configs": monitoring.scrape_configs(cluster, api_key_file=str(key))}))
    r = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_python_m_dspark_monitoring_prints_the_jobs_and_the_dashboard(tmp_path):
    """What docs/monitoring.md gives a host without the NixOS module, run as written."""
    import sys

    from dspark.config import validate as config

    cluster_file = tmp_path / "cluster.toml"
    cluster_file.write_text('[model]\npath = "/m"\n\n[[nodes]]\nname = "a"\nrank = 0\naddress = "10.0.0.1"\n'
                            'api_host = "127.0.0.1"\n\n[[nodes]]\nname = "b"\nrank = 1\naddress = "10.0.0.2"\n')
    run = [sys.executable, "-m", "dspark.monitoring"]
    r = subprocess.run([*run, "scrape-configs", "--config", str(cluster_file), "--api-key-file", "/k"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == monitoring.scrape_configs(config.load(cluster_file), api_key_file="/k")
    assert [t for j in json.loads(r.stdout) for c in j["static_configs"] for t in c["targets"]] == \
        ["127.0.0.1:8888", "10.0.0.1:8890", "10.0.0.2:8890"]
    r = subprocess.run([*run, "dashboard"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == monitoring.DASHBOARD_FILE.read_text()
    cluster_file.write_text("[model]\n")
    r = subprocess.run([*run, "scrape-configs", "--config", str(cluster_file)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and r.stdout == "" and "nodes" in r.stderr and "Traceback" not in r.stderr
