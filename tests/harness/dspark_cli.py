"""`dspark` run in this process through click's CliRunner, for tests about a command's output
and exit status (what `tests.harness.pair.run_dspark` gives, without starting an interpreter per call).
Tests about the process itself (signals, process groups, the interpreter's start-up, resource
limits, a long-running `serve` or `local up`) keep run_dspark.

The result has run_dspark's fields (returncode, stdout, stderr). An exception that would have
ended a real `dspark` with a traceback is raised here instead, so a test that asserts "no
traceback" fails where the command would have printed one."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from click.testing import CliRunner


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


def invoke_dspark(*args: str, env: dict[str, str | None] | None = None, cwd: Path | str | None = None) -> Ran:
    """`dspark ARGS` in this process. `env` changes the environment for the call (None unsets
    a variable); `cwd` is the working directory during the call."""
    from dspark.cli.main import main

    # A subprocess writing to a pipe formats help and messages for COLUMNS or 80 columns.
    try:
        width = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        width = 80
    runner = CliRunner()
    with contextlib.chdir(cwd) if cwd is not None else contextlib.nullcontext():
        r = runner.invoke(main, list(args), env=env, prog_name="dspark", catch_exceptions=False,
                          terminal_width=width)
    return Ran(r.exit_code, r.stdout, r.stderr)
