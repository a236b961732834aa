# nixosModules.default: services.dspark, with the dspark package and (on aarch64-linux) the GB10
# runtime of every runtime line (nix/lines.nix) built from the host's own pkgs, so that the host's
# nixpkgs.config applies: the runtime is unfree (NVIDIA's licences) and needs
# `nixpkgs.config.allowUnfree = true` (or a predicate admitting it). Set services.dspark.package /
# lines / runtimePackage to use other builds.
{ lib, pkgs, ... }:
{
  imports = [ ./dspark.nix ];
  services.dspark.package = lib.mkDefault (pkgs.callPackage ../nix/package.nix { });
  services.dspark.lines = lib.mkDefault (
    if pkgs.stdenv.hostPlatform.system == "aarch64-linux" then
      lib.mapAttrs (_: runtimeLine: pkgs.callPackage ../nix/runtime.nix { inherit runtimeLine; }) (import ../nix/lines.nix).lines
    else
      { }
  );
}
