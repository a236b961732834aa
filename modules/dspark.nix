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
  runtimeLines = import ../nix/lines.nix;
  settingsFormat = pkgs.formats.toml { };
  configPath = "/etc/dspark/cluster.toml";

  # The fields the module itself reads (role, ports, addresses) are declared so that they are
  # type-checked; everything else in the cluster file passes through as written. Defaults are
  # those of src/dspark/config/validate.py (a test keeps the two equal).
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
        description = "The node's address on the dedicated fabric (required; `null` only so that a missing address is reported by `dspark config check` when the cluster file is built).";
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
  serving = cfg.settings.serving;
  # The cluster file's own rules (ranks, names, addresses, parallelism, the model path, ...) are
  # not restated here: `dspark config check` runs on the file when it is built (clusterFile).
  byName = lib.listToAttrs (map (n: lib.nameValuePair n.name n) nodes);
  self = byName.${cfg.node} or null;
  known = self != null;
  isHead = known && self.rank == 0;

  # The file both nodes read: null (unset optional fields) is left out, as TOML has no null.
  dropNulls =
    v:
    if lib.isAttrs v then
      lib.mapAttrs (_: dropNulls) (lib.filterAttrs (_: x: x != null) v)
    else if lib.isList v then
      map dropNulls v
    else
      v;
  # Checked by the package's own validator when it is built: a file dspark would refuse fails
  # `nixos-rebuild` with dspark's message, before any unit starts on it.
  uncheckedClusterFile = settingsFormat.generate "cluster-unchecked.toml" (dropNulls cfg.settings);
  clusterFile =
    pkgs.runCommand "cluster.toml"
      {
        nativeBuildInputs = [ cfg.package ];
        passthru.unchecked = uncheckedClusterFile;
      }
      ''
        dspark config check --config ${uncheckedClusterFile}
        cp ${uncheckedClusterFile} "$out"
      '';

  # Runtime lines: every line of `lines` is installed (its command in serving.line_commands, so its
  # runtime is in the system's closure); the nodes run serving.runtime_line's.
  line = serving.runtime_line;
  lineIds = lib.attrNames cfg.lines;
  # A host without `lines` (x86_64, or its own vllm_command) has no line to check here.
  lineKnown = cfg.lines == { } || lib.elem line lineIds;
  lineCommands =
    lib.mapAttrs (_: runtime: [ "${runtime}/bin/vllm" ]) cfg.lines
    # dspark requires the file's own line's entry to be vllm_command (which a host may set itself).
    // lib.optionalAttrs (serving.vllm_command != [ ]) { ${line} = serving.vllm_command; };

  unitEnvironment = {
    DSPARK_NODE = cfg.node;
    DSPARK_CONFIG = configPath;
  };
  wantedBy = optional cfg.autoStart "multi-user.target";
  # Secrets reach the units from outside the store: an environment file (every node's unit) and
  # the API key as the systemd credential `api-key`, which only the head's units read (from
  # $CREDENTIALS_DIRECTORY/api-key): a worker serves no API, and a credential it never reads
  # would still fail its start (243/CREDENTIALS) where the file is missing.
  userConfig = {
    User = "dspark";
    Group = "dspark";
  }
  // lib.optionalAttrs (cfg.environmentFile != null) { EnvironmentFile = cfg.environmentFile; };
  # With SetCredential= as a fallback, systemd starts the unit even where the key file is missing
  # (exec-credential.c: a missing LoadCredential= source is not fatal when SetCredential= has the
  # same name); `dspark serve` then finds this marker and refuses with the file's name
  # (DSPARK_API_KEY_FILE) instead of systemd's bare 243/CREDENTIALS. The marker is
  # dspark.config.credentials.NO_KEY_FILE; systemd 252 ignores an empty SetCredential= value.
  apiKeyConfig = lib.optionalAttrs (cfg.apiKeyFile != null) {
    LoadCredential = "api-key:${cfg.apiKeyFile}";
    SetCredential = "api-key:dspark:no-key-file";
  };
  apiKeyEnvironment = lib.optionalAttrs (cfg.apiKeyFile != null) {
    DSPARK_API_KEY_FILE = cfg.apiKeyFile;
  };
  # A unit of this host's role: started at boot with autoStart, restarted with the cluster file.
  # Its sandbox is the package's unit text (src/dspark/units/render.py: `systemd-analyze security` 1.5,
  # each remaining exposure explained there: CUDA and RDMA devices, JIT, sockets); what is added
  # here (user, environment, credential) relaxes none of it (tests/nix/test_module_hardening.py).
  roleUnit =
    {
      environment ? { },
      serviceConfig ? { },
    }:
    {
      inherit wantedBy;
      environment = unitEnvironment // environment;
      restartTriggers = [ clusterFile ];
      serviceConfig = userConfig // serviceConfig;
    };
  # The head's units get the key: dspark-head serves the API, the dashboard calls it.
  headUnit = roleUnit {
    environment = apiKeyEnvironment;
    serviceConfig = apiKeyConfig;
  };

  # What the firewall must let through between the nodes, and what is left open to clients.
  fabric = if known then self.socket_ifname else null;
  firewallOn = config.networking.firewall.enable;
  fabricTrusted = fabric != null && lib.elem fabric config.networking.firewall.trustedInterfaces;
  onFabric = if fabric != null then "on ${fabric}" else "on its fabric interface (no socket_ifname)";
  fabricPorts =
    lib.optional isHead "the rendezvous port ${toString self.master_port}"
    ++ [ "the agent port ${toString self.agent_port}" ];
  blockedFabricWarning = "services.dspark: the NixOS firewall is on and services.dspark.openFirewall is off, so node \"${cfg.node}\" (${
    if isHead then "the head" else "a worker"
  }) blocks what the other nodes must reach ${onFabric}: ${lib.concatStringsSep ", " fabricPorts} and the NCCL/Gloo ports, which NCCL picks at run time; the cluster cannot form. Set services.dspark.openFirewall = true, or trust the fabric interface yourself (networking.firewall.trustedInterfaces = [ \"${
    if fabric != null then fabric else "<fabric interface>"
  }\" ]).";
  openApiWarning = "services.dspark.openFirewall opens the head's API port ${toString self.api_port} on every interface, and no API key is set (services.dspark.apiKeyFile, or DSPARK_API_KEY in services.dspark.environmentFile): anyone who reaches this host can use the model. Set services.dspark.apiKeyFile, or leave openFirewall off and open the API port only where the clients are.";

  # A file the units read at start, named as a string: an absolute path outside the store (a
  # relative path means nothing to systemd; a path literal would be copied into the store).
  secretFile =
    example: description:
    mkOption {
      type = types.nullOr types.externalPath;
      default = null;
      inherit example description;
    };
in
{
  # services.dspark.prometheus and services.dspark.grafana: the scrape configuration and the dashboard.
  imports = [ ./monitoring.nix ];

  options.services.dspark = {
    enable = mkEnableOption "dspark, one node of a DeepSeek V4 Flash cluster served by vLLM";

    package = mkOption {
      type = types.package;
      description = "The dspark package: its CLI and the systemd units it renders (`nixosModules.default` sets the flake's).";
    };

    lines = mkOption {
      type = types.attrsOf types.package;
      default = { };
      # Via nixosModules.default: every runtime line of the flake, built with this host's pkgs.
      defaultText = literalExpression "{ ${
        lib.concatMapStrings (l: ''"${l.id}" = dspark.packages.aarch64-linux.${l.attr}; '') (lib.attrValues runtimeLines.lines)
      }}";
      example = literalExpression ''{ "${runtimeLines.default}" = dspark.packages.aarch64-linux.${runtimeLines.defaultLine.attr}; }'';
      description = ''
        The runtime lines installed on this host: line id (`src/dspark/data/runtime_lines.toml`)
        to that line's GB10 runtime. Each is written into the cluster file as
        `settings.serving.line_commands.<id> = [ "<runtime>/bin/vllm" ]`, so every line is in the
        system's closure side by side; the nodes run the one `settings.serving.runtime_line` names.
      '';
    };

    runtimePackage = mkOption {
      type = types.nullOr types.package;
      default = cfg.lines.${cfg.settings.serving.runtime_line} or null;
      defaultText = literalExpression "config.services.dspark.lines.\${config.services.dspark.settings.serving.runtime_line}";
      description = ''
        The GB10 runtime (Python with the patched vLLM) the nodes run: by default that of the
        chosen line, `lines.<settings.serving.runtime_line>`. Unless
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
              options.runtime_line = mkOption {
                type = types.str;
                default = runtimeLines.default;
                example = "v0.32.0";
                description = ''
                  The runtime line the nodes run, one of `services.dspark.lines`: the switch between
                  lines on NixOS. Set the same value on every host; the cluster file's
                  `vllm_command` becomes that line's runtime, so a change is a new generation whose
                  activation restarts the node's unit on the new line. Activate the workers first and
                  the head last (`nixos-rebuild switch`); the previous generation is the rollback
                  (`nixos-rebuild switch --rollback`, same order). A pair on two lines refuses to form.
                '';
              };
              options.line_commands = mkOption {
                type = types.attrsOf (types.listOf types.str);
                default = lineCommands;
                defaultText = literalExpression ''
                  lib.mapAttrs (_: runtime: [ "''${runtime}/bin/vllm" ]) config.services.dspark.lines
                  // { ''${runtime_line} = vllm_command; }
                '';
                description = "vLLM's command of each runtime line installed on the nodes (`dspark` runs `line_commands.<runtime_line>`, else `vllm_command`).";
              };
              options.vllm_command = mkOption {
                type = types.listOf types.str;
                default = optional (cfg.runtimePackage != null) "${cfg.runtimePackage}/bin/vllm";
                defaultText = literalExpression ''[ "''${config.services.dspark.runtimePackage}/bin/vllm" ]'';
                description = "The command that runs vLLM's CLI (the argv before `serve`): by default the chosen runtime line's.";
              };
              # Read by the assertions: tensor_parallel_size x pipeline_parallel_size must equal
              # the nodes' GPUs. Defaults are those of src/dspark/config/validate.py.
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

    environmentFile = secretFile "/run/secrets/dspark.env" ''
      A file outside the Nix store (an absolute path, as a string) with `KEY=value` lines for
      every node's unit, for example `DSPARK_API_KEY=...` (or `VLLM_API_KEY`), the key clients
      must present to the head, or `HF_TOKEN`.
    '';

    apiKeyFile = secretFile "/run/secrets/dspark-api-key" ''
      A file outside the Nix store (an absolute path, as a string, readable by root) holding the
      API key clients must present to the head. Only the head's units get it, as the systemd
      credential `api-key`; a worker serves no API. Where the file is missing or empty,
      `dspark serve` on the head refuses to start and names it (exit 2, no restart).
    '';

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
      ]
      ++ [
        {
          # (A runtime_line missing from `lines` leaves no command either: that assertion says why.)
          assertion = cfg.settings.serving.vllm_command != [ ] || !lineKnown;
          message = "services.dspark: no vLLM to run; set services.dspark.lines or runtimePackage (the flake's runtimes, aarch64-linux) or settings.serving.vllm_command.";
        }
        {
          assertion = lineKnown;
          message = "services.dspark.settings.serving.runtime_line = \"${line}\" is not one of services.dspark.lines (known: ${lib.concatStringsSep ", " lineIds}); set it to one of them, or add that line's runtime to services.dspark.lines.";
        }
      ]
      ++ map (id: {
        assertion = false;
        message = "services.dspark.lines.\"${id}\": not a runtime line dspark knows (known: ${lib.concatStringsSep ", " runtimeLines.known}; src/dspark/data/runtime_lines.toml).";
      }) (lib.filter (id: !(lib.elem id runtimeLines.known)) lineIds)
      ++ [
        {
          assertion = !cfg.dashboard.enable || !known || isHead;
          message = "services.dspark.dashboard.enable: the dashboard runs on the head; enable it in the head's configuration.";
        }
      ];

      warnings =
        optional (known && firewallOn && !cfg.openFirewall && !fabricTrusted) blockedFabricWarning
        ++ optional (
          isHead && cfg.openFirewall && cfg.apiKeyFile == null && cfg.environmentFile == null
        ) openApiWarning;

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

    # Every unit file comes from the package (systemd.packages); those of the other role, and
    # those this host does not run, are masked (enable = false: NixOS links them to /dev/null over
    # the package's file), so that starting one by hand says "masked" instead of running a second
    # copy of this host's node under another unit's name. dspark-worker@.service is for a host
    # running several workers, which this module (one node per host) never does.
    (mkIf known {
      systemd.services."dspark-worker@".enable = false;
    })

    (mkIf isHead {
      systemd.services.dspark-head = headUnit;
      # The head's dspark-worker-ready.target requires this oneshot, which waits for every
      # worker's agent listed in the same cluster file (one host per node: all are remote).
      systemd.services.dspark-wait-worker = {
        environment = unitEnvironment;
        serviceConfig = {
          User = "dspark";
          Group = "dspark";
        };
      };
      systemd.services.dspark-dashboard = if cfg.dashboard.enable then headUnit else { enable = false; };
      systemd.services.dspark-worker.enable = false;
      networking.firewall.allowedTCPPorts = mkIf cfg.openFirewall [ self.api_port ];
    })

    (mkIf (known && !isHead) {
      systemd.services.dspark-worker = roleUnit { };
      systemd.services.dspark-head.enable = false;
      systemd.services.dspark-wait-worker.enable = false;
      systemd.services.dspark-dashboard.enable = false;
      systemd.targets.dspark-worker-ready.enable = false;
    })

    (mkIf (cfg.openFirewall && known) {
      networking.firewall.trustedInterfaces = mkIf (fabric != null) [ fabric ];
      networking.firewall.allowedTCPPorts = mkIf (fabric == null) (
        [ self.agent_port ] ++ optional isHead self.master_port
      );
      warnings = optional (fabric == null) "services.dspark.openFirewall: node \"${cfg.node}\" has no socket_ifname, so only the rendezvous and agent ports are open; NCCL and Gloo pick their ports at run time and need the fabric interface trusted (set socket_ifname).";
    })
  ]);
}
