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


@pytest.mark.parametrize("cluster,rank", [("pair", 1), ("ring", 2)])
def test_assertion_a_worker_without_an_address(evaluate, cluster, rank):
    s = settings() if cluster == "pair" else ring()
    hosts = [n["name"] for n in s["nodes"]]
    del s["nodes"][rank]["address"]
    for node in hosts:  # every node reads the whole file: refused on each host
        msgs = failed(evaluate, host(node, settings=s))
        assert msgs == [f'services.dspark.settings.nodes: worker "{hosts[rank]}" (rank {rank}) has no address; '
                        "set its fabric address (every node reads the whole file, and the head reaches each "
                        "worker's agent there)."], node


@pytest.mark.parametrize("cluster,node,rank,missing,got,twice", [
    ("pair", 1, 0, 1, "0, 0", "spark-a, spark-b"),         # the worker given the head's rank
    ("ring", 3, 2, 3, "0, 1, 2, 2", "spark-c, spark-d"),   # two workers of the ring with one rank
])
def test_assertion_a_rank_given_twice_leaves_one_without_a_node(evaluate, cluster, node, rank, missing, got, twice):
    s = settings() if cluster == "pair" else ring()
    last = len(s["nodes"]) - 1
    s["nodes"][node]["rank"] = rank
    msgs = failed(evaluate, host(s["nodes"][node]["name"] if cluster == "pair" else "spark-a", settings=s))
    assert sorted(msgs) == sorted([
        f"services.dspark.settings.nodes: rank {missing} has no node; ranks run 0..{last} without a gap "
        f"(rank 0 is the head), one per node; got {got}.",
        f"services.dspark.settings.nodes: rank {rank} is given to more than one node ({twice}); "
        "ranks must be unique."])


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


# ------------------------------------------------------------------ a ring of four nodes
RING = ("spark-a", "spark-b", "spark-c", "spark-d")


def ring(**serving) -> dict:
    """Four GB10 nodes with tensor parallelism 4: one host per node."""
    nodes = [{"name": name, "rank": rank, "address": f"192.168.100.{10 + rank}", "socket_ifname": "enp1s0f0np0"}
             for rank, name in enumerate(RING)]
    return settings(serving={"max_model_len": 262144, "tensor_parallel_size": 4, **serving}, nodes=nodes)


def without(s: dict, *names: str) -> dict:
    s["nodes"] = [n for n in s["nodes"] if n["name"] not in names]
    return s


@pytest.mark.parametrize("node", RING)
def test_a_ring_of_four_evaluates_for_the_head_and_each_worker(evaluate, node):
    out = evaluate(host(node, settings=ring()))
    assert out["failedAssertions"] == []
    env = {"DSPARK_NODE": node, "DSPARK_CONFIG": "/etc/dspark/cluster.toml"}
    if node == "spark-a":
        # The head's wait-worker reads the file that lists every worker, and waits for all of them.
        assert sorted(out["services"]) == ["dspark-head", "dspark-wait-worker"]
        assert out["services"]["dspark-wait-worker"]["environment"] == env
    else:
        assert sorted(out["services"]) == ["dspark-worker"]  # a host is one node: the one-worker unit
    main = out["services"]["dspark-head" if node == "spark-a" else "dspark-worker"]
    assert main["environment"] == env and main["wantedBy"] == ["multi-user.target"]
    data = out["etc"]["dspark/cluster.toml"]["value"]
    cluster = dspark_config.from_dict(data, "cluster.toml")  # dspark's own validator accepts it
    assert [w.name for w in cluster.workers] == ["spark-b", "spark-c", "spark-d"]
    assert (cluster.serving.tensor_parallel_size, cluster.serving.pipeline_parallel_size,
            cluster.serving.gpus_per_node) == (4, 1, 1)


def test_parallelism_defaults_are_those_of_the_cluster_file_schema(evaluate):
    data = evaluate(host("spark-a"))["etc"]["dspark/cluster.toml"]["value"]
    defaults = {f.name: f.default for f in dataclasses.fields(dspark_config.ServingConfig)}
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "gpus_per_node"):
        assert data["serving"][key] == defaults[key], key


def test_assertion_a_rank_with_no_node(evaluate):
    s = ring()
    s["nodes"][2]["rank"] = 4  # spark-c: ranks 0, 1, 4, 3
    for node in ("spark-a", "spark-d"):
        msgs = failed(evaluate, host(node, settings=s))
        assert msgs == ["services.dspark.settings.nodes: rank 2 has no node; ranks run 0..3 without a gap "
                        "(rank 0 is the head), one per node; got 0, 1, 4, 3."], node


def test_assertion_a_ring_with_two_nodes_missing(evaluate):
    s = without(ring(), "spark-c", "spark-d")
    msgs = failed(evaluate, host("spark-a", settings=s))
    assert msgs == ["services.dspark.settings.nodes: 2 nodes missing: tensor_parallel_size 4 x "
                    "pipeline_parallel_size 1 = 4 GPUs need 4 nodes of gpus_per_node = 1, and settings.nodes has 2; "
                    "add the nodes of rank 2, 3 (or lower tensor_parallel_size)."]
    data = evaluate(host("spark-a", settings=s))["etc"]["dspark/cluster.toml"]["value"]
    with pytest.raises(dspark_config.ConfigError, match="tensor_parallel_size"):
        dspark_config.from_dict(data, "cluster.toml")  # what dspark itself would refuse on start


def test_assertion_one_node_missing_is_one_node(evaluate):
    s = without(ring(), "spark-d")
    (msg,) = failed(evaluate, host("spark-b", settings=s))
    assert msg.startswith("services.dspark.settings.nodes: 1 node missing: ") and "add the nodes of rank 3 " in msg


def test_assertion_nodes_too_many(evaluate):
    (msg,) = failed(evaluate, host("spark-d", settings=ring(tensor_parallel_size=2)))
    assert msg.startswith("services.dspark.settings.nodes: 2 nodes too many: tensor_parallel_size 2 x "
                          "pipeline_parallel_size 1 = 2 GPUs need 2 nodes")
    assert "remove the nodes of rank 2, 3" in msg


def test_assertion_parallelism_not_a_whole_number_of_nodes(evaluate):
    (msg,) = failed(evaluate, host("spark-a", settings=ring(gpus_per_node=3)))
    assert "= 4 GPUs, which is not a whole number of nodes of gpus_per_node = 3" in msg




