# Evaluate the flake's nixosModules.default for one host with nixpkgs.lib and the stand-ins,
# and report what the tests check. Usage (from tests/nix/test_module.py):
#   nix-instantiate --eval --strict --json -E 'import tests/nix/eval.nix { libPath = ...; host = { ... }; }'
{ libPath, host }:
let
  lib = import libPath;
  flake = import ../../flake.nix;
  outputs = flake.outputs {
    self = outputs;
    nixpkgs = {
      inherit lib;
      legacyPackages = throw "the module tests have no nixpkgs packages";
    };
  };
  # Store-path-shaped stand-ins for the flake's packages (nothing is built).
  fakePackage = name: {
    type = "derivation";
    inherit name;
    outPath = "/nix/store/00000000000000000000000000000000-${name}";
  };
  evaluated = lib.evalModules {
    modules = [
      (import ./stand-ins.nix { inherit lib; })
      outputs.nixosModules.default
      {
        services.dspark.package = fakePackage "dspark-0.1.0";
        # Above the flake's mkDefault (so that one is never forced), below a host's own value: one
        # runtime per line of nix/lines.nix, named dspark-runtime-<its vLLM release>.
        services.dspark.lines = lib.mkOverride 900 (
          lib.mapAttrs (_: l: fakePackage "dspark-runtime-${l.vllm}") (import ../../nix/lines.nix).lines
        );
      }
      host
    ];
  };
  config = evaluated.config;
  enabled = lib.filterAttrs (_: u: u.enable);
  disabled = suffix: units: map (n: "${n}.${suffix}") (lib.attrNames (lib.filterAttrs (_: u: !u.enable) units));
in
{
  failedAssertions = map (a: a.message) (lib.filter (a: !a.assertion) config.assertions);
  inherit (config) warnings;
  services = lib.mapAttrs (_: s: {
    inherit (s) wantedBy environment serviceConfig;
    restartTriggers = map (t: t.runCommandName or t.generatedFile or t) s.restartTriggers;
  }) (enabled config.systemd.services);
  # What each trigger holds (the stand-in's generate keeps the file's data): a unit restarts on a
  # switch when this changes, as the store path of the file written from it then does.
  restartTriggerValues = lib.mapAttrs (_: s: map (t: (t.unchecked or t).value or t) s.restartTriggers) (enabled config.systemd.services);
  runtimePackage = if config.services.dspark.runtimePackage == null then null else config.services.dspark.runtimePackage.name;
  targets = lib.attrNames (enabled config.systemd.targets);
  # Units set to enable = false: NixOS links them to /dev/null, masking the package's unit file.
  masked = lib.sort lib.lessThan (disabled "service" config.systemd.services ++ disabled "target" config.systemd.targets);
  packages = map (p: p.name) config.systemd.packages;
  # A file built by a step (runCommand): what it is built from, and the step.
  # (outPath dropped: JSON would show a store-path-shaped attribute set as that path alone).
  etc = lib.mapAttrs (
    _: e:
    let
      s = e.source.unchecked or e.source;
    in
    if lib.isAttrs s then removeAttrs s [ "outPath" ] else s
  ) config.environment.etc;
  builtBy = lib.mapAttrs (_: e: {
    inherit (e.source) runCommandName buildCommand nativeBuildInputs;
    input = e.source.unchecked.outPath;
  }) (lib.filterAttrs (_: e: e.source ? buildCommand) config.environment.etc);
  firewall = { inherit (config.networking.firewall) allowedTCPPorts trustedInterfaces; };
  users = config.users;
}
