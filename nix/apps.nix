# `nix run .#dspark` and `nix run .#bench -- ARGS` (`dspark bench ARGS`, e.g. `-- decode`, against
# the head in the cluster file, /etc/dspark/cluster.toml unless DSPARK_CONFIG or --config says
# otherwise; with no ARGS it prints bench's help).
{ writeShellScript, dspark }:
{
  dspark = {
    type = "app";
    program = "${dspark}/bin/dspark";
  };
  bench = {
    type = "app";
    program = "${writeShellScript "dspark-bench" ''exec ${dspark}/bin/dspark bench "$@"''}";
  };
}
