"""services.dspark on runtime lines: `services.dspark.lines` (line id -> runtime, by default
every line of the flake) and `settings.serving.runtime_line`, the switch on NixOS.

The module writes every line's command into the cluster file (`serving.line_commands`) and the
chosen line's as `serving.vllm_command`, so switching the option changes the file, hence the units'
restart trigger: a new generation per switch, the previous one the rollback. Evaluated with
lib.evalModules on nixpkgs.lib and the stand-ins (tests/nix/eval.nix: one fake runtime per line,
dspark-runtime-<its vLLM release>); the file each host gets is checked by the real `dspark config
check` and rendered by the real `dspark render`.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dspark.config import validate as dspark_config
from dspark.config.schema import ServingConfig
from dspark.config.template import dumps
from dspark.lines import runtime as runtime_lines
from tests.nix.nix_support import REPO, nix_eval
from tests.nix.test_module import host, settings

pytestmark = pytest.mark.nix

LINES = runtime_lines.load()
LOCKED = sorted(i for i, line in LINES.lines.items() if line.lock_state == "locked")


def vllm_of(line_id: str) -> str:
    """The fake runtime eval.nix gives a line: dspark-runtime-<its vLLM release>."""
    return f"/nix/store/00000000000000000000000000000000-dspark-runtime-{LINES.get(line_id).vllm}/bin/vllm"


def lines_nix(**versions: str) -> str:
    """`lines = { ... };` as a host sets it: line id -> a fake runtime of that vLLM release."""
    entries = " ".join(f'"{i}" = {{ type = "derivation"; name = "dspark-runtime-{v}"; '
                       f'outPath = "/nix/store/00000000000000000000000000000000-dspark-runtime-{v}"; }};'
                       for i, v in versions.items())
    return f"lines = {{ {entries} }};"


def on_line(line_id: str | None, **serving) -> dict:
    s = settings()
    if line_id is not None:
        serving["runtime_line"] = line_id
    s["serving"].update(serving)
    return s


def cluster_file(out: dict) -> dict:
    return out["etc"]["dspark/cluster.toml"]["value"]


def dspark(*args: str) -> subprocess.CompletedProcess:
    """The real dspark CLI of this checkout."""
    return subprocess.run([sys.executable, "-m", "dspark", *args], capture_output=True, text=True, timeout=120,
                          cwd=REPO)


def config_check(tmp_path: Path, data: dict) -> subprocess.CompletedProcess:
    path = tmp_path / "cluster.toml"
    path.write_text(dumps(data))
    return dspark("config", "check", "--config", str(path))


@pytest.mark.parametrize("node", ["spark-a", "spark-b"])
def test_the_cluster_file_has_every_lines_command_and_runs_the_default_line(evaluate, tmp_path, node):
    out = evaluate(host(node))
    assert out["failedAssertions"] == []
    data = cluster_file(out)
    assert data["serving"]["runtime_line"] == LINES.default == "v0.28.0"
    assert data["serving"]["line_commands"] == {i: [vllm_of(i)] for i in LOCKED}
    assert set(data["serving"]["line_commands"]) >= {"v0.28.0", "v0.32.0"}
    assert data["serving"]["vllm_command"] == [vllm_of("v0.28.0")]
    assert out["runtimePackage"] == "dspark-runtime-0.28.0"
    r = config_check(tmp_path, data)
    assert r.returncode == 0 and ": OK: 2 nodes: spark-a (rank 0, 192.168.100.10), spark-b" in r.stdout, r.stderr
    # What the node runs on each line: dspark's own reading of the file.
    cluster = dspark_config.from_dict(data, "cluster.toml")
    for line_id in LOCKED:
        assert cluster.on_line(line_id).serving.vllm_command == [vllm_of(line_id)]


def test_switching_the_option_changes_the_command_and_restarts_both_units(evaluate, tmp_path):
    """runtime_line = "v0.32.0" on both hosts: the same file on each, whose vllm_command is the
    0.32.0 runtime; the file changes, so does each unit's restart trigger (nixos-rebuild switch
    restarts the unit); back to v0.28.0 (the previous generation) gives the first file again."""
    before = {n: evaluate(host(n)) for n in ("spark-a", "spark-b")}
    after = {n: evaluate(host(n, settings=on_line("v0.32.0"))) for n in ("spark-a", "spark-b")}
    back = {n: evaluate(host(n, settings=on_line("v0.28.0"))) for n in ("spark-a", "spark-b")}
    assert cluster_file(after["spark-a"]) == cluster_file(after["spark-b"])
    data = cluster_file(after["spark-a"])
    assert data["serving"]["runtime_line"] == "v0.32.0"
    assert data["serving"]["vllm_command"] == [vllm_of("v0.32.0")]
    assert data["serving"]["line_commands"] == cluster_file(before["spark-a"])["serving"]["line_commands"]
    assert after["spark-a"]["runtimePackage"] == "dspark-runtime-0.32.0"
    for node, unit in (("spark-a", "dspark-head"), ("spark-b", "dspark-worker")):
        assert after[node]["failedAssertions"] == []
        old, new = before[node]["restartTriggerValues"][unit], after[node]["restartTriggerValues"][unit]
        assert old != new and new == [data]
        assert back[node]["restartTriggerValues"][unit] == old
        assert cluster_file(back[node]) == cluster_file(before[node])
    # The head's wait-worker reads the file but runs no vLLM: nothing to restart there.
    assert after["spark-a"]["restartTriggerValues"]["dspark-wait-worker"] == []
    r = config_check(tmp_path, data)
    assert r.returncode == 0, r.stdout + r.stderr
    # dspark render: the node's vLLM command line is the 0.32.0 runtime's.
    r = dspark("render", "--config", str(tmp_path / "cluster.toml"), "--node", "spark-a", "--json")
    assert r.returncode == 0, r.stderr
    argv = json.loads(r.stdout)["argv"]
    assert argv[0] == vllm_of("v0.32.0") and argv[1] == "serve"


def test_an_unknown_line_is_refused_naming_the_known_ones(evaluate):
    msgs = evaluate(host("spark-a", settings=on_line("v0.30.0")))["failedAssertions"]
    assert msgs == ['services.dspark.settings.serving.runtime_line = "v0.30.0" is not one of services.dspark.lines '
                    f"(known: {', '.join(LOCKED)}); set it to one of them, or add that line's runtime to "
                    "services.dspark.lines."]


def test_a_line_the_host_does_not_install_is_refused(evaluate):
    only = lines_nix(**{"v0.32.0": "0.32.0"})
    (msg,) = evaluate(host("spark-b", raw=only))["failedAssertions"]  # runtime_line left at v0.28.0
    assert msg.startswith('services.dspark.settings.serving.runtime_line = "v0.28.0" is not one of '
                          "services.dspark.lines (known: v0.32.0)")
    out = evaluate(host("spark-b", settings=on_line("v0.32.0"), raw=only))
    assert out["failedAssertions"] == []
    assert cluster_file(out)["serving"]["line_commands"] == {"v0.32.0": [vllm_of("v0.32.0")]}


def test_a_line_dspark_does_not_know_is_refused(evaluate, tmp_path):
    extra = lines_nix(**{i: LINES.get(i).vllm for i in LOCKED}, **{"v9.9.9": "9.9.9"})
    out = evaluate(host("spark-a", raw=extra))
    (msg,) = out["failedAssertions"]
    assert msg == ('services.dspark.lines."v9.9.9": not a runtime line dspark knows (known: '
                   f"{', '.join(sorted(LINES.lines))}; src/dspark/data/runtime_lines.toml).")
    r = config_check(tmp_path, cluster_file(out))  # what dspark itself would say at start
    assert r.returncode == 2 and "serving.line_commands" in r.stderr and "v9.9.9" in r.stderr


def test_a_hosts_own_vllm_command_is_its_lines_command(evaluate, tmp_path):
    """A host that sets vllm_command runs it on the chosen line: the file's own line's entry is the
    same command (dspark refuses a file where they differ)."""
    out = evaluate(host("spark-a", settings=on_line("v0.32.0", vllm_command=["/opt/vllm-0.32/bin/vllm"])))
    data = cluster_file(out)
    assert out["failedAssertions"] == []
    assert data["serving"]["line_commands"] == {"v0.28.0": [vllm_of("v0.28.0")], "v0.32.0": ["/opt/vllm-0.32/bin/vllm"]}
    assert config_check(tmp_path, data).returncode == 0


def test_no_lines_and_no_runtime_is_one_clear_message(evaluate):
    (msg,) = evaluate(host("spark-a", raw="lines = { }; runtimePackage = null;"))["failedAssertions"]
    assert "no vLLM to run" in msg and "services.dspark.lines" in msg


def test_the_modules_default_line_is_dsparks(nix_instantiate, nixpkgs_lib):
    out = nix_eval(nix_instantiate, f"""
      let
        lib = import {nixpkgs_lib};
        evaluated = lib.evalModules {{ modules = [
          (import ./tests/nix/stand-ins.nix {{ inherit lib; }}) ./modules/dspark.nix
          {{ services.dspark.package = {{ type = "derivation"; name = "d"; outPath = "/d"; }};
             services.dspark.settings = {{ }}; }}
        ]; }};
      in evaluated.config.services.dspark.settings.serving.runtime_line""")
    assert out == LINES.default
    defaults = {f.name: f.default for f in dataclasses.fields(ServingConfig)}
    assert defaults["runtime_line"] == out


def test_the_module_builds_every_line_with_the_hosts_pkgs(nix_instantiate, stub, nixpkgs_lib):
    """nixosModules.default builds one runtime per line of the flake with the host's own pkgs (its
    nixpkgs.config applies, as for runtimePackage), each from its own lock."""
    out = nix_eval(nix_instantiate, f"""
      let
        lib = import {nixpkgs_lib};
        hostPkgs = import {stub} {{ config = {{ allowUnfree = true; marker = "host"; }}; }};
        stand = import ./tests/nix/stand-ins.nix {{ inherit lib; }};
        evaluated = lib.evalModules {{
          modules = [
            stand
            {{ _module.args.pkgs = lib.mkForce (hostPkgs // {{ inherit (stand.config._module.args.pkgs) formats; }}); }}
            (import ./modules/default.nix)
            {{ services.dspark.enable = true; services.dspark.node = "spark-a";
               services.dspark.settings.model.path = "/m";
               services.dspark.settings.serving.runtime_line = "v0.32.0";
               services.dspark.settings.nodes = [ {{ name = "spark-a"; rank = 0; address = "10.0.0.1"; }} ]; }}
          ];
        }};
        cfg = evaluated.config.services.dspark;
      in {{
        lines = lib.mapAttrs (_: r: {{ inherit (r) name builtWith; lock = r.passthru.runtimeLine.id; }}) cfg.lines;
        runtime = cfg.runtimePackage.name;
        vllm = cfg.settings.serving.vllm_command;
      }}""")
    assert out["lines"] == {i: {"name": f"dspark-runtime-{LINES.get(i).vllm}", "builtWith": "host", "lock": i}
                            for i in LOCKED}
    assert out["runtime"] == "dspark-runtime-0.32.0"
    assert out["vllm"] == ["/nix/store/00000000000000000000000000000000-dspark-runtime-0.32.0/bin/vllm"]
