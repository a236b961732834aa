# Sourced by the runtime's bin/vllm wrapper before Python starts (bash):
#   source driver-libs.sh "LIBRARIES" "SEARCH_DIRS" "GLOBS"
# (three space-separated lists from nix/runtime-build.json). The store's Python and glibc do not
# search the host's library directories, and vLLM loads libnvidia-ml.so.1 by its bare name (then,
# without it, silently finds no CUDA platform). So: find the first directory holding every one of
# LIBRARIES ($DSPARK_DRIVER_LIB_DIR if set, else SEARCH_DIRS: NixOS's /run/opengl-driver/lib,
# then the Ubuntu driver's directories of DGX OS), link the driver's own files (GLOBS) from it into
# a directory of their own and put only that on LD_LIBRARY_PATH (the host's other libraries, its
# libstdc++ for one, must not shadow the store's), or say which file was looked for where and exit
# before vLLM starts.

_dspark_driver_libs() {
  local -a libs dirs globs
  read -r -a libs <<<"$1"
  read -r -a dirs <<<"$2"
  read -r -a globs <<<"$3"
  if [ -n "${DSPARK_DRIVER_LIB_DIR:-}" ]; then
    dirs=("$DSPARK_DRIVER_LIB_DIR")
  fi
  local dir lib found=""
  for dir in "${dirs[@]}"; do
    found=$dir
    for lib in "${libs[@]}"; do
      if [ ! -e "$dir/$lib" ]; then
        found=""
        break
      fi
    done
    [ -n "$found" ] && break
  done
  if [ -z "$found" ]; then
    {
      echo "dspark-runtime: the NVIDIA driver's libraries were not found, so vLLM would find no GPU."
      for lib in "${libs[@]}"; do
        echo "  looked for $lib in: ${dirs[*]}"
      done
      echo "  On NixOS, enable the NVIDIA driver (hardware.nvidia; the GB10's: the nixos-dgx-spark"
      echo "  hardware module) so that it is in /run/opengl-driver/lib; on DGX OS, install NVIDIA's"
      echo "  driver packages; or set DSPARK_DRIVER_LIB_DIR to the directory that holds them."
    } >&2
    exit 1
  fi
  # One directory per driver installation (its directory and files), made once and renamed into
  # place, so that a head and a worker starting together on one host never see it half made.
  local base="${DSPARK_DRIVER_LINK_DIR:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/dspark-runtime}"
  local -a files=()
  local glob f
  shopt -s nullglob
  for glob in "${globs[@]}"; do
    for f in "$found"/$glob; do
      files+=("$f")
    done
  done
  shopt -u nullglob
  local key
  key=$({ echo "$found"; for f in "${files[@]}"; do echo "$f $(readlink -f "$f")"; done; } | cksum | cut -d' ' -f1)
  local linkdir="$base/driver-libs-$key"
  if [ ! -d "$linkdir" ]; then
    mkdir -p "$base"
    local tmp
    tmp=$(mktemp -d "$base/.driver-libs.XXXXXX") || exit 1
    for f in "${files[@]}"; do
      ln -s "$f" "$tmp/${f##*/}"
    done
    # Triton links its launchers with -lcuda.
    [ -e "$tmp/libcuda.so" ] || ln -s "$found/libcuda.so.1" "$tmp/libcuda.so"
    mv -T "$tmp" "$linkdir" 2>/dev/null || rm -rf "$tmp"
  fi
  export LD_LIBRARY_PATH="$linkdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export TRITON_LIBCUDA_PATH="${TRITON_LIBCUDA_PATH:-$linkdir}"
}
_dspark_driver_libs "$@"
unset -f _dspark_driver_libs
