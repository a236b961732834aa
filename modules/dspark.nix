# services.dspark: one node of a dspark cluster (DeepSeek V4 Flash on GB10 nodes: a pair with
# TP=2, or a ring of more).
#
# Every host imports this module with the same `settings` (the cluster file) and differs only
# in `node`: a host is one node. The unit files come from the dspark package (`dspark systemd
# render`); this module installs them, enables the ones for this host's role and gives them
# their environment. The head's dspark-wait-worker reads the cluster file and waits for every
# worker listed there, so N workers need nothing more than N entries in `settings.nodes`.
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
  nodeCount = lib.length nodes;
  # Ranks run 0..n-1 without a gap: each one missing below the highest given is named.
  missingRanks = lib.filter (r: !(lib.elem r ranks)) (
    lib.range 0 (lib.foldl' lib.max (nodeCount - 1) ranks)
  );
  # The parallelism the serving settings ask for, in nodes (the check of src/dspark/config.py).
  serving = cfg.settings.serving;
  gpusWanted = serving.tensor_parallel_size * serving.pipeline_parallel_size;
  nodesWanted = gpusWanted / serving.gpus_per_node;
  parallelism = "tensor_parallel_size ${toString serving.tensor_parallel_size} x pipeline_parallel_size ${toString serving.pipeline_parallel_size} = ${toString gpusWanted} GPUs";
  plural = n: word: "${toString n} ${word}${lib.optionalString (n != 1) "s"}";
  rankList = rs: lib.concatMapStringsSep ", " toString rs;
  parallelismMessage =
    if lib.mod gpusWanted serving.gpus_per_node != 0 then
      "services.dspark.settings.serving: ${parallelism}, which is not a whole number of nodes of gpus_per_node = ${toString serving.gpus_per_node}; make tensor_parallel_size x pipeline_parallel_size = nodes x gpus_per_node."
    else if nodesWanted > nodeCount then
      "services.dspark.settings.nodes: ${plural (nodesWanted - nodeCount) "node"} missing: ${parallelism} need ${plural nodesWanted "node"} of gpus_per_node = ${toString serving.gpus_per_node}, and settings.nodes has ${toString nodeCount}; add the nodes of rank ${rankList (lib.range nodeCount (nodesWanted - 1))} (or lower tensor_parallel_size)."
    else
      "services.dspark.settings.nodes: ${plural (nodeCount - nodesWanted) "node"} too many: ${parallelism} need ${plural nodesWanted "node"} of gpus_per_node = ${toString serving.gpus_per_node}, and settings.nodes has ${toString nodeCount}; remove the nodes of rank ${rankList (lib.range nodesWanted (nodeCount - 1))} (or raise tensor_parallel_size).";
  byName = lib.listToAttrs (map (n: lib.nameValuePair n.name n) nodes);
  self = byName.${cfg.node} or null;
  known = self != null;
  isHead = known && self.rank == 0;
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
          # Four nodes: four entries (ranks 0..3) and serving.tensor_parallel_size = 4.
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
              # Read by the assertions: tensor_parallel_size x pipeline_parallel_size must equal
              # the nodes' GPUs. Defaults are those of src/dspark/config.py.
              options.tensor_parallel_size = mkOption {
                type = types.ints.positive;
                default = 2;
                description = "Tensor parallel size: nodes x GPUs per node (2 for a pair of GB10 nodes, 4 for four).";
              };
              options.pipeline_parallel_size = mkOption {
                type = types.ints.positive;
                default = 1;
                description = "Pipeline parallel size.";
              };
              options.gpus_per_node = mkOption {
                type = types.ints.positive;
                default = 1;
                description = "GPUs on each node (one GB10 per DGX Spark).";
              };
            };
          };
          nodes = mkOption {
            type = types.listOf (types.submodule nodeModule);
            default = [ ];
            description = "One entry per node (`[[nodes]]`), ranks 0..n-1; rank 0 is the head, every other node a worker the head waits for.";
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
        Start this host's unit at boot. The head waits for every worker on its own
        (`dspark-worker-ready.target`), so the hosts may boot in any order.
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
          assertion = nodes == [ ] || gpusWanted == nodeCount * serving.gpus_per_node;
          message = parallelismMessage;
        }
      ]
      # One assertion per problem, each naming its rank or node.
      ++ map (r: {
        assertion = false;
        message = "services.dspark.settings.nodes: rank ${toString r} has no node; ranks run 0..${toString (nodeCount - 1)} without a gap (rank 0 is the head), one per node; got ${rankList ranks}.";
      }) missingRanks
      ++ map (r: {
        assertion = false;
        message = "services.dspark.settings.nodes: rank ${toString r} is given to more than one node (${lib.concatStringsSep ", " (map (n: n.name) (lib.filter (n: n.rank == r) nodes))}); ranks must be unique.";
      }) (duplicates ranks)
      ++ map (n: {
        assertion = false;
        message = "services.dspark.settings.nodes: ${if n.rank == 0 then "the head" else "worker"} \"${n.name}\" (rank ${toString n.rank}) has no address; set its fabric address (every node reads the whole file, and the head reaches each worker's agent there).";
      }) (lib.filter (n: n.address == null) nodes)
      ++ [
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
      # The head's dspark-worker-ready.target requires this oneshot, which waits for every
      # worker's agent listed in the same cluster file (one host per node: all are remote).
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
