# The arguments nixpkgs' fetchPypi needs for one entry of runtime-lock.json. fetchPypi rebuilds
# the wheel's file name as pname-version-python-abi-platform.whl and knows where PyPI keeps it,
# so the lock holds no URL: the file name is split back into those parts here. Pure (builtins
# only), so the tests can check that every locked file name round-trips.
entry:
let
  # PEP 427 without a build tag; none of the locked wheels has one.
  parts = builtins.match "([^-]+)-([^-]+)-([^-]+)-([^-]+)-([^-]+)[.]whl" entry.filename;
  part = builtins.elemAt parts;
in
if parts == null then
  throw "runtime-lock.json: ${entry.filename} is not a wheel file name this lock supports"
else
  {
    pname = part 0;
    version = part 1;
    format = "wheel";
    # The first path segment of PyPI's per-file URL is the wheel's python tag.
    dist = part 2;
    python = part 2;
    abi = part 3;
    platform = part 4;
    sha256 = entry.sha256;
  }
