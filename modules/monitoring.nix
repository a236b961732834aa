# services.dspark.prometheus and services.dspark.grafana: the path into the monitoring a NixOS owner
# already runs (docs/monitoring.md). Imported by ./dspark.nix.
#
# Both read `services.dspark.settings` (the cluster file) alone, not `services.dspark.enable`: a
# Prometheus or Grafana host that is no node of the cluster imports the module with the cluster's
# settings, leaves `enable` off and turns these on.
#
# The scrape configuration is the same as src/dspark/monitoring.py's scrape_configs for the same
# cluster file (tests/nix/test_module_prometheus.py compares the two); the dashboard is the JSON
# that module writes (src/dspark/data/grafana/dspark.json).
{
  config,
  lib,
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
  prom = cfg.prometheus;

  nodes = lib.sort (a: b: a.rank < b.rank) cfg.settings.nodes;
  heads = lib.filter (n: n.rank == 0) nodes;
  # host:port a scraper reaches: the address the service binds, the fabric address for a wildcard bind.
  target =
    bind: node: port:
    let
      host = if bind == null || bind == "0.0.0.0" || bind == "::" then node.address else bind;
    in
    if host == null then
      throw "services.dspark.prometheus: node \"${node.name}\" has no address in services.dspark.settings.nodes"
    else if lib.hasInfix ":" host then
      "[${host}]:${toString port}"
    else
      "${host}:${toString port}";
  labels = n: {
    node = n.name;
    rank = toString n.rank;
    role = if n.rank == 0 then "head" else "worker";
  };
  vllmJob =
    head:
    {
      job_name = "dspark-vllm";
      metrics_path = "/metrics";
      scrape_interval = prom.scrapeInterval;
      static_configs = [
        {
          targets = [ (target (head.api_host or null) head head.api_port) ];
          labels = labels head;
        }
      ];
    }
    // lib.optionalAttrs (prom.apiKeyFile != null) {
      authorization = {
        type = "Bearer";
        credentials_file = prom.apiKeyFile;
      };
    };
  agentJob = {
    job_name = "dspark-agent";
    metrics_path = "/metrics";
    scrape_interval = prom.scrapeInterval;
    # The agent's samples carry node, rank and role themselves: keep theirs.
    honor_labels = true;
    static_configs = map (n: {
      targets = [ (target (n.agent_host or null) n n.agent_port) ];
      labels = labels n;
    }) nodes;
  };
  scrapeConfigs = map vllmJob (lib.take 1 heads) ++ optional (nodes != [ ]) agentJob;
in
{
  options.services.dspark = {
    prometheus = {
      enable = mkEnableOption "scraping the cluster from this host: `scrapeConfigs` added to `services.prometheus.scrapeConfigs`";
      scrapeInterval = mkOption {
        type = types.str;
        default = "15s";
        description = "How often Prometheus scrapes vLLM and the agents (each job's `scrape_interval`).";
      };
      apiKeyFile = mkOption {
        type = types.nullOr types.str;
        default = null;
        example = "/run/secrets/dspark-prometheus-key";
        description = ''
          A file the Prometheus server can read (user `prometheus`) holding the head's API key.
          Where the head has a key, vLLM's /metrics answers 401 without it (dspark's API guard
          covers every route but /health); job dspark-vllm then sends it as a bearer token.
        '';
      };
      scrapeConfigs = mkOption {
        type = types.listOf types.attrs;
        readOnly = true;
        default = scrapeConfigs;
        defaultText = literalExpression "the jobs dspark-vllm and dspark-agent of services.dspark.settings";
        description = ''
          Prometheus' scrape configuration of the cluster in `settings`, in the form of
          `services.prometheus.scrapeConfigs`: job `dspark-vllm` (the head's vLLM /metrics, at its
          `api_host` or fabric address) and job `dspark-agent` (every node's agent /metrics, at its
          `agent_host` or fabric address), each target labelled node, rank and role.
          `prometheus.enable` adds them on this host; otherwise use them where you like.
        '';
      };
    };

    grafana = {
      provision = mkEnableOption "the dspark Grafana dashboard on this host, provisioned from `grafana.dashboards` through `services.grafana.provision`";
      dashboards = mkOption {
        type = types.path;
        readOnly = true;
        default = ../src/dspark/data/grafana;
        defaultText = literalExpression "<dspark>/src/dspark/data/grafana";
        description = "The folder holding the dspark dashboard (`dspark.json`), for a Grafana dashboard provider's `options.path`. Its queries read the Prometheus data source picked on the dashboard.";
      };
    };
  };

  config = mkMerge [
    (mkIf prom.enable {
      services.prometheus.scrapeConfigs = prom.scrapeConfigs;
      warnings =
        optional (cfg.apiKeyFile != null && prom.apiKeyFile == null)
          "services.dspark.prometheus: the head has an API key (services.dspark.apiKeyFile), so vLLM's /metrics answers 401 to Prometheus without it; set services.dspark.prometheus.apiKeyFile to a copy of the key the prometheus user can read.";
    })
    (mkIf cfg.grafana.provision {
      services.grafana.provision = {
        enable = true;
        dashboards.settings.providers = [
          {
            name = "dspark";
            type = "file";
            options.path = cfg.grafana.dashboards;
          }
        ];
      };
    })
  ];
}
