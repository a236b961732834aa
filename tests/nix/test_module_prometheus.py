"""services.dspark.prometheus and services.dspark.grafana (modules/monitoring.nix), evaluated with
nixpkgs.lib and the stand-ins (tests/nix/eval_monitoring.nix): the scrape configuration is the one
src/dspark/monitoring.py writes for the same cluster file, and the dashboard provisioned is the
dashboard file; docs/monitoring.md's snippets evaluate."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dspark import monitoring
from dspark.config import validate as dspark_config
from tests.nix.nix_support import NixError, nix_eval, to_nix

pytestmark = pytest.mark.nix

REPO = Path(__file__).resolve().parents[2]


def settings(nodes: list[dict] | None = None) -> dict:
    return {
        "model": {"path": "/var/lib/dspark/models/DeepSeek-V4-Flash"},
        "nodes": nodes or [
            {"name": "spark-a", "rank": 0, "address": "192.168.100.10", "socket_ifname": "enp1s0f0np0"},
            {"name": "spark-b", "rank": 1, "address": "192.168.100.11", "socket_ifname": "enp1s0f0np0"},
        ],
    }


@pytest.fixture
def evaluate(nix_instantiate, nixpkgs_lib):
    """A host's configuration (Nix text, a module) evaluated with the module: what eval_monitoring.nix reports."""
    def run(host_nix: str) -> dict:
        return nix_eval(nix_instantiate,
                        f"import ./tests/nix/eval_monitoring.nix {{ libPath = {nixpkgs_lib}; host = {host_nix}; }}")
    return run


def host(s: dict, node: str | None = "spark-a", raw: str = "", **dspark) -> str:
    """services.dspark with these settings; node None: a monitoring host that is no node (enable off)."""
    opts: dict = {"settings": s, **({"enable": True, "node": node} if node else {})}
    opts.update(dspark)
    return f"{{ services.dspark = {{ {to_nix(opts)[1:-1]} {raw} }}; }}"


def python_jobs(s: dict, **kw) -> list[dict]:
    return monitoring.scrape_configs(dspark_config.from_dict(s, "cluster.toml"), **kw)


def test_off_by_default_and_the_jobs_are_offered_anyway(evaluate):
    out = evaluate(host(settings()))
    assert out["failedAssertions"] == []
    assert out["prometheusScrapeConfigs"] == []
    assert out["grafanaProvision"] == {"enable": False, "providers": []}
    assert out["scrapeConfigs"] == python_jobs(settings())
    assert out["scrapeConfigs"] == [
        {"job_name": "dspark-vllm", "metrics_path": "/metrics", "scrape_interval": "15s",
         "static_configs": [{"targets": ["192.168.100.10:8888"],
                             "labels": {"node": "spark-a", "rank": "0", "role": "head"}}]},
        {"job_name": "dspark-agent", "metrics_path": "/metrics", "scrape_interval": "15s", "honor_labels": True,
         "static_configs": [
             {"targets": ["192.168.100.10:8890"], "labels": {"node": "spark-a", "rank": "0", "role": "head"}},
             {"targets": ["192.168.100.11:8890"], "labels": {"node": "spark-b", "rank": "1", "role": "worker"}}]},
    ]


def test_enabled_the_jobs_reach_services_prometheus(evaluate):
    out = evaluate(host(settings(), prometheus={"enable": True, "scrapeInterval": "5s"}))
    jobs = python_jobs(settings(), scrape_interval="5s")
    assert out["scrapeConfigs"] == jobs
    # Through the option types nixpkgs declares (the stand-ins': no freeform, a misspelt key fails).
    got = [{k: v for k, v in j.items() if v is not None} for j in out["prometheusScrapeConfigs"]]
    assert got == jobs
    assert not [w for w in out["warnings"] if "services.dspark.prometheus" in w]  # no key on the head


@pytest.mark.parametrize("case", ["api_host loopback", "api_host wildcard", "agent_host", "ipv6", "four nodes",
                                  "ports"])
def test_the_module_and_dspark_monitoring_write_the_same_jobs(evaluate, case):
    nodes = settings()["nodes"]
    if case == "api_host loopback":
        nodes[0]["api_host"] = "127.0.0.1"
    elif case == "api_host wildcard":
        nodes[0]["api_host"] = "0.0.0.0"
    elif case == "agent_host":
        nodes[1]["agent_host"] = "10.1.2.3"
    elif case == "ipv6":
        nodes = [{"name": "spark-a", "rank": 0, "address": "fd00::10"},
                 {"name": "spark-b", "rank": 1, "address": "fd00::11"}]
    elif case == "four nodes":
        nodes = [{"name": f"spark-{c}", "rank": r, "address": f"10.0.0.{r + 1}"}
                 for r, c in reversed(list(enumerate("abcd")))]
    elif case == "ports":
        nodes[0].update(api_port=9000, agent_port=9100)
        nodes[1].update(agent_port=9101)
    s = settings(nodes)
    if case == "four nodes":
        s["serving"] = {"tensor_parallel_size": 4}
    out = evaluate(host(s, prometheus={"enable": True}))
    assert out["scrapeConfigs"] == python_jobs(s)
    targets = [t for j in out["scrapeConfigs"] for c in j["static_configs"] for t in c["targets"]]
    expected = {
        "api_host loopback": ["127.0.0.1:8888", "192.168.100.10:8890", "192.168.100.11:8890"],
        "api_host wildcard": ["192.168.100.10:8888", "192.168.100.10:8890", "192.168.100.11:8890"],
        "agent_host": ["192.168.100.10:8888", "192.168.100.10:8890", "10.1.2.3:8890"],
        "ipv6": ["[fd00::10]:8888", "[fd00::10]:8890", "[fd00::11]:8890"],
        "four nodes": ["10.0.0.1:8888", "10.0.0.1:8890", "10.0.0.2:8890", "10.0.0.3:8890", "10.0.0.4:8890"],
        "ports": ["192.168.100.10:9000", "192.168.100.10:9100", "192.168.100.11:9101"],
    }[case]
    assert targets == expected


def test_api_key_file_becomes_the_bearer_token_of_the_vllm_job(evaluate):
    key = "/run/secrets/dspark-prometheus-key"
    out = evaluate(host(settings(), prometheus={"enable": True, "apiKeyFile": key},
                        apiKeyFile="/run/secrets/dspark-api-key"))
    vllm, agent = out["scrapeConfigs"]
    assert vllm["authorization"] == {"type": "Bearer", "credentials_file": key}
    assert "authorization" not in agent  # the agents answer without a key
    assert out["scrapeConfigs"] == python_jobs(settings(), api_key_file=key)
    assert not [w for w in out["warnings"] if "services.dspark.prometheus" in w]


def test_warning_when_the_head_has_a_key_and_prometheus_none(evaluate):
    out = evaluate(host(settings(), prometheus={"enable": True}, apiKeyFile="/run/secrets/dspark-api-key"))
    (msg,) = [w for w in out["warnings"] if "services.dspark.prometheus" in w]
    assert msg == ("services.dspark.prometheus: the head has an API key (services.dspark.apiKeyFile), so vLLM's "
                   "/metrics answers 401 to Prometheus without it; set services.dspark.prometheus.apiKeyFile to a "
                   "copy of the key the prometheus user can read.")


def test_scrape_configs_are_read_only(evaluate):
    with pytest.raises(NixError, match="read-only"):
        evaluate(host(settings(), raw="prometheus.scrapeConfigs = [ ];"))


def test_grafana_provision_adds_the_dashboard_folder(evaluate):
    out = evaluate(host(settings(), grafana={"provision": True}))
    folder = Path(out["dashboards"])
    assert folder == REPO / "src" / "dspark" / "data" / "grafana"
    assert out["grafanaProvision"] == {"enable": True, "providers": [
        {"name": "dspark", "type": "file", "options": {"path": str(folder)}}]}
    assert sorted(p.name for p in folder.iterdir()) == ["dspark.json"]  # a provider loads every file there
    assert (folder / "dspark.json").read_text() == monitoring.dashboard_text()


def test_a_monitoring_host_that_is_no_node(evaluate):
    out = evaluate(host(settings(), node=None, prometheus={"enable": True}, grafana={"provision": True}))
    assert out["failedAssertions"] == [] and out["services"] == [] and out["clusterFile"] is None
    assert out["scrapeConfigs"] == python_jobs(settings())
    assert [j["job_name"] for j in out["prometheusScrapeConfigs"]] == ["dspark-vllm", "dspark-agent"]
    assert out["grafanaProvision"]["enable"] is True


def _doc_snippets() -> list[str]:
    return re.findall(r"```nix\n(.*?)```", (REPO / "docs" / "monitoring.md").read_text(), re.S)


def _with_cluster(snippet: str, node: str | None) -> str:
    """The snippet as one module of a host whose services.dspark carries the cluster's settings."""
    cluster = host(settings(), node=node)
    return f"{{ imports = [ ({snippet.strip()}) {cluster} ]; }}"


def test_the_monitoring_doc_snippets_evaluate(evaluate):
    head, monitor = _doc_snippets()
    out = evaluate(_with_cluster(head, "spark-a"))
    assert out["failedAssertions"] == []
    assert out["enabled"] == {"prometheus": True, "grafana": True}
    assert [j["job_name"] for j in out["prometheusScrapeConfigs"]] == ["dspark-vllm", "dspark-agent"]
    assert out["scrapeConfigs"] == python_jobs(settings())
    assert out["grafanaProvision"]["providers"][0]["options"]["path"] == out["dashboards"]
    assert out["datasources"] == [{"name": "Prometheus", "type": "prometheus", "url": "http://127.0.0.1:9090"}]
    out = evaluate(_with_cluster(monitor, None))
    assert out["services"] == [] and out["enabled"]["prometheus"] is True
    assert [{k: v for k, v in j.items() if v is not None} for j in out["prometheusScrapeConfigs"]] == \
        python_jobs(settings())
