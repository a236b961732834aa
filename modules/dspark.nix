# services.dspark: one node of a dspark cluster (DeepSeek V4 Flash on two GB10 nodes, TP=2).
#
# Both hosts import this module with the same `settings` (the cluster file) and differ only in
# `node`. The unit files come from the dspark package (`dspark systemd render`); this module
# installs them, enables the ones for this host's role and gives them their environment.
{
  config,
  lib,
  pkgs,
  ...
}:
let
  inherit (lib)
    literalExpression
    mkEnableOption
    mkIf
    mkMerge
    mkOption
    optional
    types
    ;
  cfg = config.services.dspark;
  settingsFormat = pkgs.formats.toml { };
  configPath = "/etc/dspark/cluster.toml";

  # The fields the module itself reads (role, ports, addresses) are declared so that they are
  # type-checked; everything else in the cluster file passes through as written. Defaults are
  # those of src/dspark/config.py (a test keeps the two equal).
  nodeModule = {
    freeformType = settingsFormat.type;
    options = {
      name = mkOption {
        type = types.str;
        description = "Node name; `services.dspark.node` picks this host's entry by it.";
      };
      rank = mkOption {
        type = types.ints.unsigned;
        description = "Node rank: 0 is the head (serves the API), the others are headless workers.";
      };
      address = mkOption {
        type = types.nullOr types.str;
        default = null;
        description = "The node's address on the dedicated fabric (required; `null` only so that a missing address is reported by an assertion).";
      };
      socket_ifname = mkOption {
        type = types.nullOr types.str;
        default = null;
        example = "enp1s0f0np0";
        description = "Fabric interface for NCCL, Gloo and TP sockets. With `openFirewall`, the firewall trusts it.";
      };
      api_port = mkOption {
        type = types.port;
        default = 8888;
        description = "The head's OpenAI-compatible API port.";
      };
      master_port = mkOption {
        type = types.port;
        default = 25000;
        description = "Rendezvous port (the head's entry counts).";
      };
      agent_port = mkOption {
        type = types.port;
        default = 8890;
        description = "Port of the node's read-only agent (state, metrics).";
      };
    };
  };

  nodes = cfg.settings.nodes;
  names = map (n: n.name) nodes;
  ranks = map (n: n.rank) nodes;
  byName = lib.listToAttrs (map (n: lib.nameValuePair n.name n) nodes);
  self = byName.${cfg.node} or null;
  known = self != null;
  isHead = known && self.rank == 0;
  head = lib.findFirst (n: n.rank == 0) null nodes;
  duplicates = xs: lib.unique (lib.filter (x: lib.count (y: y == x) xs > 1) xs);
  inStore = p: lib.hasPrefix "${builtins.storeDir}/" (toString p);

  # The file both nodes read: null (unset optional fields) is left out, as TOML has no null.
  dropNulls =
    v:
    if lib.isAttrs v then
      lib.mapAttrs (_: dropNulls) (lib.filterAttrs (_: x: x != null) v)
    else if lib.isList v then
      map dropNulls v
    else
      v;
  clusterFile = settingsFormat.generate "cluster.toml" (dropNulls cfg.settings);

  unitEnvironment = {
    DSPARK_NODE = cfg.node;
    DSPARK_CONFIG = configPath;
  };
  # Secrets reach the units from outside the store: an environment file and/or a systemd
  # credential that the supervisor reads from $CREDENTIALS_DIRECTORY/api-key.
  secretServiceConfig = {
    EnvironmentFile = mkIf (cfg.environmentFile != null) cfg.environmentFile;
    LoadCredential = mkIf (cfg.apiKeyFile != null) "api-key:${cfg.apiKeyFile}";
  };
  mainUnit = {
    wantedBy = optional cfg.autoStart "multi-user.target";
    environment = unitEnvironment;
    restartTriggers = [ clusterFile ];
    serviceConfig = secretServiceConfig // {
      User = "dspark";
      Group = "dspark";
    };
  };
in
{
  options.services.dspark = {
    enable = mkEnableOption "dspark, one node of a DeepSeek V4 Flash cluster served by vLLM";

    package = mkOption {
      type = types.package;
      description = "The dspark package: its CLI and the systemd units it renders (`nixosModules.default` sets the flake's).";
    };

    runtimePackage = mkOption {
      type = types.nullOr types.package;
      default = null;
      defaultText = literalExpression "dspark.packages.aarch64-linux.runtime (via nixosModules.default)";
      description = ''
        The GB10 runtime (Python with the patched vLLM). Unless
        `settings.serving.vllm_command` is set, its `bin/vllm` is the command the nodes run.
      '';
    };

    node = mkOption {
      type = types.str;
      default = config.networking.hostName;
      defaultText = literalExpression "config.networking.hostName";
      example = "spark-a";
      description = "This host's node: the `name` of one entry of `settings.nodes`.";
    };

    settings = mkOption {
      description = ''
        The cluster file, written to `${configPath}` and identical on every node. Its
        sections are `model`, `serving`, `supervisor` and `nodes`; see `dspark config init`
        for every field with its meaning. Do not put secrets here: it lands in the Nix store.
      '';
      example = literalExpression ''
        {
          model.path = "/var/lib/dspark/models/DeepSeek-V4-Flash";
          nodes = [
            { name = "spark-a"; rank = 0; address = "192.168.100.10"; socket_ifname = "enp1s0f0np0"; }
            { name = "spark-b"; rank = 1; address = "192.168.100.11"; socket_ifname = "enp1s0f0np0"; }
          ];
        }
      '';
      type = types.submodule {
        freeformType = settingsFormat.type;
        options = {
          model = mkOption {
            default = { };
            description = "The `[model]` section.";
            type = types.submodule {
              freeformType = settingsFormat.type;
              options.path = mkOption {
                type = types.nullOr types.str;
                default = null;
                example = "/var/lib/dspark/models/DeepSeek-V4-Flash";
                description = "Model directory, the same path on every node (required).";
              };
            };
          };
          serving = mkOption {
            default = { };
            description = "The `[serving]` section.";
            type = types.submodule {
              freeformType = settingsFormat.type;
              options.vllm_command = mkOption {
                type = types.listOf types.str;
                default = optional (cfg.runtimePackage != null) "${cfg.runtimePackage}/bin/vllm";
                defaultText = literalExpression ''[ "''${config.services.dspark.runtimePackage}/bin/vllm" ]'';
                description = "The command that runs vLLM's CLI (the argv before `serve`).";
              };
            };
          };
          nodes = mkOption {
            type = types.listOf (types.submodule nodeModule);
            default = [ ];
            description = "One entry per node (`[[nodes]]`); rank 0 is the head.";
          };
        };
      };
    };

    environmentFile = mkOption {
      type = types.nullOr types.str;
      default = null;
      example = "/run/secrets/dspark.env";
      description = ''
        A file outside the Nix store with `KEY=value` lines for the units, for example
        `DSPARK_API_KEY=...` (or `VLLM_API_KEY`), the key clients must present to the head.
      '';
    };

    apiKeyFile = mkOption {
      type = types.nullOr types.str;
      default = null;
      example = "/run/secrets/dspark-api-key";
      description = ''
        A file outside the Nix store holding the API key, handed to the units as the systemd
        credential `api-key` (read from `$CREDENTIALS_DIRECTORY/api-key`).
      '';
    };

    autoStart = mkOption {
      type = types.bool;
      default = true;
      description = ''
        Start this host's unit at boot. The head waits for the worker on its own
        (`dspark-worker-ready.target`), so both hosts may boot in any order.
      '';
    };

    openFirewall = mkOption {
      type = types.bool;
      default = false;
      description = ''
        Open the head's API port to every interface, and trust this node's fabric interface
        (`socket_ifname`) for the rendezvous, agent and NCCL/Gloo ports between the nodes,
        which NCCL picks at run time. Without a `socket_ifname`, only the rendezvous and
        agent ports are opened.
      '';
    };

    dashboard.enable = mkEnableOption "the dspark dashboard on the head (`dspark-dashboard.service`)";
  };

  config = mkIf cfg.enable (mkMerge [
    {
      assertions = [
        {
          assertion = nodes != [ ];
          message = "services.dspark.settings.nodes is empty: add one entry per node (name, rank, address).";
        }
        {
          assertion = nodes == [ ] || known;
          message = "services.dspark.node = \"${cfg.node}\" is not a node of services.dspark.settings.nodes (known: ${lib.concatStringsSep ", " names}); set services.dspark.node to this host's entry.";
        }
        {
          assertion = duplicates names == [ ];
          message = "services.dspark.settings.nodes: the names ${lib.concatStringsSep ", " (duplicates names)} are used more than once.";
        }
        {
          assertion = lib.sort lib.lessThan ranks == lib.range 0 (lib.length nodes - 1);
          message = "services.dspark.settings.nodes: ranks must be 0..${toString (lib.length nodes - 1)}, one per node (rank 0 is the head); got ${lib.concatMapStringsSep ", " toString ranks}.";
        }
        {
          assertion = !isHead || lib.all (n: n.address != null) nodes;
          message = "services.dspark: this host is the head, but ${lib.concatMapStringsSep ", " (n: "node \"${n.name}\"") (lib.filter (n: n.address == null) nodes)} has no address; the head needs every worker's fabric address.";
        }
        {
          assertion = !known || self.address != null;
          message = "services.dspark.settings.nodes: this node (\"${cfg.node}\") has no address; set its fabric address.";
        }
        {
          assertion = !known || head == null || head.address != null;
          message = "services.dspark.settings.nodes: the head (rank 0) has no address; every node needs it for the rendezvous.";
        }
        {
          assertion = cfg.settings.model.path != null;
          message = "services.dspark.settings.model.path is not set: give the model directory (the same path on every node).";
        }
        {
          assertion = cfg.settings.serving.vllm_command != [ ];
          message = "services.dspark: no vLLM to run; set services.dspark.runtimePackage (the flake's runtime, aarch64-linux) or settings.serving.vllm_command.";
        }
        {
          assertion = cfg.environmentFile == null || !inStore cfg.environmentFile;
          message = "services.dspark.environmentFile is in the Nix store, which every user can read; keep secrets in a file outside it.";
        }
        {
          assertion = cfg.apiKeyFile == null || !inStore cfg.apiKeyFile;
          message = "services.dspark.apiKeyFile is in the Nix store, which every user can read; keep the key in a file outside it.";
        }
        {
          assertion = !cfg.dashboard.enable || !known || isHead;
          message = "services.dspark.dashboard.enable: the dashboard runs on the head; enable it in the head's configuration.";
        }
      ];

      environment.etc."dspark/cluster.toml".source = clusterFile;
      systemd.packages = [ cfg.package ];

      users.users.dspark = {
        isSystemUser = true;
        group = "dspark";
        home = "/var/lib/dspark";
        # The GPU's device nodes belong to the video group on NixOS.
        extraGroups = [ "video" ];
      };
      users.groups.dspark = { };
    }

    (mkIf isHead {
      systemd.services.dspark-head = mainUnit;
      # The head's dspark-worker-ready.target requires this oneshot, which waits for the
      # worker's agent; it reads the same cluster file.
      systemd.services.dspark-wait-worker = {
        environment = unitEnvironment;
        serviceConfig = {
          User = "dspark";
          Group = "dspark";
        };
      };
      systemd.services.dspark-dashboard = mkIf cfg.dashboard.enable {
        wantedBy = [ "multi-user.target" ];
        environment = unitEnvironment;
        serviceConfig = secretServiceConfig // {
          User = "dspark";
          Group = "dspark";
        };
      };
      networking.firewall.allowedTCPPorts = mkIf cfg.openFirewall [ self.api_port ];
    })

    (mkIf (known && !isHead) {
      systemd.services.dspark-worker = mainUnit;
    })

    (mkIf (cfg.openFirewall && known) (
      let
        fabric = self.socket_ifname;
      in
      {
        networking.firewall.trustedInterfaces = mkIf (fabric != null) [ fabric ];
        networking.firewall.allowedTCPPorts = mkIf (fabric == null) (
          [ self.agent_port ] ++ optional isHead self.master_port
        );
        warnings = optional (fabric == null) "services.dspark.openFirewall: node \"${cfg.node}\" has no socket_ifname, so only the rendezvous and agent ports are open; NCCL and Gloo pick their ports at run time and need the fabric interface trusted (set socket_ifname).";
      }
    ))
  ]);
}
