"""nix/runtime.nix, the flake and the module, evaluated against a stand-in of nixpkgs' top level
(tests/nix/stub-nixpkgs: callPackage, `import nixpkgs { config; }`, and mkDerivation refusing
unfree licences as nixpkgs does) with the real nixpkgs.lib. Nothing is built."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.nix.nix_support import REPO, NixError, flake_with_stub, nix_eval

pytestmark = pytest.mark.nix

LOCK = json.loads((REPO / "nix/runtime-lock.json").read_text())
BUILD = json.loads((REPO / "nix/runtime-build.json").read_text())


def test_flake_pin_refuses_the_unfree_runtime_and_the_flake_allows_it(nix_instantiate, stub):
    # Before: packages.runtime was callPackage'd from nixpkgs.legacyPackages, which refuses it.
    with pytest.raises(NixError, match="unfree license"):
        nix_eval(nix_instantiate, flake_with_stub(stub)
                 + " (nixpkgs.legacyPackages.aarch64-linux.callPackage ./nix/runtime.nix { }).outPath")
    out = nix_eval(nix_instantiate, flake_with_stub(stub) + """ {
        runtime = outputs.packages.aarch64-linux.runtime.name;
        license = outputs.packages.aarch64-linux.runtime.meta.license.free;
        x86 = builtins.attrNames outputs.packages.x86_64-linux;
      }""")
    assert out == {"runtime": "dspark-runtime-0.28.0", "license": False, "x86": ["default", "dspark"]}


def runtime(nix_instantiate, stub, expr: str):
    return nix_eval(nix_instantiate, f"""
      let
        pkgs = import {stub} {{ config.allowUnfree = true; }};
        drv = pkgs.callPackage ./nix/runtime.nix {{ }};
      in {expr}""")


def test_runtime_is_driven_by_the_build_data(nix_instantiate, stub):
    out = runtime(nix_instantiate, stub, """{
        inherit (drv) dontStrip autoPatchelfIgnoreMissingDeps installPhase postFixup;
        buildInputs = map (d: d.name) drv.buildInputs;
      }""")
    assert out["dontStrip"] is True and BUILD["strip"] is False
    assert out["autoPatchelfIgnoreMissingDeps"] == BUILD["driver_libraries"]
    assert out["buildInputs"] == ["gcc-lib", "zlib", "numactl", "rdma-core"]
    install = out["installPhase"]
    # One installer run per locked wheel, in the lock's order, with the venv's python.
    lines = [ln.strip() for ln in install.splitlines() if " -m installer " in ln]
    assert len(lines) == len(LOCK["packages"])
    for line, p in zip(lines, LOCK["packages"], strict=True):
        assert line.startswith('PYTHONPATH=/nix/store/00000000000000000000000000000000-python3.12-installer-0.7.0/'
                               'lib/python3.12/site-packages "$out/bin/python" -m installer')
        assert line.endswith(f'--prefix "$out" /nix/store/00000000000000000000000000000000-{p["filename"]}')
    # The removals follow the package they belong to.
    after_flashinfer = install.split("-flashinfer_python-")[1].split(" -m installer ")[0]
    assert 'rm -- "$out/lib/python3.12/site-packages/build_backend.py"' in after_flashinfer
    assert install.count("rm -- ") == sum(len(r["paths"]) for r in BUILD["remove_after_install"])
    # A venv: pyvenv.cfg beside bin/, bin/python a link to the store's interpreter.
    assert "home = /nix/store/00000000000000000000000000000000-python3-3.12.11/bin" in install
    assert ('ln -s /nix/store/00000000000000000000000000000000-python3-3.12.11/bin/python3.12 '
            '"$out/bin/python"') in install


def test_wrappers_carry_the_toolchain_and_find_the_driver_without_pythonpath(nix_instantiate, stub):
    fixup = runtime(nix_instantiate, stub, "drv.postFixup")
    assert "PYTHONPATH" not in fixup  # the old wrappers' --prefix PYTHONPATH skipped the .pth files
    assert "--set-default CUDA_HOME /nix/store/00000000000000000000000000000000-cuda-merged-13.0" in fixup
    assert "--set-default CC /nix/store/00000000000000000000000000000000-gcc-wrapper-14/bin/cc" in fixup
    assert ("--prefix PATH : \"$out/bin:/nix/store/00000000000000000000000000000000-gcc-wrapper-14/bin:"
            "/nix/store/00000000000000000000000000000000-cuda-merged-13.0/bin\"") in fixup
    source = fixup.split('extra=(--run "source ')[1].split('")')[0]
    assert "-driver-libs.sh" in source and "'libcuda.so.1 libnvidia-ml.so.1'" in source
    assert "'" + " ".join(BUILD["driver_search_dirs"]) + "'" in source


def module_eval(stub: Path, nixpkgs_lib: Path, host_config: str) -> str:
    """The module with the stand-in NixOS options and a host pkgs made with the host's config."""
    return f"""
      let
        lib = import {nixpkgs_lib};
        hostPkgs = import {stub} {{ config = {host_config}; }};
        stand = import ./tests/nix/stand-ins.nix {{ inherit lib; }};
        evaluated = lib.evalModules {{
          modules = [
            stand
            {{ _module.args.pkgs = lib.mkForce (hostPkgs // {{ inherit (stand.config._module.args.pkgs) formats; }}); }}
            (import ./modules/default.nix)  # what the flake exports as nixosModules.default
            {{ services.dspark.enable = true; services.dspark.node = "spark-a";
               services.dspark.settings.model.path = "/m";
               services.dspark.settings.nodes = [ {{ name = "spark-a"; rank = 0; address = "10.0.0.1"; }} ]; }}
          ];
        }};
      in evaluated.config.services.dspark"""


def test_module_builds_the_runtime_with_the_hosts_pkgs(nix_instantiate, stub, nixpkgs_lib):
    out = nix_eval(nix_instantiate, module_eval(stub, nixpkgs_lib, '{ allowUnfree = true; marker = "host"; }')
                   + ".runtimePackage.builtWith")
    assert out == "host"
    # The host's config applies: without allowUnfree, nixpkgs' refusal (not the flake's) stops it.
    with pytest.raises(NixError, match="unfree license"):
        nix_eval(nix_instantiate, module_eval(stub, nixpkgs_lib, "{ }") + ".runtimePackage.outPath")
