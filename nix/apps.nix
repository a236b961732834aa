# `nix run .#dspark` and `nix run .#bench` (dspark bench against the head in the cluster file,
# /etc/dspark/cluster.toml unless DSPARK_CONFIG says otherwise).
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
