"""Replay nix/runtime.nix's build of the GB10 runtime without nixpkgs, and report what would stop it.

    python3 -m nix.replay_runtime --cache ~/.cache/dspark/runtime-wheels    # about 4 GB the first time
    python3 -m nix.replay_runtime --line v0.32.0 --cache ...                # another runtime line

It reads what the Nix build of a runtime line reads (the line in src/dspark/data/runtime_lines.toml,
as nix/lines.nix does: its lock, nix/runtime-lock.json for the default line, and its overlay
series; nix/runtime-build.json for every line), then:
1. fetches every locked wheel by name, version and sha256 into the cache directory (pip, with
   --require-hashes, for the nodes' platform), and installer itself at the release nixpkgs has;
2. makes the prefix a venv of this machine's Python, as runtime.nix does with the store's CPython,
   and installs the wheels with `python -m installer` in the lock's order with the same flags,
   removing what runtime-build.json removes after each package;
3. reports: files two wheels both install (installer refuses to overwrite); every DT_NEEDED of
   every ELF object that neither the prefix, nor the nixpkgs libraries runtime-build.json lists,
   nor the named driver libraries provide (what autoPatchelf stops on); modules that are only
   importable through a .pth file and that the prefix's interpreter does not put on sys.path;
   objects whose load segments glibc would refuse, as installed or (when the build strips)
   after `strip -S`; and every library an object names in its strings (a `dlopen` argument:
   NCCL's "libibverbs.so.1") or its .note.dlopen table without listing it as DT_NEEDED, unless
   it resolves through the RPATH autoPatchelf gives that object, is glibc's, is the driver's
   (on /run/opengl-driver/lib and the wrappers' LD_LIBRARY_PATH), or runtime-build.json lists
   it in dlopen_absent with the reason;
4. applies the line's overlay series to the installed vLLM with nix/apply-overlay.py, as the build
   does, and reports a patch that does not apply.
Exit status: 0 clean, 1 any problem above, 2 bad input (nothing fetched, a wrong hash, no tool).
Standard library only; x86_64 or aarch64 host.

How it is run: `python3 -m nix.replay_runtime` from the repository's root, where the commands above
(and every caller: the docs, tests/nix) run it. `-m` puts the current directory on sys.path (unless
-P or PYTHONSAFEPATH says not to), and nix/ has no __init__.py, so `nix` is a namespace package and
this folder a regular package in it: the modules import each other relatively (`from .plan import
...`), with no change to sys.path and nothing set in the environment (the replay's own subprocesses
see the caller's environment, as before). Paths on the command line are taken from the current
directory, as any command's are. Not `python3 nix/replay_runtime`: a folder run as a script is not
a package (its relative imports fail). The tests import the modules from the folder itself
(tests/nix/nix_support.py's load_package).

The modules, from the bottom:
- plan: the data the .nix files read (the runtime line, its lock, runtime-build.json), and the
  one error (ReplayError: bad input or a missing tool, one line and exit status 2);
- elf: the ELF reader (header, load segments, dynamic section, .note.dlopen, library names held as
  strings);
- wheels: the fetch into the cache, and the install and overlay steps as runtime.nix runs them;
- checks: what would stop the build or the runtime (unresolved DT_NEEDED, run-time loads, load
  segments before and after strip, .pth imports);
- main: the replay in order, its report, and the command line (__main__ runs it).
"""
