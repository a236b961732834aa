"""The locked wheels the runtime replays of CI read, in one place, and their fetch.

    .venv/bin/python -m tests.nix.replay_wheels          # fetch what is missing; safe to run again
    .venv/bin/python -m tests.nix.replay_wheels --check  # exit 0 if all are cached (hash-checked), else 1

tests/nix/test_replay.py and test_runtime_loads.py replay nix/runtime.nix's build on small sets
of the default line's locked aarch64 wheels: the ones whose installation or run-time loading
broke the Nix build or could (NCCL, NVSHMEM, the CUTLASS DSL, torch and the CUDA libraries it
loads, numpy's OpenBLAS, the two wheels that both install build_backend.py). Together about
2.7 GB, fetched by name, version and sha256 (nix/replay_runtime/wheels.py's fetch: pip with
--require-hashes, for the nodes' platform) into $DSPARK_WHEEL_CACHE, else the replay's default
cache. The full replays of each line (tests/nix/test_replay.py, test_replay_lines.py) need every
locked wheel (about 3.9 GB a line) and some 3 to 4 minutes each; they run only where a developer
has filled the cache (`python3 -m nix.replay_runtime`).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from tests.nix.nix_support import load_package  # noqa: E402

# The replay's package and its modules: rr.plan, rr.wheels, rr.elf, rr.checks.
rr = load_package("replay_runtime", "nix/replay_runtime")
WHEELS, BUILD = rr.plan.load_plan()
BY_NAME = {w.name: w for w in WHEELS}
# Absolute: the tests run the replay's command in the repository's root.
CACHE = Path(os.environ.get("DSPARK_WHEEL_CACHE") or rr.plan.DEFAULT_CACHE).absolute()

# Each replay test's wheels (names in the default line's lock), the test named beside them.
SETS = {
    # test_build_backend_clash_reproduced_and_fixed
    "build_backend.py clash": ("flashinfer-python", "torch-c-dlpack-ext"),
    # test_nvshmem_plugins_needing_mpi_ucx_libfabric_reproduced_and_fixed
    "NVSHMEM": ("nvidia-nvshmem-cu13",),
    # test_cutlass_dsl_pth_reproduced_with_pythonpath_and_fixed_by_the_venv
    "CUTLASS DSL": ("nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-core"),
    # test_strip_misaligns_openblas_and_gfortran_reproduced_and_fixed
    "numpy": ("numpy",),
    # test_runtime_loads.py: test_locked_nccl_dlopens_ibverbs_and_mlx5_and_the_build_now_resolves_them
    "NCCL": ("nvidia-nccl-cu13",),
    # test_torch_and_the_cuda_libraries_it_loads_resolve_at_run_time: torch and the CUDA
    # libraries of its requirements (cuda-toolkit's extras, cuDNN, cuSPARSELt, NCCL, NVSHMEM).
    "torch": ("torch", "cuda-toolkit", "nvidia-cublas", "nvidia-cuda-runtime", "nvidia-cufft", "nvidia-cufile",
              "nvidia-cuda-cupti", "nvidia-curand", "nvidia-cusolver", "nvidia-cusparse", "nvidia-nvjitlink",
              "nvidia-cuda-nvrtc", "nvidia-nvtx", "nvidia-cudnn-cu13", "nvidia-cusparselt-cu13",
              "nvidia-nccl-cu13", "nvidia-nvshmem-cu13"),
}

# torchcodec is left out of the lock (runtime-lock.json "excluded"), so it has no locked file:
# test_torchcodec_needs_ffmpeg_and_is_left_out shows why on this one. It is what pip picked for
# vLLM 0.28.0's `torchcodec>=0.14` on the nodes' platform when this was written; the hash is
# the file's own.
TORCHCODEC = rr.plan.Wheel("torchcodec", "0.17.0",
                           "torchcodec-0.17.0-cp312-cp312-manylinux_2_27_aarch64.manylinux_2_28_aarch64.whl",
                           "81655cf25e168e74f27aee29db9fc16e37a9f5b2a188a0f7fe25cdfaab2ddd2e")


def wheels_of(*names: str) -> list:
    """The locked wheels of these packages, in the lock's order (runtime.nix's install order)."""
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise KeyError(f"not in the default line's lock: {', '.join(unknown)}")
    return [w for w in WHEELS if w.name in names]


def subset() -> list:
    """Every wheel the CI replays read: each set's, the installer the build uses, torchcodec."""
    names = {n for group in SETS.values() for n in group}
    return [*wheels_of(*names), rr.plan.installer_wheel(BUILD), TORCHCODEC]


def fetch_all(cache: Path = CACHE, log=lambda msg: print(msg, flush=True)) -> None:
    """Fetch what is missing, set by set, saying what each took; a cached file is hash-checked."""
    started = time.monotonic()
    groups = [(name, wheels_of(*names)) for name, names in SETS.items()]
    groups.append(("installer and torchcodec", [rr.plan.installer_wheel(BUILD), TORCHCODEC]))
    for name, wheels in groups:
        t0 = time.monotonic()
        missing = rr.wheels.missing_from_cache(cache, wheels) if cache.is_dir() else wheels
        if missing:
            rr.wheels.fetch(cache, wheels, offline=False, log=lambda _: None)
        size = sum((cache / w.filename).stat().st_size for w in wheels)
        said = f"fetched {len(missing)}" if missing else "all cached"
        log(f"  {name}: {len(wheels)} wheels, {size / 1e6:.0f} MB, {said} ({time.monotonic() - t0:.1f} s)")
    total = sum((cache / w.filename).stat().st_size for w in subset())
    log(f"{len(subset())} wheels, {total / 1e9:.2f} GB in {cache} ({time.monotonic() - started:.0f} s)")


def main(argv: list[str]) -> int:
    if argv not in ([], ["--check"]):
        print("usage: replay_wheels.py [--check]", file=sys.stderr)
        return 2
    try:
        if argv == ["--check"]:
            return 1 if not CACHE.is_dir() or rr.wheels.missing_from_cache(CACHE, subset()) else 0
        fetch_all()
    except rr.plan.ReplayError as e:
        print(f"replay_wheels: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
