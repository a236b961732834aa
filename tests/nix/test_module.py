"""services.dspark under nixpkgs' module system (lib.evalModules) with stand-in NixOS options.

The module is reached through the flake's nixosModules.default, as users import it.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dspark.config import credentials
from dspark.config import validate as dspark_config
from dspark.config.schema import NodeConfig, ServingConfig
from dspark.config.template import dumps
from dspark.units.render import render_units
from tests.nix.nix_support import NixError, to_nix

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
    defaults = {f.name: f.default for f in dataclasses.fields(NodeConfig)}
    for key in ("api_port", "master_port", "agent_port"):
        assert data["nodes"][0][key] == defaults[key], key


def test_user_vllm_command_wins_over_the_runtime(evaluate):
    s = settings(serving={"vllm_command": ["/opt/vllm/bin/vllm"]})
    data = evaluate(host("spark-a", settings=s))["etc"]["dspark/cluster.toml"]["value"]
    assert data["serving"]["vllm_command"] == ["/opt/vllm/bin/vllm"]


def test_firewall_closed_by_default(evaluate):
    assert evaluate(host("spark-a"))["firewall"] == {"allowedTCPPorts": [], "trustedInterfaces": []}


def test_firewall_head_opens_the_api_and_trusts_the_fabric(evaluate):
    out = evaluate(host("spark-a", openFirewall=True, apiKeyFile="/run/secrets/dspark-api-key"))
    assert out["firewall"] == {"allowedTCPPorts": [8888], "trustedInterfaces": ["enp1s0f0np0"]}
    assert out["warnings"] == []


def test_firewall_worker_trusts_the_fabric_but_has_no_api(evaluate):
    out = evaluate(host("spark-b", openFirewall=True))
    assert out["firewall"] == {"allowedTCPPorts": [], "trustedInterfaces": ["enp1s0f0np0"]}
    assert out["warnings"] == []  # no API on a worker: nothing open without a key


# ------------------------------------------------------------------ warnings
def test_warning_fabric_ports_blocked_by_the_firewall_on_the_head(evaluate):
    (msg,) = evaluate(host("spark-a"))["warnings"]  # openFirewall off, the NixOS firewall on (its default)
    assert msg == ('services.dspark: the NixOS firewall is on and services.dspark.openFirewall is off, so node '
                   '"spark-a" (the head) blocks what the other nodes must reach on enp1s0f0np0: the rendezvous '
                   'port 25000, the agent port 8890 and the NCCL/Gloo ports, which NCCL picks at run time; the '
                   'cluster cannot form. Set services.dspark.openFirewall = true, or trust the fabric interface '
                   'yourself (networking.firewall.trustedInterfaces = [ "enp1s0f0np0" ]).')


def test_warning_fabric_ports_blocked_on_a_worker_names_its_own_ports(evaluate):
    s = settings()
    s["nodes"][1].pop("socket_ifname")
    s["nodes"][1]["agent_port"] = 9101
    (msg,) = evaluate(host("spark-b", settings=s))["warnings"]
    assert '"spark-b" (a worker)' in msg and "the agent port 9101 and the NCCL/Gloo ports" in msg
    assert "rendezvous" not in msg  # a worker connects to the head's rendezvous port, it opens none
    assert "on its fabric interface (no socket_ifname)" in msg


@pytest.mark.parametrize("node", ["spark-a", "spark-b"])
def test_no_fabric_warning_when_the_ports_are_open(evaluate, node):
    assert evaluate(host(node, raw="openFirewall = true; apiKeyFile = \"/run/k\";"))["warnings"] == []
    no_firewall = host(node)[:-2] + " networking.firewall.enable = false; }"
    assert evaluate(no_firewall)["warnings"] == []
    trusted = host(node)[:-2] + ' networking.firewall.trustedInterfaces = [ "enp1s0f0np0" ]; }'
    assert evaluate(trusted)["warnings"] == []


def test_warning_open_api_without_a_key(evaluate):
    s = settings()
    s["nodes"][0]["api_port"] = 9000
    (msg,) = evaluate(host("spark-a", settings=s, openFirewall=True))["warnings"]
    assert msg == ("services.dspark.openFirewall opens the head's API port 9000 on every interface, and no API key "
                   "is set (services.dspark.apiKeyFile, or DSPARK_API_KEY in services.dspark.environmentFile): "
                   "anyone who reaches this host can use the model. Set services.dspark.apiKeyFile, or leave "
                   "openFirewall off and open the API port only where the clients are.")
    # A key file, or an environment file that may carry DSPARK_API_KEY: no warning.
    assert evaluate(host("spark-a", openFirewall=True, apiKeyFile="/run/k"))["warnings"] == []
    assert evaluate(host("spark-a", openFirewall=True, environmentFile="/run/dspark.env"))["warnings"] == []


def test_firewall_without_fabric_interface_opens_rendezvous_and_agent_ports(evaluate):
    s = settings()
    s["nodes"] = [{"name": "spark-a", "rank": 0, "address": "10.0.0.1", "api_port": 9000,
                   "master_port": 29500, "agent_port": 9100},
                  {"name": "spark-b", "rank": 1, "address": "10.0.0.2", "agent_port": 9101}]
    head = evaluate(host("spark-a", settings=s, openFirewall=True, apiKeyFile="/run/k"))
    assert sorted(head["firewall"]["allowedTCPPorts"]) == [9000, 9100, 29500]
    (msg,) = head["warnings"]
    assert "no socket_ifname" in msg
    worker = evaluate(host("spark-b", settings=s, openFirewall=True))
    assert worker["firewall"]["allowedTCPPorts"] == [9101]


def test_secrets_reach_the_units_from_outside_the_store(evaluate):
    out = evaluate(host("spark-a", environmentFile="/run/secrets/dspark.env",
                        apiKeyFile="/run/secrets/dspark-api-key", dashboard={"enable": True}))
    for unit in ("dspark-head", "dspark-dashboard"):
        sc = out["services"][unit]["serviceConfig"]
        assert sc["EnvironmentFile"] == "/run/secrets/dspark.env"
        assert sc["LoadCredential"] == "api-key:/run/secrets/dspark-api-key"
        # A missing file is not systemd's 243/CREDENTIALS: this fallback stands in, and `dspark
        # serve` refuses with the file's name (DSPARK_API_KEY_FILE) instead.
        assert sc["SetCredential"] == f"api-key:{credentials.NO_KEY_FILE}"
    assert out["services"]["dspark-head"]["environment"]["DSPARK_API_KEY_FILE"] == "/run/secrets/dspark-api-key"
    assert "api-key" not in str(out["etc"])


def test_the_worker_carries_no_credential_it_never_reads(evaluate):
    """The template gives both hosts the same apiKeyFile; only the head serves the API."""
    out = evaluate(host("spark-b", environmentFile="/run/secrets/dspark.env",
                        apiKeyFile="/run/secrets/dspark-api-key"))
    worker = out["services"]["dspark-worker"]
    assert worker["serviceConfig"] == {"User": "dspark", "Group": "dspark",
                                       "EnvironmentFile": "/run/secrets/dspark.env"}
    assert "DSPARK_API_KEY_FILE" not in worker["environment"]
    assert "Credential" not in str(out["services"])


@pytest.mark.parametrize("option", ["apiKeyFile", "environmentFile"])
@pytest.mark.parametrize("value", ['"secrets/dspark-api-key"', "./dspark-api-key",
                                   '"/nix/store/00000000000000000000000000000000-dspark-key"'])
def test_key_files_must_be_absolute_paths_outside_the_store(evaluate, option, value):
    """A relative path would be read relative to whatever systemd runs in; a path literal would be
    copied into the world-readable store on evaluation; a store path is readable by every user."""
    with pytest.raises(NixError) as err:
        evaluate(host("spark-a", raw=f"{option} = {value};"))
    text = str(err.value)
    assert f"services.dspark.{option}" in text and "absolute path not in the Nix store" in text


def test_dashboard_runs_on_the_head(evaluate):
    out = evaluate(host("spark-a", dashboard={"enable": True}))
    assert out["services"]["dspark-dashboard"]["wantedBy"] == ["multi-user.target"]
    assert out["services"]["dspark-dashboard"]["environment"]["DSPARK_NODE"] == "spark-a"
    # It reads the cluster file too: a change restarts it with the head.
    assert out["services"]["dspark-dashboard"]["restartTriggers"] == ["cluster.toml"]
    off = evaluate(host("spark-a", dashboard={"enable": True}, autoStart=False))
    assert off["services"]["dspark-dashboard"]["wantedBy"] == []  # follows autoStart, as the head does
    assert off["services"]["dspark-head"]["wantedBy"] == []
    worker = evaluate(host("spark-b", dashboard={"enable": True}))
    assert any("dashboard runs on the head" in m for m in worker["failedAssertions"])


# ------------------------------------------------------------------ one role per host
# Every unit file comes from the package (systemd.packages); the ones of the other role are
# masked (enable = false: a link to /dev/null), so `systemctl start dspark-head` on a worker
# says "masked" instead of running a second copy of the worker under the head's name.
HEAD_ONLY = ["dspark-dashboard.service", "dspark-head.service", "dspark-wait-worker.service",
             "dspark-worker-ready.target"]


def test_the_head_masks_the_worker_units(evaluate):
    out = evaluate(host("spark-a"))
    assert out["masked"] == ["dspark-dashboard.service", "dspark-worker.service", "dspark-worker@.service"]
    assert out["targets"] == []  # the head's ready target comes from the package, unmasked
    out = evaluate(host("spark-a", dashboard={"enable": True}))
    assert out["masked"] == ["dspark-worker.service", "dspark-worker@.service"]


def test_a_worker_masks_every_head_unit(evaluate):
    out = evaluate(host("spark-b", dashboard={"enable": False}))
    assert sorted(out["services"]) == ["dspark-worker"]
    assert out["masked"] == sorted(HEAD_ONLY + ["dspark-worker@.service"])


def failed(evaluate, host_nix: str) -> list[str]:
    return evaluate(host_nix)["failedAssertions"]


def test_assertion_unknown_node(evaluate):
    (msg,) = failed(evaluate, host("spark-c"))
    assert 'node = "spark-c" is not a node' in msg and "known: spark-a, spark-b" in msg


def test_assertion_no_nodes(evaluate):
    (msg,) = failed(evaluate, host("spark-a", settings=settings(nodes=[])))
    assert "settings.nodes is empty" in msg


def test_assertion_no_vllm_without_runtime(evaluate):
    (msg,) = failed(evaluate, host("spark-a", runtimePackage=None))
    assert "no vLLM to run" in msg


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
    defaults = {f.name: f.default for f in dataclasses.fields(ServingConfig)}
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "gpus_per_node"):
        assert data["serving"][key] == defaults[key], key






# ------------------------------------------------------------------ the units as a host gets them
def _service_dropin(service: dict) -> str:
    """The [Service] part of what NixOS writes for systemd.services.<name> (overrides.conf)."""
    lines = [f'Environment="{k}={v}"' for k, v in sorted(service["environment"].items())]
    lines += [f"{k}={v}" for k, v in sorted(service["serviceConfig"].items())]
    return "[Service]\n" + "\n".join(lines) + "\n"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
@pytest.mark.parametrize("node, unit", [("spark-a", "dspark-head"), ("spark-b", "dspark-worker")])
def test_the_rendered_units_with_the_module_dropin_read_back_by_systemd(evaluate, tmp_path, node, unit):
    """The package's unit (`dspark systemd render`) plus the module's drop-in for it, read back by
    systemd's own parser: every line is understood (SetCredential= with a value systemd 252
    takes), and only the head's unit loads the key."""
    out = evaluate(host(node, apiKeyFile="/run/secrets/dspark-api-key", environmentFile="/run/secrets/dspark.env"))
    exe = tmp_path / "bin" / "dspark"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    unit_dir = tmp_path / "units"
    unit_dir.mkdir()
    for name, text in render_units(str(exe)).items():
        (unit_dir / name).write_text(text)
    dropin = unit_dir / f"{unit}.service.d" / "overrides.conf"
    dropin.parent.mkdir()
    dropin.write_text(_service_dropin(out["services"][unit]))
    combined = (unit_dir / f"{unit}.service").read_text() + dropin.read_text()
    assert ("LoadCredential=" in combined) == (unit == "dspark-head")
    assert ("SetCredential=api-key:" in combined) == (unit == "dspark-head")
    r = subprocess.run(["systemd-analyze", "verify", str(unit_dir / f"{unit}.service")],
                       capture_output=True, text=True, timeout=60)
    said = [line for line in (r.stdout + r.stderr).splitlines()
            if f"{unit}.service" in line and "plymouth" not in line]
    assert not [s for s in said if "Invalid syntax" in s or "Unknown key" in s or "ignoring" in s], said


# ------------------------------------------------------------------ the cluster file's own rules
# The module restates none of them: /etc/dspark/cluster.toml is built by a step that runs the
# package's `dspark config check` on the generated file (modules/dspark.nix, clusterFile). The
# step is run here as the stand-in keeps it: its script, on the file the module generates
# (written with dspark's TOML writer in place of nixpkgs' formats.toml), with this checkout's
# dspark as the package on PATH, under `set -eu -o pipefail` as stdenv runs a build.


def build_cluster_file(evaluate, host_nix: str, tmp_path) -> subprocess.CompletedProcess:
    out = evaluate(host_nix)
    assert out["failedAssertions"] == [], out["failedAssertions"]  # evaluation lets it through
    step = out["builtBy"]["dspark/cluster.toml"]
    assert step["runCommandName"] == "cluster.toml" and step["nativeBuildInputs"] == ["dspark-0.1.0"]
    generated = tmp_path / "cluster-unchecked.toml"
    generated.write_text(dumps(out["etc"]["dspark/cluster.toml"]["value"]))
    script = step["buildCommand"].replace(step["input"], str(generated))
    assert step["input"] not in script and str(generated) in script
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": "/homeless-shelter",
           "out": str(tmp_path / "out"), "LANG": "C.UTF-8"}
    r = subprocess.run(["bash", "-eu", "-o", "pipefail", "-c", script], capture_output=True, text=True,
                       timeout=120, env=env)
    if r.returncode == 0:
        assert (tmp_path / "out").read_text() == generated.read_text()
    else:
        assert not (tmp_path / "out").exists() and "Traceback" not in r.stderr, r.stderr
    return r


def test_the_cluster_file_is_built_through_dspark_config_check(evaluate, tmp_path):
    r = build_cluster_file(evaluate, host("spark-a"), tmp_path)
    assert r.returncode == 0 and "OK: 2 nodes: spark-a (rank 0, 192.168.100.10)" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("cluster,rank", [("pair", 1), ("ring", 2)])
def test_a_worker_without_an_address_fails_the_build(evaluate, tmp_path, cluster, rank):
    s = settings() if cluster == "pair" else ring()
    del s["nodes"][rank]["address"]
    r = build_cluster_file(evaluate, host("spark-a", settings=s), tmp_path)
    assert r.returncode == 2 and f"nodes[{rank}].address: missing" in r.stderr, r.stderr


@pytest.mark.parametrize("cluster,node,rank,twice", [("pair", 1, 0, "spark-a, spark-b"),
                                                    ("ring", 3, 2, "spark-c, spark-d")])
def test_a_rank_given_twice_fails_the_build(evaluate, tmp_path, cluster, node, rank, twice):
    s = settings() if cluster == "pair" else ring()
    s["nodes"][node]["rank"] = rank
    r = build_cluster_file(evaluate, host("spark-a", settings=s), tmp_path)
    assert r.returncode == 2 and f"rank {rank} is given to more than one node ({twice})" in r.stderr, r.stderr


def test_a_rank_with_no_node_fails_the_build(evaluate, tmp_path):
    s = ring()
    s["nodes"][2]["rank"] = 4  # spark-c: ranks 0, 1, 4, 3
    r = build_cluster_file(evaluate, host("spark-d", settings=s), tmp_path)
    assert r.returncode == 2 and "ranks must be 0..3 (one per node), got [0, 1, 3, 4]" in r.stderr, r.stderr


def test_duplicate_names_fail_the_build(evaluate, tmp_path):
    s = settings()
    s["nodes"][1]["name"] = "spark-a"
    r = build_cluster_file(evaluate, host("spark-a", settings=s), tmp_path)
    assert r.returncode == 2 and "the name 'spark-a' is used by more than one node" in r.stderr, r.stderr


def test_no_model_path_fails_the_build(evaluate, tmp_path):
    r = build_cluster_file(evaluate, host("spark-a", settings=settings(model={})), tmp_path)
    assert r.returncode == 2 and "model.path: missing" in r.stderr, r.stderr


@pytest.mark.parametrize("serving,gone,says", [
    ({}, ("spark-c", "spark-d"), "4 x pipeline_parallel_size 1 must equal nodes (2) x gpus_per_node (1) = 2"),
    ({}, ("spark-d",), "4 x pipeline_parallel_size 1 must equal nodes (3) x gpus_per_node (1) = 3"),
    ({"tensor_parallel_size": 2}, (), "2 x pipeline_parallel_size 1 must equal nodes (4) x gpus_per_node (1) = 4"),
    ({"gpus_per_node": 3}, (), "4 x pipeline_parallel_size 1 must equal nodes (4) x gpus_per_node (3) = 12"),
])
def test_a_parallelism_the_nodes_cannot_give_fails_the_build(evaluate, tmp_path, serving, gone, says):
    s = without(ring(**serving), *gone)
    r = build_cluster_file(evaluate, host("spark-a", settings=s), tmp_path)
    assert r.returncode == 2 and f"serving.tensor_parallel_size: {says}" in r.stderr, r.stderr
