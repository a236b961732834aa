"""What the `dspark switch` tests share: the two real lines and the band the switches that must
be kept are judged with (tests/switch/test_switch_local.py on `local up`,
tests/systemd/test_switch_under_systemd.py under the units), and the wrapper put in place of the
second line's `bin/vllm` for the shared local pair, which a mode file turns into a slowed (one
sequence at a time, throttled) install of it."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

A, B = "v0.28.0", "v0.32.0"
# The switches that must be kept are measured with a wide band: on a shared 2-core host one real
# line's score against the other's swings with the load (-30.3 % against a measured band of
# 21.8 %, then +28.6 % on the next run; a CI run's move back to 0.28.0: -14.4 % against 8.5 %).
# The gate itself is proven on the slowed line, with the band the runs measure. One sequence at a
# time alone made it about 8x slower on a quiet host, but on a loaded one the runs of each line
# swing so far (a band of 78 %) that a drop of 56 % was within the noise and the switch was kept,
# rightly: so the slowed line is also throttled, runnable half of the time once it serves
# (with a quarter, a loaded host measured -96.7 % against a band of 29.1 %).
WIDE_BAND = ["--min-band", "0.6"]

# MODE (the file `mode` two levels above bin/): ok runs the real vLLM; slow serves one sequence at a time
# and, once its API answers, has its process group stopped half of the time (THROTTLE,
# a process of its own session that ends with the vLLM it throttles).
WRAPPER = """#!/bin/sh
# vLLM {line} as the switch tests see it: the real install, or slowed on purpose by MODE.
here=$(dirname "$0")
mode=$(cat "$here/../../mode" 2>/dev/null || echo ok)
case "$mode" in
  slow) {python} "$here/../../throttle.py" $$ "$@" </dev/null >/dev/null 2>&1 &
        exec {real} "$@" --max-num-seqs 1 ;;
  *) exec {real} "$@" ;;
esac
"""


THROTTLE = """import os, signal, sys, time, urllib.request
# Throttles the vLLM run whose process group is argv[1] (the wrapper's PID, which vLLM's exec keeps)
# once its API answers: stopped PAUSE_S out of every RUN_S + PAUSE_S. Bounded in time; always
# leaves the group running; ends once that vLLM is gone.
RUN_S, PAUSE_S, LIMIT_S = 0.05, 0.05, 3600
pid, args = int(sys.argv[1]), sys.argv[2:]
os.setsid()  # out of the group it stops
if "--port" not in args:
    sys.exit(0)  # a headless worker: the pair runs at its throttled head's pace
host = args[args.index("--host") + 1] if "--host" in args else "127.0.0.1"
url = "http://%s:%s/health" % (host, args[args.index("--port") + 1])
end = time.monotonic() + LIMIT_S


def alive():  # a zombie (exited, not yet reaped by its supervisor) is gone
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


while alive() and time.monotonic() < end:
    try:
        urllib.request.urlopen(url, timeout=2).close()
        break
    except OSError:
        time.sleep(0.5)
while alive() and time.monotonic() < end:
    try:
        os.killpg(pid, signal.SIGSTOP)
        time.sleep(PAUSE_S)
    except OSError:
        break
    finally:
        try:
            os.killpg(pid, signal.SIGCONT)
        except OSError:
            pass
    time.sleep(RUN_S)
"""


def second_line_wrapped(lines: Path) -> Path | None:
    """LINES (`lines`) holding the second runtime line's `bin/vllm` as the wrapper running that
    line's real vLLM (.ci/setup installs it), the mode file (ok) and the throttle beside it; None
    where that line is not installed."""
    from dspark.local import cluster as local

    real = local.lines_dir() / B / "bin" / "vllm"
    if not real.exists():
        return None
    exe = lines / B / "bin" / "vllm"
    exe.parent.mkdir(parents=True, exist_ok=True)
    exe.write_text(WRAPPER.format(line=B, real=shlex.quote(str(real)), python=shlex.quote(sys.executable)))
    exe.chmod(0o755)
    (lines / "throttle.py").write_text(THROTTLE)
    (lines / "mode").write_text("ok\n")
    return lines
