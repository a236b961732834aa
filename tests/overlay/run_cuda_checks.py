"""Run the overlay's torch-level checks on CUDA tensors, without vLLM.

Loads the two helper modules straight out of the patches that create them (each imports
only torch): ``vllm/utils/spark_sm12x.py`` (overlay/0001, tensor_checks) and
``vllm/utils/spark_sm12x_attn.py`` (overlay/0003, attn_tensor_checks), runs their checks on
``cuda`` and prints a JSON report (device, torch, per-check result, host-side cost of the
two per-call attention helpers).

    python3 -m tests.overlay.run_cuda_checks [OUT_DIR]
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
OVERLAY = HERE.parents[1] / "overlay"
# module name -> (the patch that creates it, its path in the vLLM tree)
MODULES = {
    "spark_sm12x": ("0001-spark-sm12x-helpers.patch", "vllm/utils/spark_sm12x.py"),
    "spark_sm12x_attn": ("0003-flashinfer-sm120-bridge.patch", "vllm/utils/spark_sm12x_attn.py"),
}


def added_file(patch: Path, path: str) -> str:
    """Text of a file the patch creates (a new-file hunk: '+' lines only)."""
    lines = patch.read_text().splitlines()
    start = lines.index(f"+++ b/{path}")
    body = []
    for line in lines[start + 2:]:  # skip the @@ line
        if line.startswith("diff --git"):
            break
        if line.startswith("+"):
            body.append(line[1:])
    return "\n".join(body) + "\n"


def load_module(directory: Path, name: str = "spark_sm12x"):
    patch, path = MODULES[name]
    source = Path(directory) / f"{name}.py"
    source.write_text(added_file(OVERLAY / patch, path))
    spec = importlib.util.spec_from_file_location(name, source)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look the module up
    spec.loader.exec_module(module)
    return module


def _time_us(fn, repeats: int = 200) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> int:
    assert torch.cuda.is_available(), "no CUDA device"
    from tests.overlay import attn_tensor_checks, tensor_checks

    with tempfile.TemporaryDirectory() as tmp:
        helpers, attn = load_module(Path(tmp)), load_module(Path(tmp), "spark_sm12x_attn")
        results = {**tensor_checks.run_all(helpers, "cuda"),
                   **{f"attn_{k}": v for k, v in attn_tensor_checks.run_all(attn, "cuda").items()}}
        idx = torch.zeros(60, 1, 192, dtype=torch.int32, device="cuda")
        q = torch.zeros(10, 32, 512, dtype=torch.bfloat16, device="cuda")
        src, keep = attn.uniform_rows(2, 5, 6, torch.device("cuda"))
        report = {
            "device": torch.cuda.get_device_name(0),
            "capability": list(torch.cuda.get_device_capability(0)),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "results": results,
            "pad_192_to_512_us_60_rows": _time_us(lambda: attn.pad_index_width(idx, 512)),
            "gather_2x5_to_2x6_rows_us_q_32x512": _time_us(lambda: q.index_select(0, src)),
        }
    text = json.dumps(report, indent=2)
    print(text)
    if len(sys.argv) > 1:
        Path(sys.argv[1], "cuda_checks.json").write_text(text + "\n")
    return 0 if all(v == "ok" for v in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
