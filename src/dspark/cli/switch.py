"""`dspark switch`: the command line of dspark.switch (run on the head)."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

import click

from dspark.cli.options import config_option
from dspark.local.cluster import DEFAULT_DIR as LOCAL_DIR

if TYPE_CHECKING:
    from dspark.config.schema import Cluster
    from dspark.switch import Bench

F = TypeVar("F", bound=Callable[..., Any])


def bench_options(f: F) -> F:
    from dspark.switch import Bench

    d = Bench()
    for opt in reversed([
        click.option("--no-bench", is_flag=True,
                     help="Switch without the before/after benchmark (no regression gate)."),
        click.option("--concurrency", default=",".join(map(str, d.concurrency)), show_default=True,
                     help="Benchmark: concurrent streams per level."),
        click.option("--input-len", type=int, default=d.input_len, show_default=True, help="Benchmark: prompt tokens."),
        click.option("--output-len", type=int, default=d.output_len, show_default=True,
                     help="Benchmark: output tokens per request."),
        click.option("--rounds", type=int, default=d.rounds, show_default=True,
                     help="Benchmark: requests per level = concurrency x rounds."),
        click.option("--repeats", type=click.IntRange(2, 10), default=d.repeats, show_default=True,
                     help="Benchmark runs on each line (their spread sets the noise band)."),
        click.option("--min-band", type=click.FloatRange(0.0, 1.0), default=d.min_band, show_default=True,
                     help="Smallest noise band (a fraction): a score this close to the old line's is no regression."),
        click.option("--timeout", "timeout_s", type=click.FloatRange(1.0), default=None,
                     help="Seconds the pair has to serve on the new line (default: ready_timeout_s + drain_s + "
                          "stop_grace_s + 60)."),
    ]):
        f = opt(f)
    return f


def make_bench(no_bench: bool, concurrency: str, input_len: int, output_len: int, rounds: int, repeats: int,
               min_band: float) -> Bench | None:
    from dspark.cli.options import parse_sizes
    from dspark.switch import Bench

    if no_bench:
        return None
    return Bench(concurrency=parse_sizes(concurrency, "--concurrency"), input_len=input_len, output_len=output_len,
                 rounds=rounds, repeats=repeats, min_band=min_band)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # SIGTERM, SIGHUP (a closed terminal): handled as Ctrl-C, rolled back


def run_switch(cluster: Cluster, state_dir: Path, line: str | None, history: bool, bench: Bench | None,
               timeout_s: float | None) -> None:
    from dspark.cli.common import fail
    from dspark.config.credentials import read_api_key
    from dspark.lines.history import RUNNING, read, table
    from dspark.switch import EXIT_CODES, Switcher, SwitchRefused, os_error_text

    switcher = Switcher(cluster, state_dir, line or "", bench=bench, timeout_s=timeout_s,
                        progress=lambda m: click.echo(m), api_key=read_api_key())
    if history:
        click.echo(f"switches of the head whose state directory is {state_dir}:")
        click.echo(table(read(state_dir)))
        return
    if not line:
        fail("switch: name the runtime line to switch to (dspark switch LINE), or pass --history")
    # Ctrl-C too, even where it came in ignored (a shell's `&` job): a switch must be stoppable.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    try:
        rec = switcher.run()
    except SwitchRefused as e:
        fail(f"switch refused, nothing changed: {e}")
    except KeyboardInterrupt:
        fail(f"switch interrupted; see dspark switch --history --state-dir {state_dir}")
    except PermissionError as e:
        fail(f"switch: {e.strerror}: {e.filename} (the head's state directory; run as root or the service user)")
    except OSError as e:
        fail(f"switch: {os_error_text(e)}; see dspark switch --history --state-dir {state_dir}", code=3)
    if rec.verdict == RUNNING:
        click.echo(f"switch {rec.id}: left to the head: {rec.reason}")
    else:
        click.echo(f"switch {rec.id}: {rec.verdict}: {rec.reason}; serving on {rec.serving_on or 'nothing'}"
                   + (f"; not serving for {rec.down_s:.1f} s" if rec.down_s is not None else ""))
    click.echo(f"history: {state_dir / 'switch-history.json'}; reports: {state_dir / 'switches' / rec.id}")
    sys.exit(EXIT_CODES.get(rec.verdict, 1))


@click.command("switch")
@click.argument("line", required=False)
@config_option
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="The head's state directory (default: /var/lib/dspark/head, the head unit's).")
@click.option("--history", is_flag=True, help="List the switches kept on this head, and exit.")
@bench_options
def switch(line: str | None, config_path: Path | None, state_dir: Path | None, history: bool, no_bench: bool,
           concurrency: str, input_len: int, output_len: int, rounds: int, repeats: int, min_band: float,
           timeout_s: float | None) -> None:
    """Move the serving pair to runtime line LINE (installed on every node: serving.line_commands).

    Run on the head. Benchmarks the current line, switches (worker first into the rendezvous,
    the head's vLLM last), benchmarks the new line and keeps it, or rolls the pair back to the
    old line when the new one does not serve within --timeout, fails the benchmark or scores
    below the noise band. Exit 0 kept, 1 rolled back (serving the old line), 2 refused, 3 the
    rollback failed too.
    """
    from dspark.cli.common import load_cluster
    from dspark.switch import DEFAULT_STATE_DIR

    cluster = load_cluster(config_path)
    run_switch(cluster, state_dir or DEFAULT_STATE_DIR, line, history,
               make_bench(no_bench, concurrency, input_len, output_len, rounds, repeats, min_band), timeout_s)


@click.command("switch")
@click.argument("line", required=False)
@click.option("--dir", "workdir", type=click.Path(file_okay=False, path_type=Path), default=LOCAL_DIR,
              show_default=True, help="The local appliance's directory (as given to local up).")
@click.option("--history", is_flag=True, help="List the switches of the local appliance, and exit.")
@bench_options
def local_switch(line: str | None, workdir: Path, history: bool, no_bench: bool, concurrency: str, input_len: int,
                 output_len: int, rounds: int, repeats: int, min_band: float, timeout_s: float | None) -> None:
    """Switch the running local appliance to runtime line LINE (`dspark switch` for `local up`).

    Exit 0 kept, 1 rolled back (serving the old line), 2 refused, 3 the rollback failed too.
    """
    from dspark.cli.common import load_cluster

    cluster = load_cluster(workdir / "cluster.toml")
    run_switch(cluster, workdir / "state" / cluster.head.name, line, history,
               make_bench(no_bench, concurrency, input_len, output_len, rounds, repeats, min_band), timeout_s)
