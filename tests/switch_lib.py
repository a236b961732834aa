"""What the two `dspark switch` test modules share (tests/test_switch_local.py on `local up`,
tests/systemd/test_switch_under_systemd.py under the units): the two real lines, the band the
switches that must be kept are judged with, and the wrapper put in place of the second line's `bin/vllm`, which a mode
file turns into a broken or a slowed install of it."""

from __future__ import annotations

from pathlib import Path

A, B = "v0.28.0", "v0.29.0"
# The switches that must be kept are measured with a wide band: on a shared 2-core host one real
# line's score against the other's swings with the load (-30.3 % against a measured band of
# 21.8 %, then +28.6 % on the next run; a CI run's move back to 0.28.0: -14.4 % against 8.5 %).
# The gate itself is proven on the slowed line (about 8x slower), with the band the runs measure.
WIDE_BAND = ["--min-band", "0.6"]

# MODE (the file `mode` two levels above bin/): ok runs the real vLLM; broken puts a shadow
# `vllm` package that raises ImportError first on PYTHONPATH; slow serves one sequence at a time.
WRAPPER = """#!/bin/sh
# vLLM {line} as the switch tests see it: the real install, broken or slowed on purpose by MODE.
here=$(dirname "$0")
mode=$(cat "$here/../../mode" 2>/dev/null || echo ok)
case "$mode" in
  broken) PYTHONPATH="$here/../../broken${{PYTHONPATH:+:$PYTHONPATH}}" exec {real} "$@" ;;
  slow) exec {real} "$@" --max-num-seqs 1 ;;
  *) exec {real} "$@" ;;
esac
"""


def wrap_line(lines: Path, line: str, exe: Path, real: str) -> None:
    """Write the wrapper at `exe` (LINES/LINE/bin/vllm) running `real` (a shell word), the mode
    file (ok) and the broken package beside the lines in `lines`."""
    exe.write_text(WRAPPER.format(line=line, real=real))
    exe.chmod(0o755)
    broken = lines / "broken" / "vllm"
    broken.mkdir(parents=True, exist_ok=True)
    (broken / "__init__.py").write_text('raise ImportError("vllm is broken in this install (a test of dspark switch)")\n')
    (lines / "mode").write_text("ok\n")
