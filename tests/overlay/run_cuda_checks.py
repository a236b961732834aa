"""Run the overlay's torch-level checks on CUDA tensors, without vLLM.

Loads ``vllm/utils/spark_sm12x.py`` straight out of overlay/0001 (the module
imports only torch), runs tensor_checks on ``cuda`` and prints a JSON report
(device, torch version, per-check result).

    python3 tests/overlay/run_cuda_checks.py [OUT_DIR]
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
PATCH = HERE.parents[1] / "overlay" / "0001-spark-sm12x-helpers.patch"
MODULE = "vllm/utils/spark_sm12x.py"


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


def load_module(directory: Path):
    source = directory / "spark_sm12x.py"
    source.write_text(added_file(PATCH, MODULE))
    spec = importlib.util.spec_from_file_location("spark_sm12x", source)
    module = importlib.util.module_from_spec(spec)
    sys.modules["spark_sm12x"] = module  # dataclasses look the module up
    spec.loader.exec_module(module)
    return module


def main() -> int:
    assert torch.cuda.is_available(), "no CUDA device"
    sys.path.insert(0, str(HERE))
    from tensor_checks import run_all

    with tempfile.TemporaryDirectory() as tmp:
        m = load_module(Path(tmp))
        results = run_all(m, "cuda")
        report = {
            "device": torch.cuda.get_device_name(0),
            "capability": list(torch.cuda.get_device_capability(0)),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "results": results,
        }
    text = json.dumps(report, indent=2)
    print(text)
    if len(sys.argv) > 1:
        Path(sys.argv[1], "cuda_checks.json").write_text(text + "\n")
    return 0 if all(v == "ok" for v in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
