# Small stand-ins for the NixOS options services.dspark sets, and for the pkgs functions it
# calls (formats.toml, runCommand), so the module can be evaluated with nixpkgs.lib alone. They declare only
# the shape the module relies on; the real declarations live in nixpkgs' nixos/ tree.
{ lib }:
let
  inherit (lib) mkOption types;
  # A TOML value, shaped like the type of nixpkgs' pkgs.formats.toml.
  tomlValue =
    types.nullOr (
      types.oneOf [
        types.bool
        types.int
        types.float
        types.str
        types.path
        (types.attrsOf tomlValue)
        (types.listOf tomlValue)
      ]
    )
    // {
      description = "TOML value";
    };
  pkgs.stdenv.hostPlatform.system = "aarch64-linux";
  pkgs.formats.toml = _: {
    type = types.attrsOf tomlValue;
    # The real generate writes a TOML file into the store; the stand-in keeps the data, so the
    # tests can read back exactly what would be written.
    generate = name: value: {
      generatedFile = name;
      inherit value;
      outPath = "/nix/store/00000000000000000000000000000000-${name}";
    };
  };
  # runCommand's build step, kept as text with its inputs (tests/nix/test_module.py's
  # build_cluster_file runs it on the file the stand-in generate keeps); passthru is merged in as nixpkgs does.
  pkgs.runCommand =
    name: env: buildCommand:
    (env.passthru or { })
    // {
      runCommandName = name;
      inherit buildCommand;
      nativeBuildInputs = map (p: p.name) (env.nativeBuildInputs or [ ]);
      outPath = "/nix/store/00000000000000000000000000000000-${name}";
    };
  unit = types.submodule {
    options = {
      # NixOS: false makes the unit a symlink to /dev/null (masked), also over a unit of the same
      # name from systemd.packages.
      enable = mkOption {
        type = types.bool;
        default = true;
      };
      wantedBy = mkOption {
        type = types.listOf types.str;
        default = [ ];
      };
      environment = mkOption {
        type = types.attrsOf types.str;
        default = { };
      };
      restartTriggers = mkOption {
        type = types.listOf types.anything;
        default = [ ];
      };
      serviceConfig = mkOption {
        type = types.attrsOf types.anything;
        default = { };
      };
    };
  };
  listOf = t: mkOption {
    type = types.listOf t;
    default = [ ];
  };
in
{
  config._module.args.pkgs = pkgs;
  options = {
    assertions = listOf types.unspecified;
    warnings = listOf types.str;
    environment.etc = mkOption {
      type = types.attrsOf (types.submodule { options.source = mkOption { type = types.anything; }; });
      default = { };
    };
    systemd.packages = listOf types.package;
    systemd.services = mkOption {
      type = types.attrsOf unit;
      default = { };
    };
    systemd.targets = mkOption {
      type = types.attrsOf unit;
      default = { };
    };
    users.users = mkOption {
      type = types.attrsOf (types.attrsOf types.anything);
      default = { };
    };
    users.groups = mkOption {
      type = types.attrsOf (types.attrsOf types.anything);
      default = { };
    };
    # services.dspark.prometheus / .grafana (modules/monitoring.nix): the option names they set, as
    # nixpkgs' prometheus and grafana modules declare them (no freeform: a misspelt key fails).
    services.prometheus.scrapeConfigs = listOf (
      types.submodule {
        options = {
          job_name = mkOption { type = types.str; };
          metrics_path = mkOption {
            type = types.nullOr types.str;
            default = null;
          };
          scrape_interval = mkOption {
            type = types.nullOr types.str;
            default = null;
          };
          honor_labels = mkOption {
            type = types.nullOr types.bool;
            default = null;
          };
          authorization = mkOption {
            type = types.nullOr types.attrs;
            default = null;
          };
          static_configs = listOf (
            types.submodule {
              options.targets = mkOption { type = types.listOf types.str; };
              options.labels = mkOption {
                type = types.attrsOf types.str;
                default = { };
              };
            }
          );
        };
      }
    );
    services.grafana.provision.enable = mkOption {
      type = types.bool;
      default = false;
    };
    services.grafana.provision.dashboards.settings.providers = listOf (
      types.submodule {
        freeformType = types.attrsOf types.anything;
        options.name = mkOption { type = types.str; };
        options.type = mkOption { type = types.str; };
        options.options.path = mkOption { type = types.path; };
      }
    );
    networking.hostName = mkOption {
      type = types.str;
      default = "nixos";
    };
    networking.firewall = {
      enable = mkOption {
        type = types.bool;
        default = true;
      };
      allowedTCPPorts = listOf types.port;
      trustedInterfaces = listOf types.str;
    };
  };
}
