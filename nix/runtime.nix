# The GB10 runtime of one runtime line (nix/lines.nix; by default the default line, vLLM 0.28.0):
# CPython 3.12 with the line's vLLM (torch 2.13.0, CUDA 13), FlashInfer, b12x and the rest of
# vLLM's closure, from the wheels pinned in the line's lock, with the line's overlay series applied
# to vLLM's sources. aarch64-linux only: the locks are resolved for the nodes.
#
# How the wheels are installed (interpreter, installer flags, order, files removed, the nixpkgs
# libraries added, the driver libraries left to the host, stripping) is data in
# runtime-build.json, which nix/replay_runtime replays without nixpkgs: change it there.
{
  lib,
  pkgs,
  stdenv,
  fetchPypi,
  autoPatchelfHook,
  addDriverRunpath,
  makeWrapper,
  cudaPackages_13,
  # One entry of nix/lines.nix: the line's lock and overlay series.
  runtimeLine ? (import ./lines.nix).defaultLine,
}:
let
  lock = lib.importJSON runtimeLine.lock;
  build = lib.importJSON ./runtime-build.json;
  python = pkgs.${build.python};
  site = "lib/python${python.pythonVersion}/site-packages";
  vllm = lib.findFirst (p: p.name == "vllm") (throw "${toString runtimeLine.lock} has no vllm") lock.packages;
  wheel = entry: fetchPypi (import ./wheel-source.nix entry);
  fromPkgs = path: lib.getAttrFromPath (lib.splitString "." path) pkgs;
  # glibc comes with stdenv; the others are added as buildInputs for autoPatchelf.
  hostLibraries = map (l: fromPkgs l.attr) (lib.filter (l: !(l.in_stdenv or false)) build.host_libraries);
  removals = lib.foldl' (acc: r: acc // { ${r.package} = (acc.${r.package} or [ ]) ++ r.paths; }) { } build.remove_after_install;
  pyvenvCfg = lib.replaceStrings [ "@pythonBin@" "@pythonVersion@" ] [ "${python}/bin" python.version ] (
    lib.concatLines build.pyvenv_cfg
  );
  installer = "${python.pkgs.installer}/${python.sitePackages}";
  installWheel = p: ''
    PYTHONPATH=${installer} "$out/bin/python" -m installer ${lib.escapeShellArgs build.installer_flags} --prefix "$out" ${wheel p}
  '' + lib.concatMapStrings (rel: ''
    rm -- "$out/${site}/${rel}"
  '') (removals.${p.name} or [ ]);
  # The JIT toolchain, in the closure: Triton builds its launchers with a C compiler, FlashInfer
  # 0.6.16.post3 compiles its kernels with nvcc (CUDA 13, as torch's cu13 build) and the host
  # compiler that release of nvcc supports.
  cuda = cudaPackages_13.cudatoolkit;
  cc = cudaPackages_13.backendStdenv.cc;
  # Sourced by bin/vllm before Python starts: finds libcuda.so.1 and libnvidia-ml.so.1 on NixOS
  # and on DGX OS, or says which file it looked for where and exits.
  driverLibs = lib.escapeShellArgs [
    "${./driver-libs.sh}"
    (toString build.driver_libraries)
    (toString build.driver_search_dirs)
    (toString build.driver_library_globs)
  ];
  # dspark's overlay applier (standard library only), run through apply-overlay.py on the line's
  # series (each patch its own store path: a line's runtime changes only with its own patches).
  overlayTool = builtins.path {
    name = "dspark-overlay-tool";
    path = ../src;
    filter =
      path: _:
      lib.elem (lib.removePrefix "${toString ../src}/" (toString path)) [
        "dspark"
        "dspark/__init__.py"
        "dspark/lines"
        "dspark/lines/__init__.py"
        "dspark/lines/overlay.py"
      ];
  };
in
stdenv.mkDerivation {
  pname = "dspark-runtime";
  version = vllm.version;
  dontUnpack = true;
  dontConfigure = true;
  dontBuild = true;
  # runtime-build.json's strip_why: strip misaligned the load segments of bundled aarch64 libraries.
  dontStrip = !build.strip;

  nativeBuildInputs = [
    autoPatchelfHook
    makeWrapper
  ];
  buildInputs = hostLibraries;
  autoPatchelfIgnoreMissingDeps = build.driver_libraries;
  # autoPatchelf sets each object's RPATH to the directories of its resolved DT_NEEDED plus
  # these, on every object. Libraries that objects dlopen by soname without naming them
  # DT_NEEDED are found only here: the driver's, the host libraries runtime-build.json marks
  # append_runpath (rdma-core: NCCL dlopens libibverbs and libmlx5), and its append_runpaths
  # ($ORIGIN: cuDNN, nvrtc, cuBLASLt dlopen libraries beside them). A patchelf in postFixup
  # would be undone: stdenv runs postFixup before the postFixupHooks, where autoPatchelf runs.
  appendRunpaths = [
    "${addDriverRunpath.driverLink}/lib"
  ]
  ++ map (l: "${lib.getLib (fromPkgs l.attr)}/lib") (lib.filter (l: l.append_runpath or false) build.host_libraries)
  ++ map (e: e.path) (build.append_runpaths or [ ]);

  # A venv of the store's CPython (runtime-build.json's pyvenv_why): the entry points' shebangs
  # name $out/bin/python, which reads the .pth files of $out's site-packages.
  installPhase = ''
    runHook preInstall
    mkdir -p "$out/bin"
    ln -s ${python.interpreter} "$out/bin/python"
    ln -s python "$out/bin/python3"
    cat > "$out/pyvenv.cfg" <<'EOF'
    ${pyvenvCfg}EOF
    ${lib.concatMapStrings installWheel lock.packages}
    PYTHONPATH=${overlayTool} "$out/bin/python" ${./apply-overlay.py} --vllm-version ${runtimeLine.vllm} \
      "$out/${site}" ${lib.escapeShellArgs (map (p: "${p.path}") runtimeLine.series)}
    runHook postInstall
  '';

  # The JIT caches go where the units point them (TRITON_CACHE_DIR, FLASHINFER_WORKSPACE_BASE,
  # ... under CacheDirectory=, see src/dspark/units/render.py); the wrapper only adds the toolchain.
  postFixup = ''
    for prog in "$out"/bin/*; do
      case "''${prog##*/}" in python | python3) continue ;; esac
      [ -f "$prog" ] && [ -x "$prog" ] || continue
      extra=()
      if [ "''${prog##*/}" = vllm ]; then extra=(--run "source ${driverLibs}"); fi
      wrapProgram "$prog" \
        --prefix PATH : "$out/bin:${lib.makeBinPath [ cc cuda ]}" \
        --set-default CUDA_HOME ${cuda} \
        --set-default CC ${cc}/bin/cc \
        --set-default CXX ${cc}/bin/c++ \
        "''${extra[@]}"
    done
  '';

  passthru = {
    inherit python lock build cuda cc runtimeLine;
  };

  meta = {
    description = "vLLM ${vllm.version} runtime (dspark runtime line ${runtimeLine.id}) for NVIDIA GB10 (SM121) with the dspark overlay";
    platforms = [ "aarch64-linux" ];
    mainProgram = "vllm";
    # torch, CUDA, cuDNN and NCCL wheels carry NVIDIA's licences.
    license = lib.licenses.unfree;
  };
}
