# nixosModules.default: services.dspark, with the dspark package and (on aarch64-linux) the GB10
# runtime built from the host's own pkgs, so that the host's nixpkgs.config applies: the runtime
# is unfree (NVIDIA's licences) and needs `nixpkgs.config.allowUnfree = true` (or a predicate
# admitting it). Set services.dspark.package / runtimePackage to use other builds.
{ lib, pkgs, ... }:
{
  imports = [ ./dspark.nix ];
  services.dspark.package = lib.mkDefault (pkgs.callPackage ../nix/package.nix { });
  services.dspark.runtimePackage = lib.mkDefault (
    if pkgs.stdenv.hostPlatform.system == "aarch64-linux" then pkgs.callPackage ../nix/runtime.nix { } else null
  );
}
