# `nix flake check`: an example host's NixOS configuration evaluates with no failed assertion, and
# what the module enables for its role is written out.
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
      units = lib.filter (lib.hasPrefix "dspark-") (lib.attrNames config.systemd.services);
    }
  )
