"""services.dspark under nixpkgs' module system (lib.evalModules) with stand-in NixOS options.

The module is reached through the flake's nixosModules.default, as users import it.
"""

from __future__ import annotations

import dataclasses

import pytest

from dspark import config as dspark_config
from nix_support import NixError, nix_eval, to_nix

pytestmark = pytest.mark.nix

RUNTIME_VLLM = "/nix/store/00000000000000000000000000000000-dspark-runtime-0.28.0/bin/vllm"


def settings(**overrides) -> dict:
    s = {
        "model": {"path": "/var/lib/dspark/models/DeepSeek-V4-Flash"},
        "serving": {"max_model_len": 262144},
        "nodes": [
            {"name": "spark-a", "rank": 0, "address": "192.168.100.10", "socket_ifname": "enp1s0f0np0",
             "rdma_device": "rocep1s0f0", "gid_index": "auto"},
            {"name": "spark-b", "rank": 1, "address": "192.168.100.11", "socket_ifname": "enp1s0f0np0",
             "rdma_device": "rocep1s0f0", "gid_index": "auto"},
        ],
    }
    s.update(overrides)
    return s


def host(node: str = "spark-a", raw: str = "", **dspark) -> str:
    """A host configuration as Nix text; `raw` is spliced into services.dspark as written."""
    opts = {"enable": True, "node": node, "settings": settings()}
    opts.update(dspark)
    body = to_nix(opts)[1:-1]
    return f"{{ services.dspark = {{ {body} {raw} }}; }}"


@pytest.fixture
def evaluate(nix_instantiate, nixpkgs_lib):
    def run(host_nix: str) -> dict:
        return nix_eval(nix_instantiate, f"import ./tests/nix/eval.nix {{ libPath = {nixpkgs_lib}; host = {host_nix}; }}")
    return run


def test_head_gets_the_head_unit_and_the_worker_ready_chain(evaluate):
    out = evaluate(host("spark-a"))
    assert out["failedAssertions"] == []
    assert sorted(out["services"]) == ["dspark-head", "dspark-wait-worker"]
    head = out["services"]["dspark-head"]
    env = {"DSPARK_NODE": "spark-a", "DSPARK_CONFIG": "/etc/dspark/cluster.toml"}
    assert head["environment"] == env
    assert head["wantedBy"] == ["multi-user.target"]
    assert head["restartTriggers"] == ["cluster.toml"]
    assert head["serviceConfig"] == {"User": "dspark", "Group": "dspark"}
    # The oneshot behind dspark-worker-ready.target reads the same file, and is not started on its own.
    assert out["services"]["dspark-wait-worker"]["environment"] == env
    assert out["services"]["dspark-wait-worker"]["wantedBy"] == []
    assert out["packages"] == ["dspark-0.1.0"]
    assert out["users"]["users"]["dspark"]["isSystemUser"] is True
    assert "dspark" in out["users"]["groups"]


def test_worker_gets_only_the_worker_unit(evaluate):
    out = evaluate(host("spark-b"))
    assert out["failedAssertions"] == []
    assert sorted(out["services"]) == ["dspark-worker"]
    assert out["services"]["dspark-worker"]["environment"]["DSPARK_NODE"] == "spark-b"
    assert out["services"]["dspark-worker"]["wantedBy"] == ["multi-user.target"]


def test_node_defaults_to_the_host_name(evaluate):
    opts = to_nix({"enable": True, "settings": settings()})[1:-1]
    out = evaluate(f'{{ networking.hostName = "spark-b"; services.dspark = {{ {opts} }}; }}')
    assert sorted(out["services"]) == ["dspark-worker"]


def test_auto_start_off_leaves_the_unit_to_systemctl_start(evaluate):
    out = evaluate(host("spark-b", autoStart=False))
    assert out["services"]["dspark-worker"]["wantedBy"] == []


def test_cluster_file_is_the_same_valid_cluster_file_on_both_hosts(evaluate):
    head = evaluate(host("spark-a"))["etc"]["dspark/cluster.toml"]
    worker = evaluate(host("spark-b"))["etc"]["dspark/cluster.toml"]
    assert head == worker
    data = head["value"]
    assert data["serving"]["vllm_command"] == [RUNTIME_VLLM]
    assert data["serving"]["max_model_len"] == 262144  # freeform settings pass through
    assert data["nodes"][1]["gid_index"] == "auto"
    # dspark's own validator accepts what the module writes.
    cluster = dspark_config.from_dict(data, "cluster.toml")
    assert [n.name for n in cluster.nodes] == ["spark-a", "spark-b"]
    assert cluster.serving.vllm_command == [RUNTIME_VLLM]


def test_unset_optional_fields_are_left_out_of_the_file(evaluate):
    s = settings()
    s["nodes"] = [{"name": "spark-a", "rank": 0, "address": "10.0.0.1"},
                  {"name": "spark-b", "rank": 1, "address": "10.0.0.2"}]
    data = evaluate(host("spark-a", settings=s))["etc"]["dspark/cluster.toml"]["value"]
    assert "socket_ifname" not in data["nodes"][0]
    dspark_config.from_dict(data, "cluster.toml")


def test_port_defaults_are_those_of_the_cluster_file_schema(evaluate):
    data = evaluate(host("spark-a"))["etc"]["dspark/cluster.toml"]["value"]
    defaults = {f.name: f.default for f in dataclasses.fields(dspark_config.NodeConfig)}
    for key in ("api_port", "master_port", "agent_port"):
        assert data["nodes"][0][key] == defaults[key], key


def test_user_vllm_command_wins_over_the_runtime(evaluate):
    s = settings(serving={"vllm_command": ["/opt/vllm/bin/vllm"]})
    data = evaluate(host("spark-a", settings=s))["etc"]["dspark/cluster.toml"]["value"]
    assert data["serving"]["vllm_command"] == ["/opt/vllm/bin/vllm"]


def test_firewall_closed_by_default(evaluate):
    assert evaluate(host("spark-a"))["firewall"] == {"allowedTCPPorts": [], "trustedInterfaces": []}


def test_firewall_head_opens_the_api_and_trusts_the_fabric(evaluate):
    out = evaluate(host("spark-a", openFirewall=True))
    assert out["firewall"] == {"allowedTCPPorts": [8888], "trustedInterfaces": ["enp1s0f0np0"]}
    assert out["warnings"] == []


def test_firewall_worker_trusts_the_fabric_but_has_no_api(evaluate):
    out = evaluate(host("spark-b", openFirewall=True))
    assert out["firewall"] == {"allowedTCPPorts": [], "trustedInterfaces": ["enp1s0f0np0"]}


def test_firewall_without_fabric_interface_opens_rendezvous_and_agent_ports(evaluate):
    s = settings()
    s["nodes"] = [{"name": "spark-a", "rank": 0, "address": "10.0.0.1", "api_port": 9000,
                   "master_port": 29500, "agent_port": 9100},
                  {"name": "spark-b", "rank": 1, "address": "10.0.0.2", "agent_port": 9101}]
    head = evaluate(host("spark-a", settings=s, openFirewall=True))
    assert sorted(head["firewall"]["allowedTCPPorts"]) == [9000, 9100, 29500]
    assert "no socket_ifname" in head["warnings"][0]
    worker = evaluate(host("spark-b", settings=s, openFirewall=True))
    assert worker["firewall"]["allowedTCPPorts"] == [9101]


def test_secrets_reach_the_units_from_outside_the_store(evaluate):
    out = evaluate(host("spark-a", environmentFile="/run/secrets/dspark.env",
                        apiKeyFile="/run/secrets/dspark-api-key"))
    sc = out["services"]["dspark-head"]["serviceConfig"]
    assert sc["EnvironmentFile"] == "/run/secrets/dspark.env"
    assert sc["LoadCredential"] == "api-key:/run/secrets/dspark-api-key"
    assert "api-key" not in str(out["etc"])


def test_dashboard_runs_on_the_head(evaluate):
    out = evaluate(host("spark-a", dashboard={"enable": True}))
    assert out["services"]["dspark-dashboard"]["wantedBy"] == ["multi-user.target"]
    assert out["services"]["dspark-dashboard"]["environment"]["DSPARK_NODE"] == "spark-a"
    worker = evaluate(host("spark-b", dashboard={"enable": True}))
    assert any("dashboard runs on the head" in m for m in worker["failedAssertions"])


def failed(evaluate, host_nix: str) -> list[str]:
    return evaluate(host_nix)["failedAssertions"]


def test_assertion_unknown_node(evaluate):
    (msg,) = failed(evaluate, host("spark-c"))
    assert 'node = "spark-c" is not a node' in msg and "known: spark-a, spark-b" in msg


def test_assertion_head_without_the_workers_address(evaluate):
    s = settings()
    del s["nodes"][1]["address"]
    msgs = failed(evaluate, host("spark-a", settings=s))
    assert msgs == ['services.dspark: this host is the head, but node "spark-b" has no address; '
                    "the head needs every worker's fabric address."]


def test_assertion_ranks(evaluate):
    s = settings()
    s["nodes"][1]["rank"] = 0
    (msg,) = failed(evaluate, host("spark-b", settings=s))
    assert "ranks must be 0..1" in msg and "got 0, 0" in msg


def test_assertion_duplicate_names(evaluate):
    s = settings()
    s["nodes"][1]["name"] = "spark-a"
    assert any("spark-a are used more than once" in m for m in failed(evaluate, host("spark-a", settings=s)))


def test_assertion_no_model_path(evaluate):
    (msg,) = failed(evaluate, host("spark-a", settings=settings(model={})))
    assert "settings.model.path is not set" in msg


def test_assertion_no_nodes(evaluate):
    (msg,) = failed(evaluate, host("spark-a", settings=settings(nodes=[])))
    assert "settings.nodes is empty" in msg


def test_assertion_no_vllm_without_runtime(evaluate):
    (msg,) = failed(evaluate, host("spark-a", runtimePackage=None))
    assert "no vLLM to run" in msg


def test_assertion_secrets_in_the_store(evaluate):
    msgs = failed(evaluate, host("spark-a", apiKeyFile="/nix/store/0000-key", environmentFile="/nix/store/0000-env"))
    assert len(msgs) == 2 and all("is in the Nix store" in m for m in msgs)


@pytest.mark.parametrize("raw, where", [
    ('settings.nodes = [ { name = "spark-a"; rank = "zero"; address = "10.0.0.1"; } ];', "rank"),
    ('settings.nodes = [ { name = "spark-a"; rank = 0; address = "10.0.0.1"; api_port = 70000; } ];', "api_port"),
    ('settings.nodes = [ { rank = 0; address = "10.0.0.1"; } ];', "name"),
    ("openFirewall = \"yes\";", "openFirewall"),
    ("node = 1;", "node"),
])
def test_type_errors(evaluate, raw, where):
    base = 'enable = true; settings.model.path = "/m";' + ("" if raw.startswith("node") else ' node = "spark-a";')
    with pytest.raises(NixError) as err:
        evaluate(f"{{ services.dspark = {{ {base} {raw} }}; }}")
    text = str(err.value)
    assert f"services.dspark.{where}" in text or f".{where}'" in text
    # Wording of nixpkgs.lib: a wrong type, or a required field left out (older and newer lib).
    assert any(s in text for s in ("is not of type", "used but not defined", "has no value defined"))
