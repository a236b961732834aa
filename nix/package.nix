# The dspark CLI, with the systemd units it renders installed under lib/systemd/system.
{
  lib,
  python3Packages,
}:
let
  project = (lib.importTOML ../pyproject.toml).project;
  python = python3Packages.python;
  # Which of the project's tests the check phase runs (replayed by tests/nix/test_package_tests.py).
  tests = lib.importJSON ./package-tests.json;
in
python3Packages.buildPythonApplication {
  pname = project.name;
  inherit (project) version;
  pyproject = true;

  src = lib.fileset.toSource {
    root = ../.;
    fileset = lib.fileset.unions (map (p: ../. + "/${p}") tests.source);
  };

  build-system = [ python3Packages.setuptools ];
  dependencies = with python3Packages; [
    click
    httpcore
    httpx
    prometheus-client
  ];

  # The unit files come from dspark itself (one source for their text); they read the node
  # and the cluster file from DSPARK_NODE / DSPARK_CONFIG, which the NixOS module sets.
  postInstall = ''
    PYTHONPATH="$out/${python.sitePackages}:$PYTHONPATH" ${python.interpreter} \
      -c 'import sys; from dspark.cli.main import main; sys.exit(main())' \
      systemd render --out "$out/lib/systemd/system" --dspark-bin "$out/bin/dspark"
  '';

  pythonImportsCheck = [ "dspark" ];

  # The tests that need neither vLLM nor the local pair, systemd, Nix or a browser, against
  # the installed package (`nix flake check` runs them through checks.dspark).
  nativeCheckInputs = [ python3Packages.pytestCheckHook ];
  # pytestFlags, not pytestFlagsArray (refused by nixpkgs 26.05). pytestCheckHook adds them with
  # stdenv's concatTo, which splits a plain string on whitespace and takes a bash array as it
  # is: with structured attributes each element is one argument, so the marker expression
  # ("not pair and not ...") reaches pytest whole, as tests/nix/test_package_tests.py runs it.
  __structuredAttrs = true;
  pytestFlags = tests.paths ++ [
    "-p"
    "no:cacheprovider"
    "-m"
    tests.markers
  ];
  disabledTests = tests.disabled;

  meta = {
    description = project.description;
    license = lib.licenses.mit;
    mainProgram = "dspark";
    platforms = lib.platforms.linux;
  };
}
