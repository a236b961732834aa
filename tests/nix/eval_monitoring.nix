# Evaluate nixosModules.default for one host, as tests/nix/eval.nix does, and report what
# services.dspark.prometheus and services.dspark.grafana set (tests/nix/test_module_prometheus.py).
#   nix-instantiate --eval --strict --json -E 'import tests/nix/eval_monitoring.nix { libPath = ...; host = { ... }; }'
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
  fakePackage = name: {
    type = "derivation";
    inherit name;
    outPath = "/nix/store/00000000000000000000000000000000-${name}";
  };
  config =
    (lib.evalModules {
      modules = [
        (import ./stand-ins.nix { inherit lib; })
        # What docs/monitoring.md's snippets set besides (nixpkgs declares these in its
        # prometheus and grafana modules).
        {
          options.services.prometheus.enable = lib.mkEnableOption "prometheus";
          options.services.grafana.enable = lib.mkEnableOption "grafana";
          options.services.grafana.provision.datasources.settings.datasources = lib.mkOption {
            type = lib.types.listOf (lib.types.attrsOf lib.types.anything);
            default = [ ];
          };
        }
        outputs.nixosModules.default
        {
          services.dspark.package = fakePackage "dspark-0.1.0";
          services.dspark.lines = lib.mkOverride 900 (
            lib.mapAttrs (_: l: fakePackage "dspark-runtime-${l.vllm}") (import ../../nix/lines.nix).lines
          );
        }
        host
      ];
    }).config;
  dspark = config.services.dspark;
  # A path as its source path (toString: not copied into the store).
  plain = v: if lib.isPath v then toString v else v;
in
{
  failedAssertions = map (a: a.message) (lib.filter (a: !a.assertion) config.assertions);
  inherit (config) warnings;
  scrapeConfigs = dspark.prometheus.scrapeConfigs;
  # What services.prometheus gets, through the stand-in's types (defaults filled in).
  prometheusScrapeConfigs = config.services.prometheus.scrapeConfigs;
  dashboards = toString dspark.grafana.dashboards;
  grafanaProvision = {
    inherit (config.services.grafana.provision) enable;
    providers = map (
      p: p // { options = lib.mapAttrs (_: plain) p.options; }
    ) config.services.grafana.provision.dashboards.settings.providers;
  };
  enabled = {
    prometheus = config.services.prometheus.enable;
    grafana = config.services.grafana.enable;
  };
  datasources = config.services.grafana.provision.datasources.settings.datasources;
  services = lib.attrNames (lib.filterAttrs (_: u: u.enable) config.systemd.services);
  clusterFile = (config.environment.etc."dspark/cluster.toml".source.unchecked or { }).value or null;
}
