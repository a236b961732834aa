"""Benchmark reports: a versioned JSON that saves and loads itself, and its Markdown summary.

A report records its own context (runtime version, server settings, dspark version, host,
start time, the prompt fingerprints) and every trial, including the warm-up and excluded
passes, so a figure can always be traced back to the requests that made it. A report is
written after every trial: a run that fails half-way keeps what it measured
(`complete: false` and the `error`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import socket
import typing
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dspark import __version__
from dspark.config.typecheck import fits, words
from dspark.files import state_io

SCHEMA = "dspark.bench.report"
SCHEMA_VERSION = 1
KINDS = ("prefill", "decode")


class ReportError(Exception):
    """A file that is not a report this dspark can read."""


def _f(default: Any = dataclasses.MISSING, *, help: str, factory: Any = None) -> Any:  # a field, as its default
    if factory is not None:
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


# ---------------------------------------------------------------------------------- prefill
@dataclass
class PrefillTrial:
    length: int = _f(help="Prompt length in tokens (exact: token ids are sent as they are).")
    role: str = _f(help="'warmup' and 'excluded' passes are recorded but never enter a median; 'trial' does.")
    index: int = _f(help="Trial number within its length (0-based).")
    prompt_sha256: str = _f(help="SHA-256 of the prompt's token ids (little-endian uint32).")
    at_s: float = _f(help="Start of the request, seconds after the run started.")
    ttft_s: float | None = _f(help="Client time to first token: request sent to first streamed chunk.")
    e2e_s: float | None = _f(help="Client time to the last streamed chunk (one output token).")
    client_input_tok_s: float | None = _f(help="length / ttft_s: prompt tokens per second as the client sees it.")
    server_requests: float | None = _f(help="Requests that finished prefill between the two /metrics scrapes.")
    server_prompt_tokens: float | None = _f(help="Change of vLLM's prompt-token counter between the scrapes.")
    server_computed_tokens: float | None = _f(help="Change of the prefill KV-computed-tokens histogram sum.")
    server_prefill_time_s: float | None = _f(help="Change of the request prefill-time histogram sum.")
    server_prefill_tok_s: float | None = _f(
        help="computed tokens / prefill time; only when exactly one request moved them.")
    prefix_cache_hit_tokens: float | None = _f(
        help="Prompt tokens the server took from its prefix cache (should be 0).")
    overlap: bool = _f(False, help="Another request ran during this trial: its server figures are left out.")
    notes: list[str] = _f(help="Why the server figures are not valid, or other findings.", factory=list)

    @property
    def counted(self) -> bool:
        return self.role == "trial"

    @property
    def server_valid(self) -> bool:
        return (self.counted and not self.overlap and not self.prefix_cache_hit_tokens
                and self.server_prefill_tok_s is not None)


@dataclass
class PrefillSummary:
    length: int = _f(help="Prompt length in tokens.")
    trials: int = _f(help="Measured trials at this length (warm-up and excluded passes not counted).")
    ttft_s: float | None = _f(help="Median client TTFT over the trials without prefix-cache hits.")
    client_input_tok_s: float | None = _f(help="Median client input tokens per second (same trials).")
    server_prefill_tok_s: float | None = _f(help="Median server-side prefill tokens per second over valid trials.")
    server_valid_trials: int = _f(help="Trials whose server figures entered the median.")
    overlapped_trials: int = _f(help="Trials another request overlapped (left out of the server median).")
    prefix_cache_hit_trials: int = _f(help="Trials served partly from the prefix cache (left out of every median).")


# ----------------------------------------------------------------------------------- decode
@dataclass
class DecodeRequest:
    concurrency: int = _f(help="Streams in flight at this level.")
    role: str = _f(help="'warmup' (recorded, never summarised) or 'trial'.")
    index: int = _f(help="Request number within its level.")
    prompt_sha256: str = _f(help="SHA-256 of the prompt's token ids.")
    prompt_tokens: int | None = _f(help="Prompt tokens the server reported (usage).")
    output_tokens: int | None = _f(help="Completion tokens the server reported (usage).")
    start_s: float = _f(help="Request start, seconds after the level started.")
    ttft_s: float | None = _f(help="Client time to first token.")
    e2e_s: float | None = _f(help="Client time to the last token.")
    decode_tok_s: float | None = _f(help="(output tokens - 1) / (last token - first token): this stream's decode rate.")
    itl_s: list[float] = _f(help="Gaps between consecutive streamed chunks (inter-token latency).", factory=list)


@dataclass
class DecodeLevel:
    concurrency: int = _f(help="Streams in flight.")
    requests: int = _f(help="Requests completed at this level.")
    output_tokens: int = _f(help="Completion tokens of all requests (usage).")
    duration_s: float = _f(help="From the first request sent to the last request finished.")
    aggregate_tok_s: float | None = _f(help="output_tokens / duration_s: the level's output throughput.")
    decode_tok_s_median: float | None = _f(help="Median per-stream decode rate after the first token.")
    decode_tok_s_min: float | None = _f(help="Slowest stream's decode rate.")
    ttft_s_p50: float | None = _f(help="Client TTFT, 50th percentile.")
    ttft_s_p90: float | None = _f(help="Client TTFT, 90th percentile.")
    ttft_s_p99: float | None = _f(help="Client TTFT, 99th percentile.")
    itl_s_p50: float | None = _f(help="Inter-token latency over all chunks of all streams, 50th percentile.")
    itl_s_p90: float | None = _f(help="Inter-token latency, 90th percentile.")
    itl_s_p99: float | None = _f(help="Inter-token latency, 99th percentile.")
    server_generation_tokens: float | None = _f(help="Change of vLLM's generation-token counter over the level.")
    prefix_cache_hit_tokens: float | None = _f(help="Prompt tokens served from the prefix cache during the level.")
    preemptions: float | None = _f(help="Requests vLLM preempted during the level.")
    spec_acceptance_rate: float | None = _f(
        help="Accepted / proposed draft tokens (speculative decoding), when reported.")
    spec_mean_acceptance_length: float | None = _f(help="1 + accepted / drafts: tokens per verification step.")
    spec_drafts: int | None = _f(help="Draft rounds the server reported during the level.")
    aggregate_tok_s_se: float | None = _f(
        None, help="Standard error of aggregate_tok_s: it times the requests' end-to-end time coefficient of "
                   "variation over sqrt(requests); None below two requests (reports before it have none).")


TRIAL_TYPES = {"prefill": PrefillTrial, "decode": DecodeRequest}
SUMMARY_TYPES = {"prefill": PrefillSummary, "decode": DecodeLevel}


# ----------------------------------------------------------------------------------- report
@dataclass
class Report:
    kind: str = _f(help="'prefill' or 'decode'.")
    label: str = _f(help="The user's name for this run, e.g. 'before' or 'after'.")
    server: dict = _f(help="url, model, runtime_version (from /version), max_model_len and settings.")
    params: dict = _f(help="The benchmark's parameters (lengths or concurrency, trials, seed, ...).")
    prompt_set_sha256: str = _f(help="SHA-256 over every planned prompt's fingerprint, in plan order.")
    planned_prompts: list[str] = _f(help="Every planned prompt's SHA-256, in plan order.", factory=list)
    started_at: str = _f(help="UTC start time (ISO 8601).", factory=now_iso)
    finished_at: str | None = _f(None, help="UTC end time; None while running.")
    host: str = _f(help="Host the benchmark client ran on.", factory=socket.gethostname)
    dspark_version: str = _f(__version__, help="dspark version of the client.")
    complete: bool = _f(False, help="True when every planned request ran.")
    error: str | None = _f(None, help="What stopped the run early, if anything.")
    trials: list = _f(help="Every request, warm-up and excluded passes included.", factory=list)
    summary: list = _f(help="Per length (prefill) or per concurrency (decode).", factory=list)
    schema: str = _f(SCHEMA, help="Always 'dspark.bench.report'.")
    schema_version: int = _f(SCHEMA_VERSION, help="Incremented when a field changes meaning.")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any, source: str = "report") -> Report:
        """Check every field against its declared type (finite numbers only) and refuse the
        report with the first wrong field named: a hand-edited or foreign file never reaches
        the comparison as a traceback."""
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise ReportError(f"{source}: not a dspark bench report (no schema {SCHEMA!r})")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION or isinstance(version, bool):
            raise ReportError(f"{source}: report schema version {version!r}; this dspark reads version "
                              f"{SCHEMA_VERSION} (for a newer report, upgrade dspark)")
        kind = data.get("kind")
        if kind not in KINDS:
            raise ReportError(f"{source}: unknown report kind {kind!r}")
        report = cls(**_typed(cls, data, source, skip=("trials", "summary")))
        for name, types_ in (("trials", TRIAL_TYPES), ("summary", SUMMARY_TYPES)):
            items = data.get(name, [])
            if not isinstance(items, list):
                raise ReportError(f"{source}: {name}: expected a list, got {type(items).__name__}")
            setattr(report, name, [_typed(types_[kind], x, f"{source}: {name}[{i}]") for i, x in enumerate(items)])
        return report

    def save(self, path: Path) -> Path:
        """Write atomically (a reader never sees half a file)."""
        path = Path(path)
        state_io.write_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n", mode=None)
        return path

    @classmethod
    def load(cls, path: Path) -> Report:
        try:
            data = json.loads(Path(path).read_text())
        except OSError as e:
            raise ReportError(f"{path}: {e.strerror}") from None
        except ValueError as e:
            raise ReportError(f"{path}: not JSON: {e}") from None
        return cls.from_dict(data, source=str(path))


def _typed(cls: type, data: Any, where: str, skip: tuple[str, ...] = ()) -> Any:  # a `cls`; its kwargs with `skip`
    if not isinstance(data, dict):
        raise ReportError(f"{where}: expected a JSON object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ReportError(f"{where}: malformed report: {f.name} is missing")
            continue
        value = data[f.name]
        if not fits(value, hints[f.name], finite=True):
            raise ReportError(f"{where}: malformed report: {f.name} = {json.dumps(value)[:60]} is not "
                              f"{words(hints[f.name], json=True)}")
        kwargs[f.name] = value
    return cls(**kwargs) if not skip else kwargs


_MD_SPECIAL = re.compile(r"([\\`*_\[\]<>|~])")


def _hex(text: str) -> str:
    return text if re.fullmatch(r"[0-9a-f]*", text) else md(text)


def md(text: Any) -> str:
    """Text from a report (a label, a host, an error) made inert in Markdown: one line, every
    Markdown punctuation character escaped, so it cannot add table cells, links or HTML."""
    one_line = " ".join(str(text).split())
    return _MD_SPECIAL.sub(r"\\\1", one_line)


# ------------------------------------------------------------------------------------ files
@dataclass(frozen=True)
class ReportPaths:
    json: Path
    markdown: Path
    plot: Path

    def all(self) -> list[Path]:
        return [self.json, self.markdown, self.plot]


def paths(out_dir: Path, kind: str, label: str) -> ReportPaths:
    """The report's files: `{kind}-{label}.json/.md/.png`. A label with characters unsafe in a
    file name is cleaned and given a short hash of the full label, so two labels never share
    files (`v0.28.0` and `v0.28.1`, `a b` and `a_b`)."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_.") or "run"
    if safe != label:
        safe += "-" + hashlib.sha256(label.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    stem = f"{kind}-{safe}"
    out = Path(out_dir)
    return ReportPaths(out / f"{stem}.json", out / f"{stem}.md", out / f"{stem}.png")


# --------------------------------------------------------------------------------- markdown
def fmt(v: float | None, digits: int = 1) -> str:
    if v is None or not math.isfinite(v):
        return "n/a"
    return f"{v:,.{digits}f}"


def ms(v: float | None) -> str:
    return "n/a" if v is None or not math.isfinite(v) else f"{v * 1000:,.1f}"


def _header(r: Report) -> list[str]:
    s = r.server
    status = "complete" if r.complete else f"INCOMPLETE: {md(r.error or 'stopped early')}"
    lines = [
        f"# dspark bench {r.kind}: {md(r.label)}",
        "",
        f"- server: {md(s.get('url'))} model {md(s.get('model'))}, vLLM {md(s.get('runtime_version') or 'unknown')}, "
        f"max_model_len {md(s.get('max_model_len'))}",
        f"- client: {md(r.host)}, dspark {md(r.dspark_version)}; started {md(r.started_at)}, "
        f"finished {md(r.finished_at or '-')}",
        f"- status: {status}",
        f"- prompt set SHA-256: `{_hex(r.prompt_set_sha256)}`",
        "- parameters: " + ", ".join(f"{md(k)}={md(v)}" for k, v in r.params.items()),
        "",
    ]
    return lines


def to_markdown(r: Report) -> str:
    lines = _header(r)
    if r.kind == "prefill":
        lines += ["| input tokens | trials | TTFT median (ms) | client input tok/s | server prefill tok/s "
                  "| server-valid | overlapped | prefix-cache hits |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for s in r.summary:
            lines.append(f"| {s.length:,} | {s.trials} | {ms(s.ttft_s)} | {fmt(s.client_input_tok_s)} | "
                         f"{fmt(s.server_prefill_tok_s)} | {s.server_valid_trials} | {s.overlapped_trials} | "
                         f"{s.prefix_cache_hit_trials} |")
        hits = sum(s.prefix_cache_hit_trials for s in r.summary)
        if hits:
            lines += ["", f"**{hits} trial(s) hit the prefix cache**: the server had seen these prompts "
                      "(same seed with --shared-prefix-cache, or a server that ignores cache_salt); "
                      "they are left out of every "
                      "median."]
        over = sum(s.overlapped_trials for s in r.summary)
        if over:
            lines += ["", f"{over} trial(s) overlapped other requests (another client, or the "
                      "supervisor's liveness probe); their server-side figures are left out."]
    else:
        lines += ["| concurrency | requests | aggregate tok/s (± standard error) "
                  "| per-stream decode tok/s (median / min) "
                  "| TTFT p50 / p90 / p99 (ms) | ITL p50 / p90 / p99 (ms) | spec acceptance |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        for s in r.summary:
            spec = ("n/a" if s.spec_acceptance_rate is None else
                    f"{s.spec_acceptance_rate:.1%} (mean length {fmt(s.spec_mean_acceptance_length, 2)})")
            agg = fmt(s.aggregate_tok_s) + ("" if s.aggregate_tok_s_se is None else f" ± {fmt(s.aggregate_tok_s_se)}")
            lines.append(f"| {s.concurrency} | {s.requests} | {agg} | "
                         f"{fmt(s.decode_tok_s_median)} / {fmt(s.decode_tok_s_min)} | "
                         f"{ms(s.ttft_s_p50)} / {ms(s.ttft_s_p90)} / {ms(s.ttft_s_p99)} | "
                         f"{ms(s.itl_s_p50)} / {ms(s.itl_s_p90)} / {ms(s.itl_s_p99)} | {spec} |")
        hits = sum(s.prefix_cache_hit_tokens or 0 for s in r.summary)
        if hits:
            lines += ["", f"**{int(hits)} prompt tokens hit the prefix cache** during the sweep."]
    return "\n".join(lines) + "\n"
