"""`dspark bench`: prefill, decode, compare. Thin: options in, one function call, reports out.

Every failure the user can cause or meet (no server, a length that does not fit, a
mismatched comparison) ends in one red line, never a traceback.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from dspark.bench.client import REQUEST_TIMEOUT_S
from dspark.bench.decode import DecodeSpec
from dspark.bench.prefill import PrefillSpec
from dspark.cli.common import fail
from dspark.cli.options import config_option, parse_sizes

if TYPE_CHECKING:  # annotations only: what click.progressbar() returns
    from click._termui_impl import ProgressBar

    from dspark.bench.client import Target
    from dspark.bench.report import Report
    from dspark.config.schema import Cluster

# The options' defaults are the specs' own (one place): `bench decode --help` shows them. The
# options both runs share (--seed, --label) have the same default in both specs.
_DECODE, _PREFILL = DecodeSpec(), PrefillSpec()

DEFAULT_OUT = Path("bench-results")

F = TypeVar("F", bound=Callable[..., Any])


class BarProgress:
    """The progress hook on the terminal (stderr, so stdout stays the report)."""

    def __init__(self) -> None:
        self._bar: ProgressBar[str | None] | None = None

    def begin(self, total: int, title: str) -> None:
        self._bar = click.progressbar(length=total, label=title, file=sys.stderr, show_pos=True,
                                      item_show_func=lambda note: note)
        self._bar.__enter__()

    def step(self, note: str) -> None:
        if self._bar is not None:
            self._bar.update(1, note)

    def end(self) -> None:
        if self._bar is not None:
            self._bar.__exit__(None, None, None)
            self._bar = None


def cluster_settings(cluster: Cluster) -> dict:
    """The serving settings a report records when the server was named by its cluster file
    (the environment is left out: it may hold secrets)."""
    serving = dataclasses.asdict(cluster.serving)
    serving.pop("env", None)
    serving.pop("vllm_command", None)
    from dspark.config.secret_policy import redact_args

    serving["extra_args"] = redact_args(serving.get("extra_args") or [])
    return {"cluster_file": str(cluster.source), "serving": serving}


def without_userinfo(url: str) -> tuple[str, bool]:
    """The URL without a `user:password@` part (reports are world-readable; vLLM takes its key
    as a bearer token, never from the URL), and whether it had one."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url, False
    authority, slash, path = rest.partition("/")
    if "@" not in authority:
        return url, False
    return f"{scheme}://{authority.rpartition('@')[2]}{slash}{path}", True


def resolve_target(config_path: Path | None, url: str | None, model: str | None,
                   timeout: float) -> tuple[Target, dict]:
    from dspark.bench.client import Target
    from dspark.config.credentials import read_api_key

    token = read_api_key()
    if url:
        url, had_userinfo = without_userinfo(url)
        if not url.startswith(("http://", "https://")):
            fail(f"--url must start with http:// or https://, not {url!r}")
        if had_userinfo:
            click.echo("bench: the user name and password in --url are left out (not sent, not recorded); "
                       "vLLM takes the API key as a bearer token: set DSPARK_API_KEY", err=True)
        return Target(url=url.rstrip("/"), model=model, token=token, timeout_s=timeout), {}
    from dspark.cli.common import load_cluster
    from dspark.config.schema import DEFAULT_CONFIG_PATH

    if config_path is None and not DEFAULT_CONFIG_PATH.exists():
        fail(f"no server named: pass --url URL (and --model NAME), or --config CLUSTER_FILE "
             f"(or set DSPARK_CONFIG; {DEFAULT_CONFIG_PATH} does not exist)")
    cluster = load_cluster(config_path)
    target = Target(url=cluster.head.api_url.rstrip("/"), model=model or cluster.model.served_name, token=token,
                    timeout_s=timeout)
    return target, cluster_settings(cluster)


def server_options(f: F) -> F:
    # applied bottom-up: the last one here is listed first in --help
    f = click.option("--quiet", "-q", is_flag=True, help="No progress bar and no summary; errors only.")(f)
    f = click.option("--request-timeout", type=float, default=REQUEST_TIMEOUT_S, show_default=True,
                     help="Seconds one request may take, from sending it to the end of its stream.")(f)
    f = click.option("--shared-prefix-cache", is_flag=True,
                     help="Send no per-run cache salt: prompts an earlier run with the same seed sent come "
                          "from the server's prefix cache (reported as hits). By default every run salts its "
                          "requests (vLLM's cache_salt), so a rerun on the same server measures afresh.")(f)
    f = click.option("--seed", type=int, default=_DECODE.seed, show_default=True,
                     help="Prompt seed: runs with the same seed send identical prompts.")(f)
    f = click.option("--label", default=_DECODE.label, show_default=True,
                     help="Name of this run (e.g. before, after); part of the file names.")(f)
    f = click.option("--out", "-o", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_OUT,
                     show_default=True, help="Directory for the JSON report, Markdown summary and PNG plot.")(f)
    f = click.option("--model", help="Served model name (default: the cluster file's, or the server's only model).")(f)
    f = click.option("--url", help="Server base URL, e.g. http://127.0.0.1:8000 (instead of --config).")(f)
    f = config_option(f, also="The head's API URL and served name come from it.")
    return f


def finish(report: Report, out_dir: Path, quiet: bool) -> None:
    """Write the Markdown summary and the plot next to the JSON, show them, and turn a
    stopped run into a clear error (exit 1) that says what was kept."""
    from dspark.bench.plot import plot
    from dspark.bench.report import paths, to_markdown

    p = paths(out_dir, report.kind, report.label)
    report.save(p.json)
    md = to_markdown(report)
    p.markdown.write_text(md)
    written = [p.json, p.markdown]
    try:
        if plot(report, p.plot):
            written.append(p.plot)
    except ImportError:
        click.secho("matplotlib is not installed: no plot (pip install 'dspark[bench]')", fg="yellow", err=True)
    if not quiet:
        click.echo(md)
        click.echo("wrote " + ", ".join(str(x) for x in written))
    if report.kind == "prefill" and report.complete:
        from dspark.bench.prefill import nothing_measured

        left_out = report.params.get("lengths_left_out")
        if left_out and not quiet:
            click.echo(f"left out the default lengths {', '.join(map(str, left_out))}: longer than the server's "
                       f"max_model_len of {report.server.get('max_model_len')}")
        why = nothing_measured(report)
        if why:
            fail(f"bench prefill: {why}", 1)
    if report.error:
        measured = sum(1 for t in report.trials if t.role == "trial")
        fail(f"bench {report.kind} stopped: {report.error}\n"
             f"the {measured} measured request(s) so far are kept in {p.json}", 1)


def _run(kind: str, spec: PrefillSpec | DecodeSpec, config_path: Path | None, url: str | None, model: str | None,
         out_dir: Path, request_timeout: float, quiet: bool, **run_kw: Any) -> None:
    from dspark.bench.client import BenchError
    from dspark.bench.report import paths

    target, settings = resolve_target(config_path, url, model, request_timeout)
    module = __import__(f"dspark.bench.{kind}", fromlist=["run"])
    json_path = paths(out_dir, kind, spec.label).json
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        fail(f"cannot create {out_dir}: {e.strerror}")
    try:
        report = module.run(target, spec, progress=None if quiet else BarProgress(),
                            on_update=lambda r: r.save(json_path), settings=settings, **run_kw)
    except BenchError as e:
        fail(f"bench {kind}: {e}", 1)
    finish(report, out_dir, quiet)


@click.group("bench", invoke_without_command=True)
@click.pass_context
def bench(ctx: click.Context) -> None:
    """Benchmarks of the serving pair: prefill, decode, compare.

    Point them at a server with --config (the cluster file: head API URL and served name;
    $DSPARK_CONFIG works too) or --url and --model. Reports (JSON, Markdown, PNG) go to
    the --out directory; `dspark bench compare` sets two of them side by side.
    """
    if ctx.invoked_subcommand is None:
        click.echo(ctx.get_help())


@bench.command("prefill")
@server_options
@click.option("--lengths", default=None,
              help="Exact input lengths in tokens, comma-separated (K = 1024). Default: those of "
                   f"{','.join(f'{n // 1024}K' for n in _PREFILL.lengths)} that fit the server's max_model_len "
                   "(a length you give that does not fit is refused).")
@click.option("--trials", type=int, default=_PREFILL.trials, show_default=True,
              help="Measured trials per length (medians).")
def prefill_cmd(config_path: Path | None, url: str | None, model: str | None, out_dir: Path, label: str, seed: int,
                shared_prefix_cache: bool, request_timeout: float, quiet: bool, lengths: str | None,
                trials: int) -> None:
    """Prefill speed at exact input lengths: client TTFT and input tok/s, server prefill tok/s.

    One warm-up request, then per length one excluded pass and N trials, each with a fresh
    unique prompt. Trials that other requests overlapped are marked and left out of the
    server-side median; prefix-cache hits are reported. Run on an otherwise idle server.
    """
    from dspark.bench.prefill import PrefillSpec

    if lengths is None:
        spec = PrefillSpec(trials=trials, seed=seed, label=label, fit_to_server=True,
                           fresh_prefix_cache=not shared_prefix_cache)
    else:
        spec = PrefillSpec(lengths=parse_sizes(lengths, "--lengths"), trials=trials, seed=seed, label=label,
                           fresh_prefix_cache=not shared_prefix_cache)
    if trials < 1:
        fail("--trials must be at least 1")
    _run("prefill", spec, config_path, url, model, out_dir, request_timeout, quiet)


@bench.command("decode")
@server_options
@click.option("--concurrency", default=",".join(map(str, _DECODE.concurrency)), show_default=True,
              help="Concurrent streams per level.")
@click.option("--output-len", type=int, default=_DECODE.output_len, show_default=True,
              help="Output tokens per request (exact: ignore_eos).")
@click.option("--input-len", type=int, default=_DECODE.input_len, show_default=True, help="Prompt tokens per request.")
@click.option("--rounds", type=int, default=_DECODE.rounds, show_default=True,
              help="Requests per level = concurrency x rounds (at least 2 for the throughput's standard error).")
@click.option("--temperature", type=float, default=_DECODE.temperature, show_default=True,
              help="Sampling temperature.")
def decode_cmd(config_path: Path | None, url: str | None, model: str | None, out_dir: Path, label: str, seed: int,
               shared_prefix_cache: bool, request_timeout: float, quiet: bool, concurrency: str, output_len: int,
               input_len: int, rounds: int, temperature: float) -> None:
    """Decode speed over a concurrency sweep: aggregate and per-stream tok/s, TTFT and ITL
    percentiles, speculative acceptance when the server reports it."""
    from dspark.bench.client import BenchError
    from dspark.bench.decode import DecodeSpec

    spec = DecodeSpec(concurrency=parse_sizes(concurrency, "--concurrency"), output_len=output_len,
                      input_len=input_len, rounds=rounds, seed=seed, temperature=temperature, label=label,
                      fresh_prefix_cache=not shared_prefix_cache)
    try:
        spec.check()
    except BenchError as e:
        fail(f"bench decode: {e}")
    _run("decode", spec, config_path, url, model, out_dir, request_timeout, quiet)


@bench.command("compare")
@click.argument("before", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("after", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--out", "-o", "out_file", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the table to this Markdown file.")
def compare_cmd(before: Path, after: Path, out_file: Path | None) -> None:
    """Before/after table of two reports of the identical workload (refused otherwise)."""
    from dspark.bench.compare import CompareRefused, table
    from dspark.bench.report import Report, ReportError

    try:
        text = table(Report.load(before), Report.load(after))
    except ReportError as e:
        fail(f"bench compare: {e}")
    except CompareRefused as e:
        fail(f"bench compare refused: {e}", 3)
    click.echo(text, nl=False)
    if out_file is not None:
        out_file.write_text(text)
