# A stand-in for nixpkgs' top level, enough to evaluate nix/runtime.nix, nix/package.nix and the
# flake's outputs without nixpkgs (which cannot be had here). What it keeps from nixpkgs: packages
# come from callPackage, `import nixpkgs { config; }` makes a package set with that config, and
# mkDerivation refuses an unfree licence unless config.allowUnfree (check-meta.nix's rule).
# Derivations are returned as their attributes plus a fake store path; nothing is built.
{
  system ? "aarch64-linux",
  config ? { },
  overlays ? [ ],
  # Written beside a copy of this file by the tests: the lib/ of a nixpkgs.lib checkout.
  libPath ? (import ./lib-path.nix),
}:
let
  lib = import libPath;
  fake = name: {
    type = "derivation";
    inherit name;
    outPath = "/nix/store/00000000000000000000000000000000-${name}";
  };
  base = self: {
    inherit lib config;
    pkgs = self;
    callPackage = lib.callPackageWith self;
    stdenv = {
      hostPlatform.system = system;
      cc = fake "gcc-wrapper" // {
        cc = fake "gcc" // { lib = fake "gcc-lib"; };
        libc = fake "glibc";
      };
      mkDerivation =
        attrs:
        let
          free = attrs.meta.license.free or true;
        in
        if !free && !(config.allowUnfree or false) then
          throw "Package ‘${attrs.pname}-${attrs.version}’ has an unfree license (‘unfree’), refusing to evaluate."
        else
          attrs // fake "${attrs.pname}-${attrs.version}" // { builtWith = config.marker or null; };
    };
    fetchPypi = a: fake "${a.pname}-${a.version}-${a.python}-${a.abi}-${a.platform}.whl";
    python312 = fake "python3-3.12.11" // {
      pythonVersion = "3.12";
      version = "3.12.11";
      interpreter = "/nix/store/00000000000000000000000000000000-python3-3.12.11/bin/python3.12";
      sitePackages = "lib/python3.12/site-packages";
      pkgs.installer = fake "python3.12-installer-0.7.0";
    };
    # Enough of python3Packages for nix/package.nix: buildPythonApplication keeps its arguments.
    python3Packages = {
      python = self.python312;
      buildPythonApplication = attrs: attrs // fake "${attrs.pname}-${attrs.version}";
      setuptools = fake "python3.12-setuptools";
      click = fake "python3.12-click";
      httpx = fake "python3.12-httpx";
      prometheus-client = fake "python3.12-prometheus-client";
      pytestCheckHook = fake "pytest-check-hook";
    };
    autoPatchelfHook = fake "auto-patchelf-hook";
    addDriverRunpath.driverLink = "/run/opengl-driver";
    makeWrapper = fake "make-wrapper";
    zlib = fake "zlib";
    numactl = fake "numactl";
    rdma-core = fake "rdma-core";
    cudaPackages_13 = {
      cudatoolkit = fake "cuda-merged-13.0";
      backendStdenv.cc = fake "gcc-wrapper-14";
    };
  };
  pkgs = lib.fix (lib.foldl' (f: o: lib.extends o f) base overlays);
in
pkgs
