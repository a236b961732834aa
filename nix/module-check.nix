# `nix flake check`: an example host's NixOS configuration evaluates with no failed assertion, and
# what the module enables (and masks) for its role, with its warnings, is written out.
{
  lib,
  writeText,
  name,
  nixos,
}:
let
  inherit (nixos) config;
  failed = map (a: a.message) (lib.filter (a: !a.assertion) config.assertions);
in
if failed != [ ] then
  throw "nixosConfigurations.${name}: ${lib.concatStringsSep "; " failed}"
else
  writeText "dspark-module-${name}.json" (
    builtins.toJSON {
      inherit (config.services.dspark) node;
      # The units this host runs, and those of the other role it masks (enable = false).
      units = lib.attrNames (lib.filterAttrs (n: s: lib.hasPrefix "dspark-" n && s.enable) config.systemd.services);
      masked = lib.attrNames (
        lib.filterAttrs (n: s: lib.hasPrefix "dspark-" n && !s.enable) (
          config.systemd.services // config.systemd.targets
        )
      );
      inherit (config) warnings;
    }
  )
