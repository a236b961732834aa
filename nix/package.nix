# The dspark CLI, with the systemd units it renders installed under lib/systemd/system.
{
  lib,
  python3Packages,
}:
let
  project = (lib.importTOML ../pyproject.toml).project;
  python = python3Packages.python;
in
python3Packages.buildPythonApplication {
  pname = project.name;
  inherit (project) version;
  pyproject = true;

  src = lib.fileset.toSource {
    root = ../.;
    fileset = lib.fileset.unions [
      ../pyproject.toml
      ../src
      (lib.fileset.maybeMissing ../README.md)
    ];
  };

  build-system = [ python3Packages.setuptools ];
  dependencies = with python3Packages; [
    click
    httpx
    prometheus-client
  ];

  # The unit files come from dspark itself (one source for their text); they read the node
  # and the cluster file from DSPARK_NODE / DSPARK_CONFIG, which the NixOS module sets.
  postInstall = ''
    PYTHONPATH="$out/${python.sitePackages}:$PYTHONPATH" ${python.interpreter} \
      -c 'import sys; from dspark.cli import main; sys.exit(main())' \
      systemd render --out "$out/lib/systemd/system" --dspark-bin "$out/bin/dspark"
  '';

  pythonImportsCheck = [ "dspark" ];

  meta = {
    description = project.description;
    license = lib.licenses.mit;
    mainProgram = "dspark";
    platforms = lib.platforms.linux;
  };
}
