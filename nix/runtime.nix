# The GB10 runtime: CPython 3.12 with vLLM 0.28.0 (torch 2.13.0, CUDA 13), FlashInfer, b12x and
# the rest of vLLM's closure, from the wheels pinned in runtime-lock.json, with the overlay/
# patch series applied to vLLM's sources. aarch64-linux only: the lock is resolved for the nodes.
{
  lib,
  stdenv,
  fetchPypi,
  python312,
  autoPatchelfHook,
  addDriverRunpath,
  makeWrapper,
  zlib,
  numactl,
  rdma-core,
}:
let
  lock = lib.importJSON ./runtime-lock.json;
  python = python312;
  site = "lib/python${python.pythonVersion}/site-packages";
  vllm = lib.findFirst (p: p.name == "vllm") (throw "runtime-lock.json has no vllm") lock.packages;
  wheel = entry: fetchPypi (import ./wheel-source.nix entry);
  # dspark's overlay applier (standard library only) and the patch series it applies.
  overlayTool = lib.fileset.toSource {
    root = ../src;
    fileset = lib.fileset.unions [ ../src/dspark/__init__.py ../src/dspark/overlay.py ];
  };
in
stdenv.mkDerivation {
  pname = "dspark-runtime";
  version = vllm.version;
  dontUnpack = true;
  dontConfigure = true;
  dontBuild = true;

  nativeBuildInputs = [
    autoPatchelfHook
    makeWrapper
    python.pkgs.installer
  ];
  # What the wheels' shared objects link against beyond each other: libstdc++/libgcc_s,
  # zlib, libnuma (vLLM, NCCL) and libibverbs/librdmacm (NCCL's IB transport over RoCE).
  buildInputs = [
    stdenv.cc.cc.lib
    zlib
    numactl
    rdma-core
  ];
  # The NVIDIA driver's libraries come from the host at run time (/run/opengl-driver/lib on
  # NixOS, see hardware.nvidia); they must not be resolved at build time.
  autoPatchelfIgnoreMissingDeps = [
    "libcuda.so.1"
    "libnvidia-ml.so.1"
  ];
  appendRunpaths = [ "${addDriverRunpath.driverLink}/lib" ];

  installPhase = ''
    runHook preInstall
    mkdir wheels
    ${lib.concatMapStrings (p: ''
      ln -s ${wheel p} wheels/${p.filename}
    '') lock.packages}
    for w in wheels/*.whl; do
      ${python.interpreter} -m installer --prefix "$out" "$w"
    done
    PYTHONPATH=${overlayTool} ${python.interpreter} -m dspark.overlay apply "$out/${site}" \
      --overlay-dir ${../overlay}
    runHook postInstall
  '';

  # Entry points run the store's CPython with the runtime's site-packages; triton finds libcuda
  # through the driver link instead of ldconfig, which NixOS does not populate.
  postFixup = ''
    for prog in "$out"/bin/*; do
      wrapProgram "$prog" \
        --prefix PYTHONPATH : "$out/${site}" \
        --set-default TRITON_LIBCUDA_PATH ${addDriverRunpath.driverLink}/lib
    done
    makeWrapper ${python.interpreter} "$out/bin/python" \
      --prefix PYTHONPATH : "$out/${site}" \
      --set-default TRITON_LIBCUDA_PATH ${addDriverRunpath.driverLink}/lib
  '';

  passthru = {
    inherit python lock;
  };

  meta = {
    description = "vLLM ${vllm.version} runtime for NVIDIA GB10 (SM121) with the dspark overlay";
    platforms = [ "aarch64-linux" ];
    mainProgram = "vllm";
    # torch, CUDA, cuDNN and NCCL wheels carry NVIDIA's licences.
    license = lib.licenses.unfree;
  };
}
