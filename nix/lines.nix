# The runtime lines the flake builds, read from src/dspark/data/runtime_lines.toml (the file
# dspark.lines.runtime reads: one source for the lines, their locks and their overlay series).
# Pure (builtins only), so the tests evaluate it without nixpkgs.
#
# Each line: its id, its vLLM release, its lock, the flake attribute of its runtime and its overlay
# series in order. The series is the line's series file (`series_file`: overlay/series for v0.28.0,
# overlay/lines/<id>/series for a later line), read as dspark.lines.overlay reads it: one patch a line,
# each a path relative to the series file's folder, `#` comments. (A line without `series_file`
# applies its `series.applies` from overlay/.) Each patch becomes a store path of its own, so a
# line's runtime changes only with its own patches. Only a line whose lock is complete
# (`lock_state = "locked"`) gets a runtime.
let
  data = builtins.fromTOML (builtins.readFile ../src/dspark/data/runtime_lines.toml);
  repo = ../.;
  patch = dir: entry: {
    name = baseNameOf entry;
    path =
      if builtins.pathExists (dir + "/${entry}") then
        dir + "/${entry}"
      else
        throw "the series in ${toString dir} names ${entry}, which is not there";
  };
  fromSeriesFile =
    file:
    let
      # A line's patch path, or null for a blank or `#` line.
      entry = l: builtins.match "[[:space:]]*([^#[:space:]][^[:space:]]*)[[:space:]]*" l;
      lines = builtins.filter builtins.isString (builtins.split "\n" (builtins.readFile file));
    in
    map (m: patch (dirOf file) (builtins.head m)) (builtins.filter (m: m != null) (map entry lines));
  line = id: raw: {
    inherit id;
    inherit (raw) vllm;
    # `nix build .#runtime-v0_32_0`: a flake attribute may not hold a dot unquoted on the command line.
    attr = "runtime-" + builtins.replaceStrings [ "." ] [ "_" ] id;
    lock = repo + "/${raw.lock}";
    requirements = repo + "/${raw.requirements}";
    series =
      if raw ? series_file then
        fromSeriesFile (repo + "/${raw.series_file}")
      else
        map (patch (repo + "/overlay")) (raw.series.applies or [ ]);
  };
  locked = builtins.removeAttrs data.lines (
    builtins.filter (id: data.lines.${id}.lock_state != "locked") (builtins.attrNames data.lines)
  );
  lines = builtins.mapAttrs line locked;
in
{
  inherit (data) default;
  inherit lines;
  # Every line dspark knows, locked or not (what `serving.runtime_line` may name).
  known = builtins.attrNames data.lines;
  defaultLine = lines.${data.default};
}
