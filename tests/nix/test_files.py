"""The Nix files: they parse, the flake is small and its nixpkgs pin is a complete lock."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from tests.nix.nix_support import REPO, nix_eval, run_nix

pytestmark = pytest.mark.nix


def nix_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.nix"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    return sorted(line for line in out.splitlines() if line)


def test_the_project_has_nix_files():
    files = nix_files()
    for expected in ("flake.nix", "nix/package.nix", "nix/runtime.nix", "modules/dspark.nix"):
        assert expected in files


@pytest.mark.parametrize("path", nix_files())
def test_every_nix_file_parses(nix_instantiate, path):
    run_nix(nix_instantiate, "--parse", path)


def test_flake_inputs_are_nixpkgs_only(nix_instantiate):
    inputs = nix_eval(nix_instantiate, "(import ./flake.nix).inputs")
    assert list(inputs) == ["nixpkgs"]
    assert inputs["nixpkgs"]["url"] == "github:NixOS/nixpkgs/nixos-26.05"


def test_flake_lock_pins_nixpkgs_with_rev_and_nar_hash():
    lock = json.loads((REPO / "flake.lock").read_text())
    assert lock["version"] == 7
    assert lock["nodes"]["root"]["inputs"] == {"nixpkgs": "nixpkgs"}
    node = lock["nodes"]["nixpkgs"]
    locked, original = node["locked"], node["original"]
    assert locked["type"] == "github" and locked["repo"] == "nixpkgs"
    assert re.fullmatch(r"[0-9a-f]{40}", locked["rev"])
    assert re.fullmatch(r"sha256-[A-Za-z0-9+/]{43}=", locked["narHash"])
    assert isinstance(locked["lastModified"], int) and locked["lastModified"] > 1_700_000_000
    # The lock's original must be what flake.nix asks for, or Nix would re-lock.
    assert (original["owner"], original["repo"], original["ref"]) == ("NixOS", "nixpkgs", "nixos-26.05")
    assert locked["owner"] == original["owner"]


def test_flake_lock_original_is_what_the_flake_asks_for(nix_instantiate):
    url = nix_eval(nix_instantiate, "(import ./flake.nix).inputs.nixpkgs.url")
    original = json.loads((REPO / "flake.lock").read_text())["nodes"]["nixpkgs"]["original"]
    assert url == f"github:{original['owner']}/{original['repo']}/{original['ref']}"
    # The template's hosts follow the same release (its users lock it themselves).
    template = nix_eval(nix_instantiate, "(import ./nix/template/flake.nix).inputs.nixpkgs.url")
    assert template == url


def test_flake_outputs_wire_the_packages_and_the_module(nix_instantiate, nixpkgs_lib):
    expr = f"""
      let
        lib = import {nixpkgs_lib};
        outputs = (import ./flake.nix).outputs {{
          self = outputs;
          nixpkgs = {{ inherit lib; legacyPackages = {{ aarch64-linux = {{ }}; x86_64-linux = {{ }}; }}; }};
        }};
      in {{
        packages = lib.mapAttrs (_: builtins.attrNames) outputs.packages;
        checks = builtins.attrNames outputs.checks;
        module = builtins.isFunction outputs.nixosModules.default;
      }}"""
    out = nix_eval(nix_instantiate, expr)
    # One runtime per runtime line (nix/lines.nix), runtime-<line id with _ for .>, beside `runtime`.
    lines = nix_eval(nix_instantiate, "map (l: l.attr) (builtins.attrValues (import ./nix/lines.nix).lines)")
    assert {"runtime-v0_28_0", "runtime-v0_32_0"} <= set(lines)
    assert out["packages"] == {"aarch64-linux": sorted(["default", "dspark", "runtime", *lines]),
                               "x86_64-linux": ["default", "dspark"]}
    assert out["checks"] == ["aarch64-linux", "x86_64-linux"]
    assert out["module"] is True


def test_package_version_comes_from_pyproject():
    text = (REPO / "nix/package.nix").read_text()
    assert "lib.importTOML ../pyproject.toml" in text
    assert not re.search(r'version\s*=\s*"', text)


def test_flake_has_the_outputs_a_nixos_user_expects(nix_instantiate, nixpkgs_lib):
    expr = f"""
      let
        lib = import {nixpkgs_lib};
        outputs = (import ./flake.nix).outputs {{ self = outputs; nixpkgs = {{ inherit lib; }}; }};
      in {{
        top = builtins.attrNames outputs;
        checks = builtins.attrNames outputs.checks.aarch64-linux;
        hosts = builtins.attrNames outputs.nixosConfigurations;
        template = builtins.pathExists (outputs.templates.default.path + "/flake.nix");
        overlay = builtins.isFunction outputs.overlays.default;
      }}"""
    out = nix_eval(nix_instantiate, expr)
    assert out["top"] == ["apps", "checks", "devShells", "formatter", "nixosConfigurations", "nixosModules",
                          "overlays", "packages", "templates"]
    assert out["checks"] == ["dspark", "module-spark-a", "module-spark-b"]
    assert out["hosts"] == ["spark-a", "spark-b"] and out["template"] and out["overlay"]


# Nix `let` bindings shared by the template-host tests: `hosts` (nix/template/hosts.nix) and
# `nixos HOST`, that host evaluated with the stand-ins, the module and the shared cluster file.
TEMPLATE_HOSTS = """\
        hosts = (import ./nix/template/hosts.nix).hosts;
        fake = name: { type = "derivation"; inherit name;
                       outPath = "/nix/store/00000000000000000000000000000000-${name}"; };
        nixos = host: lib.evalModules {
          modules = [
            (import ./tests/nix/stand-ins.nix { inherit lib; })
            { options.nixpkgs.config = lib.mkOption { type = lib.types.attrs; default = { }; }; }
            (import ./modules/default.nix)
            { services.dspark.package = fake "dspark-0.1.0";
              services.dspark.lines = lib.mkOverride 900
                (lib.mapAttrs (_: l: fake "dspark-runtime-${l.vllm}") (import ./nix/lines.nix).lines); }
            ./nix/template/dspark-cluster.nix
            host
          ];
        };
"""


def test_template_hosts_evaluate_as_head_and_worker(nix_instantiate, nixpkgs_lib):
    """nix/template (the flake's templates.default, and its nixosConfigurations): both hosts, with
    the shared cluster file, evaluate with no failed assertion and get the units of their role."""
    expr = f"""
      let
        lib = import {nixpkgs_lib};
{TEMPLATE_HOSTS}        eval = host: (nixos host).config;
      in lib.mapAttrs (_: host: let c = eval host; in {{
        failed = map (a: a.message) (lib.filter (a: !a.assertion) c.assertions);
        inherit (c) warnings;
        units = builtins.attrNames (lib.filterAttrs (_: s: s.enable) c.systemd.services);
        masked = builtins.attrNames (lib.filterAttrs (_: s: !s.enable) (c.systemd.services // c.systemd.targets));
        credential = lib.mapAttrs (_: s: s.serviceConfig.LoadCredential or null)
          (lib.filterAttrs (_: s: s.enable) c.systemd.services);
        unfree = c.nixpkgs.config.allowUnfree;
      }}) hosts"""
    out = nix_eval(nix_instantiate, expr)
    # The example sets apiKeyFile and openFirewall for both hosts: no warning, and only the head's
    # units get the key.
    key = "api-key:/run/secrets/dspark-api-key"
    assert out == {
        "spark-a": {"failed": [], "warnings": [], "units": ["dspark-head", "dspark-wait-worker"],
                    "masked": ["dspark-dashboard", "dspark-worker", "dspark-worker@"],
                    "credential": {"dspark-head": key, "dspark-wait-worker": None}, "unfree": True},
        "spark-b": {"failed": [], "warnings": [], "units": ["dspark-worker"],
                    "masked": ["dspark-dashboard", "dspark-head", "dspark-wait-worker", "dspark-worker-ready",
                               "dspark-worker@"],
                    "credential": {"dspark-worker": None}, "unfree": True},
    }
    # The repository's flake and the template's flake build their hosts from the same files.
    for flake in ("flake.nix", "nix/template/flake.nix"):
        text = (REPO / flake).read_text()
        assert "dspark-cluster.nix" in text and "hosts.nix" in text and "example-hardware.nix" in text


def test_module_check_writes_each_example_hosts_units(nix_instantiate, nixpkgs_lib):
    """nix/module-check.nix (`nix flake check`'s checks.module-*) on the example hosts evaluated
    with the stand-ins: what it writes out, with writeText kept as its text."""
    expr = f"""
      let
        lib = import {nixpkgs_lib};
{TEMPLATE_HOSTS}      in lib.mapAttrs (name: host: builtins.fromJSON (import ./nix/module-check.nix {{
        inherit lib name;
        writeText = _: text: text;
        nixos = nixos host;
      }})) hosts"""
    out = nix_eval(nix_instantiate, expr)
    assert out == {
        "spark-a": {"node": "spark-a", "units": ["dspark-head", "dspark-wait-worker"],
                    "masked": ["dspark-dashboard", "dspark-worker", "dspark-worker@"], "warnings": []},
        "spark-b": {"node": "spark-b", "units": ["dspark-worker"],
                    "masked": ["dspark-dashboard", "dspark-head", "dspark-wait-worker", "dspark-worker-ready",
                               "dspark-worker@"], "warnings": []},
    }
