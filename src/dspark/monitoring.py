"""The path into the monitoring people already run: Prometheus' scrape configuration for a cluster
(the head's vLLM /metrics and every node agent's /metrics) and the Grafana dashboard.

The NixOS module builds the same scrape configuration from the same cluster file in Nix
(nix/monitoring.nix, `services.dspark.prometheus.scrapeConfigs`); tests/nix/test_module_prometheus.py
keeps the two equal. The dashboard's JSON (src/dspark/data/grafana/dspark.json, which the module
provisions) is written by `grafana_dashboard()` here, from the metric names vLLM and the agent
serve (dspark.engine.facts, dspark.node.agent); tests/monitoring/test_prometheus_dashboard.py keeps the file equal
to it, and tests/monitoring/test_prometheus_pair.py runs every one of its queries in a real Prometheus
scraping the local pair.

    python -m dspark.monitoring scrape-configs --config CLUSTER.toml [--api-key-file F] [--scrape-interval 15s]
    python -m dspark.monitoring dashboard > dspark.json

print them as JSON (Prometheus reads JSON as YAML: the list goes under `scrape_configs:`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from dspark.config.schema import Cluster, NodeConfig
from dspark.engine import facts as F
from dspark.node.states import FAILED, SERVING, STARTING, STATES, STOPPED, STOPPING

# The two scrape jobs; the dashboard's queries select them by these names.
JOB_VLLM = "dspark-vllm"
JOB_AGENT = "dspark-agent"
SCRAPE_INTERVAL = "15s"  # the module's default (services.dspark.prometheus.scrapeInterval)
DASHBOARD_DIR = Path(__file__).parent / "data" / "grafana"
DASHBOARD_FILE = DASHBOARD_DIR / "dspark.json"
DASHBOARD_UID = "dspark"
_WILDCARD = ("0.0.0.0", "::")


def _target(bind: str | None, address: str, port: int) -> str:
    """host:port a scraper reaches: the bound address, the fabric address for a wildcard bind."""
    host = address if bind in _WILDCARD or not bind else bind
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _labels(n: NodeConfig) -> dict[str, str]:
    return {"node": n.name, "rank": str(n.rank), "role": "head" if n.is_head else "worker"}


def scrape_configs(cluster: Cluster, api_key_file: str | None = None,
                   scrape_interval: str = SCRAPE_INTERVAL) -> list[dict[str, Any]]:
    """Prometheus `scrape_configs` entries for the cluster: the head's vLLM (job dspark-vllm, behind
    the API key when the head has one: `api_key_file` is a file the Prometheus server can read
    holding it) and every node's agent (job dspark-agent). Each target carries node, rank and
    role; the agent's own samples carry the same (honor_labels keeps theirs)."""
    jobs: list[dict[str, Any]] = []
    heads = [n for n in cluster.nodes if n.is_head]
    if heads:
        head = heads[0]
        vllm: dict[str, Any] = {
            "job_name": JOB_VLLM,
            "metrics_path": F.METRICS,
            "scrape_interval": scrape_interval,
            "static_configs": [{"targets": [_target(head.api_host, head.address, head.api_port)],
                                "labels": _labels(head)}],
        }
        if api_key_file is not None:
            vllm["authorization"] = {"type": "Bearer", "credentials_file": api_key_file}
        jobs.append(vllm)
    nodes = sorted(cluster.nodes, key=lambda n: n.rank)
    if nodes:
        jobs.append({
            "job_name": JOB_AGENT,
            "metrics_path": "/metrics",
            "scrape_interval": scrape_interval,
            "honor_labels": True,
            "static_configs": [{"targets": [_target(n.agent_host, n.address, n.agent_port)], "labels": _labels(n)}
                               for n in nodes],
        })
    return jobs


# ------------------------------------------------------------------ the Grafana dashboard
_DS = {"type": "prometheus", "uid": "${datasource}"}
# A node's state as one number for the state timeline (1..8 in dspark.node.states' order).
_STATE_COLOURS = {STARTING: "blue", SERVING: "green", STOPPING: "orange", STOPPED: "text", FAILED: "red"}


def _vllm(metric: str, extra: str = "") -> str:
    return f'{metric}{{job="{JOB_VLLM}"{extra}}}'


def _agent(metric: str, extra: str = "") -> str:
    return f'{metric}{{job="{JOB_AGENT}"{extra}}}'


def _rate(metric: str) -> str:
    return f"rate({_vllm(metric)}[$__rate_interval])"


def state_number_expr() -> str:
    """Each node's state as a number (1 starting .. 8 failed): the sum over the states of
    dspark_node_state x its position."""
    terms = []
    for i, state in enumerate(STATES, 1):
        selector = _agent("dspark_node_state", f', state="{state}"')
        terms.append(f"{i} * sum by (node) ({selector})")
    return " + ".join(terms)


def _target_q(expr: str, legend: str, ref: str) -> dict[str, Any]:
    return {"datasource": _DS, "expr": expr, "legendFormat": legend, "refId": ref}


def _panel(pid: int, kind: str, title: str, grid: tuple[int, int, int, int], targets: list[tuple[str, str]],
           description: str, unit: str = "short", **extra: Any) -> dict[str, Any]:
    x, y, w, h = grid
    panel: dict[str, Any] = {
        "id": pid, "type": kind, "title": title, "description": description, "datasource": _DS,
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "targets": [_target_q(e, legend, chr(ord("A") + i)) for i, (e, legend) in enumerate(targets)],
        "fieldConfig": {"defaults": {"unit": unit, **extra.pop("defaults", {})},
                        "overrides": extra.pop("overrides", [])},
        "options": extra.pop("options", {}),
    }
    panel.update(extra)
    return panel


def _value_map(values: dict[str, tuple[str, str]]) -> list[dict[str, Any]]:
    return [{"type": "value", "options": {k: {"text": text, "color": colour, "index": i}
                                          for i, (k, (text, colour)) in enumerate(values.items())}}]


def _quantile(q: float, metric: str) -> str:
    return f"histogram_quantile({q}, sum by (le) ({_rate(metric + '_bucket')}))"


def _mean(metric: str) -> str:
    return f"sum({_rate(metric + '_sum')}) / sum({_rate(metric + '_count')})"


def grafana_dashboard() -> dict[str, Any]:
    """The dashboard: the figures of `dspark dashboard`, from Prometheus."""
    up_map = _value_map({"1": ("up", "green"), "0": ("down", "red")})
    alive_map = _value_map({"1": ("alive", "green"), "0": ("not alive", "red")})
    state_map = _value_map({str(i): (s, _STATE_COLOURS.get(s, "yellow")) for i, s in enumerate(STATES, 1)})
    stat = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "background", "graphMode": "none", "textMode": "value_and_name", "justifyMode": "auto"}
    series = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
              "tooltip": {"mode": "multi", "sort": "none"}}
    panels = [
        _panel(1, "stat", "Node state", (0, 0, 8, 4), [(state_number_expr(), "{{node}}")],
               "Each node's state from its agent (dspark_node_state).",
               defaults={"mappings": state_map}, options=stat),
        _panel(2, "stat", "Agent up", (8, 0, 4, 4), [(f'up{{job="{JOB_AGENT}"}}', "{{node}}")],
               "Whether Prometheus reaches each node's agent (its supervisor runs).",
               defaults={"mappings": up_map}, options=stat),
        _panel(3, "stat", "vLLM up", (12, 0, 4, 4), [(f'up{{job="{JOB_VLLM}"}}', "{{node}}")],
               "Whether Prometheus reaches the head's vLLM /metrics.",
               defaults={"mappings": up_map}, options=stat),
        _panel(4, "stat", "Restarts", (16, 0, 4, 4), [(_agent("dspark_node_restarts"), "{{node}}")],
               "Times each node's service was restarted (dspark_node_restarts).",
               defaults={"color": {"mode": "thresholds"},
                         "thresholds": {"mode": "absolute", "steps": [{"color": "green", "value": None},
                                                                      {"color": "orange", "value": 1}]}},
               options={**stat, "colorMode": "value"}),
        _panel(5, "stat", "Liveness", (20, 0, 4, 4), [(_agent("dspark_node_liveness_ok"), "{{node}}")],
               "The head's last liveness round (dspark_node_liveness_ok): a /metrics reading while requests "
               "run, a 1-token completion while idle.",
               defaults={"mappings": alive_map}, options=stat),
        _panel(6, "timeseries", "Decode and prefill throughput", (0, 4, 12, 8),
               [(f"sum({_rate(F.GENERATION_TOKENS + '_total')})", "decode tokens/s"),
                (f"sum({_rate(F.PROMPT_TOKENS + '_total')})", "prefill tokens/s")],
               "Generated (decode) and prompt (prefill) tokens per second, from vLLM's counters. The head's "
               "liveness probes count too (about 1 token per liveness_interval_s while idle).",
               defaults={"custom": {"axisLabel": "tokens/s"}},
               overrides=[{"matcher": {"id": "byName", "options": "prefill tokens/s"},
                           "properties": [{"id": "custom.axisPlacement", "value": "right"}]}],
               options=series),
        _panel(7, "timeseries", "Latency", (12, 4, 12, 8),
               [(_quantile(0.5, F.TTFT), "TTFT p50"), (_quantile(0.95, F.TTFT), "TTFT p95"),
                (_quantile(0.5, F.ITL), "inter-token p50"), (_quantile(0.95, F.ITL), "inter-token p95"),
                (_mean(F.E2E), "end-to-end mean"), (_quantile(0.95, F.E2E), "end-to-end p95")],
               "From vLLM's histograms: quantiles are interpolated within buckets (coarse: end-to-end's "
               "first bucket is 0 to 300 ms); the mean is exact (sum over count).",
               unit="s", options=series),
        _panel(8, "timeseries", "Queue", (0, 12, 8, 8),
               [(f"sum({_vllm(F.RUNNING)})", "running"), (f"sum({_vllm(F.WAITING)})", "waiting")],
               "Requests running and waiting in vLLM's scheduler.", options=series),
        _panel(9, "timeseries", "KV-cache use", (8, 12, 8, 8), [(f"max({_vllm(F.KV_USAGE)})", "KV cache")],
               "The share of vLLM's KV-cache blocks in use.", unit="percentunit",
               defaults={"min": 0, "max": 1}, options=series),
        _panel(10, "timeseries", "Finished requests", (16, 12, 8, 8),
               [(f"sum by (finished_reason) ({_rate(F.REQUEST_SUCCESS + '_total')})", "{{finished_reason}}")],
               "Requests finished per second, by vLLM's finished_reason (stop, length, abort, ...).",
               unit="reqps", options=series),
        _panel(11, "state-timeline", "Node states", (0, 20, 12, 8), [(state_number_expr(), "{{node}}")],
               "Each node's state over time (dspark_node_state).",
               defaults={"mappings": state_map, "color": {"mode": "thresholds"}},
               options={"showValue": "auto", "mergeValues": True, "rowHeight": 0.9,
                        "legend": {"displayMode": "list", "placement": "bottom", "showLegend": False}}),
        _panel(12, "timeseries", "Liveness: time since the last proof of life", (12, 20, 12, 8),
               [(f'time() - {_agent("dspark_node_liveness_proof_timestamp_seconds")}', "{{node}} since proof"),
                (_agent("dspark_node_liveness_latency_seconds"), "{{node}} probe latency")],
               "Seconds since the head's last proof of life (progress or probe), and the last 1-token "
               "probe's latency.", unit="s", options=series),
        _panel(13, "timeseries", "Memory per node", (0, 28, 12, 8),
               [(_agent("dspark_node_memory_used_bytes"), "{{node}} used"),
                (_agent("dspark_node_memory_total_bytes"), "{{node}} total")],
               "Each node's memory: on GB10 the unified memory NVML and /proc/meminfo report, elsewhere the "
               "host's (shown where the node's supervisor reports it).", unit="bytes", options=series),
        _panel(14, "timeseries", "Restarts over time", (12, 28, 12, 8),
               [(_agent("dspark_node_restarts"), "{{node}}")],
               "Times each node's service was restarted.", options=series),
    ]
    return {
        "uid": DASHBOARD_UID,
        "title": "dspark",
        "description": "DeepSeek V4 Flash on GB10 nodes: vLLM's figures and every node's state "
                       "(jobs dspark-vllm and dspark-agent of services.dspark.prometheus.scrapeConfigs).",
        "tags": ["dspark", "vllm"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "browser",
        "templating": {"list": [{
            "name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
            "current": {}, "hide": 0, "includeAll": False, "multi": False, "options": [], "refresh": 1, "regex": "",
        }]},
        "annotations": {"list": [{
            "name": "Restarts", "datasource": _DS, "enable": True, "iconColor": "orange",
            "expr": f'changes({_agent("dspark_node_restarts")}[2m]) > 0', "step": "60s",
            "titleFormat": "restart", "textFormat": "{{node}} restarted", "tagKeys": "node",
        }]},
        "panels": panels,
    }


def dashboard_text() -> str:
    """The dashboard file's text (what DASHBOARD_FILE holds)."""
    return json.dumps(grafana_dashboard(), indent=2) + "\n"


def dashboard_queries(dashboard: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of the dashboard, its annotations included."""
    d = grafana_dashboard() if dashboard is None else dashboard
    out = [(p["title"], t["expr"]) for p in d["panels"] for t in p["targets"]]
    out += [(f"annotation {a['name']}", a["expr"]) for a in d["annotations"]["list"] if "expr" in a]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspark.monitoring", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    sc = sub.add_parser("scrape-configs", help="Prometheus scrape_configs for a cluster file, as JSON")
    sc.add_argument("--config", help="the cluster file (default: $DSPARK_CONFIG or /etc/dspark/cluster.toml)")
    sc.add_argument("--api-key-file", help="a file Prometheus can read holding the head's API key")
    sc.add_argument("--scrape-interval", default=SCRAPE_INTERVAL)
    sub.add_parser("dashboard", help="the Grafana dashboard's JSON")
    args = ap.parse_args(argv)
    if args.what == "dashboard":
        sys.stdout.write(dashboard_text())
        return 0
    from dspark.config.schema import ConfigError
    from dspark.config.validate import load

    try:
        cluster = load(args.config)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    json.dump(scrape_configs(cluster, args.api_key_file, args.scrape_interval), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
