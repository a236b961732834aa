"""The NixOS how-to's Nix snippets (docs/nixos.md, and the one in docs/nixos-internals.md),
evaluated as a user would put them together: every ```nix block names its file on its first line
(`# dspark-cluster.nix: ...`); the test writes them into a directory laid out as the how-to says,
evaluates the hosts' flake.nix with this repository's flake as its `dspark` input, and checks
what each host gets (units, the API key's credential, the firewall, the cluster file, built
through `dspark config check` as the module's build step does).

What stands in for what cannot be had here (no nixpkgs, no network):
- `nixpkgs.lib.nixosSystem` is `lib.evalModules` over tests/nix/stand-ins.nix (the NixOS options
  the module sets) and DOC_OPTIONS (those the snippets set: `nixpkgs.config`, `nix.settings`,
  `networking.firewall.interfaces`), with store-path-shaped packages, as tests/nix/eval.nix does;
- agenix and sops-nix are not available offline: AGENIX and SOPS below are stand-in modules that
  declare only the options the snippets set and read, with the defaults those projects declare
  (agenix `modules/age.nix`: `age.secrets.<name>.path` = `/run/agenix/<name>`, mode 0400, owner
  root; sops-nix `modules/sops/default.nix`: `sops.secrets.<name>.path` = `/run/secrets/<name>`,
  mode 0400, owner root). Nothing is decrypted; their real modules never ran here.
"""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dspark.config.template import dumps
from dspark.plan import published
from tests.nix.nix_support import REPO, nix_eval

pytestmark = pytest.mark.nix

HOWTO = REPO / "docs" / "nixos.md"
INTERNALS = REPO / "docs" / "nixos-internals.md"

DOC_OPTIONS = """{ lib, ... }:
let inherit (lib) mkOption types; in
{
  options.nixpkgs.config = mkOption { type = types.attrs; default = { }; };
  options.nix.settings = mkOption { type = types.attrsOf types.anything; default = { }; };
  options.networking.firewall.interfaces = mkOption {
    type = types.attrsOf (types.submodule {
      options.allowedTCPPorts = mkOption { type = types.listOf types.port; default = [ ]; };
    });
    default = { };
  };
}"""

AGENIX = """{ lib, ... }:
let inherit (lib) mkOption types; in
{
  options.age.secrets = mkOption {
    type = types.attrsOf (types.submodule ({ name, ... }: {
      options.file = mkOption { type = types.path; };
      options.path = mkOption { type = types.str; default = "/run/agenix/${name}"; };
      options.mode = mkOption { type = types.str; default = "0400"; };
      options.owner = mkOption { type = types.str; default = "0"; };
    }));
    default = { };
  };
}"""

SOPS = """{ lib, ... }:
let inherit (lib) mkOption types; in
{
  options.sops.secrets = mkOption {
    type = types.attrsOf (types.submodule ({ name, ... }: {
      options.sopsFile = mkOption { type = types.either types.str types.path; };
      options.path = mkOption { type = types.str; default = "/run/secrets/${name}"; };
      options.mode = mkOption { type = types.str; default = "0400"; };
      options.owner = mkOption { type = types.str; default = "root"; };
    }));
    default = { };
  };
}"""

KEY = "api-key:/run/agenix/dspark-api-key"


def snippets(doc: Path) -> dict[str, str]:
    """Every ```nix block of a page, by the file name its first line gives."""
    out = {}
    for block in re.findall(r"```nix\n(.*?)```", doc.read_text(), re.S):
        m = re.match(r"# ([\w./-]+\.nix)(?=[:,\s])", block)
        assert m, f"{doc.name}: a Nix snippet that does not name its file on its first line:\n{block}"
        assert m.group(1) not in out, f"{doc.name}: two snippets named {m.group(1)}"
        out[m.group(1)] = block
    return out


def sh_commands(doc: Path) -> list[str]:
    return [line for block in re.findall(r"```sh\n(.*?)```", doc.read_text(), re.S) for line in block.splitlines()]


def test_every_nix_snippet_of_the_nixos_pages_is_evaluated_here():
    """A new snippet must be added to the evaluations below (their file names), or it goes
    unevaluated unnoticed."""
    assert set(snippets(HOWTO)) == {"secrets/secrets.nix", "spark-a/dspark-key.nix", "spark-a/dspark-key-sops.nix",
                                    "dspark-cluster.nix", "api-on-lan.nix", "flake.nix", "caches.nix"}
    assert set(snippets(INTERNALS)) == {"dspark-cluster.nix"}
    assert not re.search(r"```nix", (REPO / "docs" / "nixos-verification.md").read_text())


@pytest.fixture(scope="module")
def hosts_dir(tmp_path_factory) -> Path:
    """The how-to's files, laid out as it says, with the host's own configuration.nix and the
    encrypted files stood in for."""
    d = tmp_path_factory.mktemp("hosts")
    for name, text in snippets(HOWTO).items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)
    for own in ("spark-a/configuration.nix", "spark-b/configuration.nix"):
        (d / own).parent.mkdir(parents=True, exist_ok=True)
        (d / own).write_text("{ }\n")  # hardware, kernel, driver: the host's own
    (d / "secrets" / "dspark-api-key.age").write_text("stand-in: age-encrypted in real life\n")
    (d / "secrets" / "dspark.yaml").write_text("stand-in: sops-encrypted in real life\n")
    return d


def flake_eval(nixpkgs_lib: Path, flake_dir: Path, flake_file: str, expr: str) -> str:
    """A Nix expression binding `hosts` to the hosts' flake outputs (flake_file in flake_dir) with
    the stand-ins as its inputs, then `expr`."""
    return f"""
      let
        lib = import {nixpkgs_lib};
        fake = name: {{ type = "derivation"; inherit name;
                        outPath = "/nix/store/00000000000000000000000000000000-${{name}}"; }};
        dspark = (import {REPO}/flake.nix).outputs {{
          self = dspark;
          nixpkgs = {{ inherit lib; legacyPackages = throw "no nixpkgs packages here"; }};
        }};
        nixpkgs = {{
          lib = lib // {{
            nixosSystem = {{ system, modules }}: lib.evalModules {{
              modules = [
                (import {REPO}/tests/nix/stand-ins.nix {{ inherit lib; }})
                ({DOC_OPTIONS})
                {{ services.dspark.package = fake "dspark-0.1.0";
                   services.dspark.lines = lib.mkOverride 900
                     (lib.mapAttrs (_: l: fake "dspark-runtime-${{l.vllm}}") (import {REPO}/nix/lines.nix).lines); }}
              ] ++ modules;
            }};
          }};
        }};
        agenix = {{ nixosModules.default = {AGENIX}; }};
        sops-nix = {{ nixosModules.sops = {SOPS}; }};
        hosts = (import {flake_dir}/{flake_file}).outputs {{ self = hosts; inherit nixpkgs dspark agenix sops-nix; }};
        report = c: {{
          failed = map (a: a.message) (lib.filter (a: !a.assertion) c.assertions);
          inherit (c) warnings;
          units = builtins.attrNames (lib.filterAttrs (_: s: s.enable) c.systemd.services);
          credential = lib.mapAttrs (_: s: s.serviceConfig.LoadCredential or null)
            (lib.filterAttrs (_: s: s.enable) c.systemd.services);
          keyFile = c.services.dspark.apiKeyFile;
          firewall = {{ inherit (c.networking.firewall) allowedTCPPorts trustedInterfaces;
                       interfaces = lib.mapAttrs (_: i: i.allowedTCPPorts) c.networking.firewall.interfaces; }};
          unfree = c.nixpkgs.config.allowUnfree or false;
          cluster = (c.environment.etc."dspark/cluster.toml".source.unchecked).value;
          step = {{ inherit (c.environment.etc."dspark/cluster.toml".source) buildCommand;
                   input = c.environment.etc."dspark/cluster.toml".source.unchecked.outPath; }};
          nix = c.nix.settings;
        }};
      in {expr}"""


def build_cluster_file(report: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    """The module's build step for /etc/dspark/cluster.toml (dspark config check, then the copy),
    run on the file the evaluation generated, with this checkout's dspark."""
    generated = tmp_path / "cluster-unchecked.toml"
    generated.write_text(dumps(report["cluster"]))
    script = report["step"]["buildCommand"].replace(report["step"]["input"], str(generated))
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": "/homeless-shelter",
           "out": str(tmp_path / "out"), "LANG": "C.UTF-8"}
    return subprocess.run(["bash", "-eu", "-o", "pipefail", "-c", script], capture_output=True, text=True,
                          timeout=120, env=env)


def test_the_howto_flake_gives_the_head_its_key_and_the_lan_its_api(nix_instantiate, nixpkgs_lib, hosts_dir,
                                                                   tmp_path):
    out = nix_eval(nix_instantiate, flake_eval(nixpkgs_lib, hosts_dir, "flake.nix", """{
        a = report hosts.nixosConfigurations.spark-a.config;
        b = report hosts.nixosConfigurations.spark-b.config;
        ageFile = toString hosts.nixosConfigurations.spark-a.config.age.secrets.dspark-api-key.file;
      }"""))
    a, b = out["a"], out["b"]
    # No assertion fails and nothing is warned: the fabric is trusted, the open API has its key.
    assert (a["failed"], a["warnings"], b["failed"], b["warnings"]) == ([], [], [], [])
    assert a["units"] == ["dspark-head", "dspark-wait-worker"] and b["units"] == ["dspark-worker"]
    # The key reaches the head's unit from agenix's path; the worker has none.
    assert a["keyFile"] == "/run/agenix/dspark-api-key" and a["credential"]["dspark-head"] == KEY
    assert b["keyFile"] is None and b["credential"] == {"dspark-worker": None}
    assert out["ageFile"] == str(hosts_dir / "secrets" / "dspark-api-key.age")
    # The API on the LAN: bound on every interface, its port open; the fabric trusted on both.
    head = next(n for n in a["cluster"]["nodes"] if n["rank"] == 0)
    assert head["api_host"] == "0.0.0.0" and a["firewall"]["allowedTCPPorts"] == [8888]
    assert a["firewall"]["trustedInterfaces"] == b["firewall"]["trustedInterfaces"] == ["enp1s0f0np0"]
    assert a["unfree"] is True and b["unfree"] is True
    assert a["cluster"] == b["cluster"]  # the same cluster file on both hosts
    r = build_cluster_file(a, tmp_path)
    assert r.returncode == 0 and "OK: 2 nodes: spark-a (rank 0, 192.168.100.10)" in r.stdout, r.stdout + r.stderr


def test_the_weights_commands_put_the_checkpoint_where_the_cluster_file_reads_it(nix_instantiate, nixpkgs_lib,
                                                                                 hosts_dir):
    path = nix_eval(nix_instantiate, flake_eval(nixpkgs_lib, hosts_dir, "flake.nix",
                                                "hosts.nixosConfigurations.spark-b.config.services.dspark.settings.model.path"))
    cmds = sh_commands(HOWTO)
    rsyncs = [c for c in cmds if " rsync " in c]
    assert len(rsyncs) == 2 and all(re.search(rf"[ :]{re.escape(path)}/\s", c + " ") for c in rsyncs), rsyncs
    assert any(c.startswith("sudo chmod -R a+rX " + str(Path(path).parent)) for c in cmds)
    # The checkpoint the how-to downloads is the one dspark plans, with its published figures.
    ckpt = published.CHECKPOINTS[published.NAME]
    assert any(c.startswith(f"hf download {ckpt.repo} ") for c in cmds)
    text = HOWTO.read_text()
    gib = published.PUBLISHED_SHARD_BYTES / 2**30
    assert (f"`{ckpt.repo}`: {published.PUBLISHED_SHARD_COUNT} safetensors shards, "
            f"{published.PUBLISHED_SHARD_BYTES:,} bytes\n({gib:.2f} GiB)") in text


def test_the_sops_nix_variant_gives_the_same_key_from_its_path(nix_instantiate, nixpkgs_lib, hosts_dir):
    """The how-to's sops-nix variant: its module in place of agenix's, its key file in place of
    spark-a/dspark-key.nix."""
    flake = (hosts_dir / "flake.nix").read_text()
    sops_flake = (flake.replace("{ nixpkgs, dspark, agenix, ... }", "{ nixpkgs, dspark, sops-nix, ... }")
                  .replace("agenix.nixosModules.default", "sops-nix.nixosModules.sops")
                  .replace("./spark-a/dspark-key.nix", "./spark-a/dspark-key-sops.nix"))
    assert sops_flake.count("sops") == 4, "the flake's agenix lines moved: update this substitution"
    (hosts_dir / "flake-sops.nix").write_text(sops_flake)
    a = nix_eval(nix_instantiate, flake_eval(nixpkgs_lib, hosts_dir, "flake-sops.nix",
                                             "report hosts.nixosConfigurations.spark-a.config"))
    assert (a["failed"], a["warnings"]) == ([], [])
    assert a["keyFile"] == "/run/secrets/dspark-api-key"
    assert a["credential"]["dspark-head"] == "api-key:/run/secrets/dspark-api-key"


def test_the_api_on_one_lan_interface_and_the_caches(nix_instantiate, nixpkgs_lib, hosts_dir, tmp_path):
    """api-on-lan.nix in place of dspark-cluster.nix's openFirewall line, as the how-to says, and
    caches.nix, on both hosts."""
    lan = tmp_path / "hosts"
    shutil.copytree(hosts_dir, lan)
    cluster = (lan / "dspark-cluster.nix").read_text()
    line = re.search(r"\n *openFirewall = true;[^\n]*", cluster)
    assert line and cluster.count("openFirewall") == 1
    (lan / "dspark-cluster.nix").write_text(cluster.replace(line.group(0), ""))
    hosts_dir = lan
    out = nix_eval(nix_instantiate, flake_eval(nixpkgs_lib, hosts_dir, "flake.nix", """
      lib.mapAttrs (_: h: report (h.extendModules { modules = [ ./api-on-lan.nix ./caches.nix ]; }).config)
        hosts.nixosConfigurations""".replace("./api-on-lan.nix", str(hosts_dir / "api-on-lan.nix"))
                                            .replace("./caches.nix", str(hosts_dir / "caches.nix"))))
    for name, h in out.items():
        # openFirewall off: nothing open on every interface; the fabric trusted by hand (no warning);
        # the API port open on the LAN interface only.
        assert (h["failed"], h["warnings"]) == ([], []), name
        assert h["firewall"] == {"allowedTCPPorts": [], "trustedInterfaces": ["enp1s0f0np0"],
                                 "interfaces": {"eno1": [8888]}}, name
        subs, keys = h["nix"]["extra-substituters"], h["nix"]["extra-trusted-public-keys"]
        assert len(subs) == len(keys) == 2 and all(s.startswith("https://") for s in subs)
        for key in keys:  # name:base64 of an ed25519 public key (32 bytes), as nix.conf takes it
            name_, _, b64 = key.rpartition(":")
            assert name_ and len(base64.b64decode(b64, validate=True)) == 32, key


def test_the_agenix_recipients_file_names_the_secret_the_head_reads(nix_instantiate, hosts_dir):
    rules = nix_eval(nix_instantiate,
                     f"builtins.mapAttrs (_: s: s.publicKeys) (import {hosts_dir}/secrets/secrets.nix)")
    assert list(rules) == ["dspark-api-key.age"] and len(rules["dspark-api-key.age"]) == 2
    assert all(k.startswith("ssh-ed25519 ") for k in rules["dspark-api-key.age"])
    assert "../secrets/dspark-api-key.age" in (hosts_dir / "spark-a" / "dspark-key.nix").read_text()
    assert any(c.startswith("openssl rand -hex 32 | agenix -e dspark-api-key.age") for c in sh_commands(HOWTO))


def test_the_internals_line_switch_snippet_moves_both_hosts(nix_instantiate, nixpkgs_lib, hosts_dir, tmp_path):
    """docs/nixos-internals.md's one-line switch, added to the how-to's dspark-cluster.nix."""
    switch = tmp_path / "switch.nix"
    switch.write_text(snippets(INTERNALS)["dspark-cluster.nix"])
    out = nix_eval(nix_instantiate, flake_eval(nixpkgs_lib, hosts_dir, "flake.nix", f"""
      lib.mapAttrs (_: h: let r = report (h.extendModules {{ modules = [ {switch} ]; }}).config; in
        {{ inherit (r) failed; line = r.cluster.serving.runtime_line; command = r.cluster.serving.vllm_command; }})
        hosts.nixosConfigurations"""))
    command = ["/nix/store/00000000000000000000000000000000-dspark-runtime-0.32.0/bin/vllm"]
    assert out == {h: {"failed": [], "line": "v0.32.0", "command": command} for h in ("spark-a", "spark-b")}


def test_the_runtimes_the_docs_name_are_the_flakes(nix_instantiate):
    """Every `.#runtime...` a document builds is an output of the flake (nix/lines.nix decides
    which lines get one), and docs/runtime-lines.md lists exactly those."""
    attrs = nix_eval(nix_instantiate,
                     "builtins.attrValues (builtins.mapAttrs (_: l: l.attr) (import ./nix/lines.nix).lines)")
    outputs = {"runtime", *attrs}
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    # (`.#runtime-v0.32.0` is quoted as the form that does not work: a dot ends the attribute)
    named = {m for p in docs for m in re.findall(r"\.#(runtime[\w-]*)(?![\w.-])", p.read_text())}
    assert named and named <= outputs, named - outputs
    m = re.search(r"the\s+Nix outputs are (.*?)\.", (REPO / "docs" / "runtime-lines.md").read_text(), re.S)
    assert m and set(re.findall(r"`(runtime[\w-]*)`", m.group(1))) == outputs, m and m.group(1)


def test_the_howto_stays_a_howto():
    """Under 12 KB, its checklist first (the issue that split it: #34)."""
    text = HOWTO.read_text()
    assert len(text.encode()) < 12 * 1024
    first = text.index("\n## ")
    assert text[first:].startswith("\n## Checklist\n")
    for item in ("Weights", "API key", "Cluster file", "Build and start", "Update", "Rollback", "Binary caches"):
        assert f"**{item}**" in text[first:text.index("\n## ", first + 1)], item
