"""Prefill benchmark: exact input lengths, TTFT on the client, prefill rate on the server.

For every length: one excluded pass (first-shape compilation and allocation land there),
then N trials, each a fresh unique prompt with `max_tokens=1`. Around every request the
server's /metrics is scraped; the server-side prefill rate is the change of the
KV-computed-tokens histogram sum over the change of the prefill-time histogram sum, valid
only when exactly one request moved them and nothing else ran (see `judge`). One warm-up
request precedes everything.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

from dspark.bench import prompts, stats
from dspark.bench.client import BenchError, ServerInfo, Target, describe, new_cache_salt, scrape, stream_completion
from dspark.bench.progress import Progress, or_silent
from dspark.bench.report import PrefillSummary, PrefillTrial, Report, now_iso
from dspark.engine.metrics import Window, window

DEFAULT_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
PURPOSE = "prefill"


@dataclass(frozen=True)
class PrefillSpec:
    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    trials: int = 3
    seed: int = 0
    label: str = "run"
    # The default lengths: run those the server's max_model_len holds (the local pair's 4,096
    # holds 1K and 2K); lengths the user chose are refused instead when one does not fit.
    fit_to_server: bool = False
    left_out: tuple[int, ...] = ()  # default lengths the server's max_model_len does not hold
    # A prefix-cache salt of the run's own (client.new_cache_salt): a rerun with the same seed
    # sends identical prompts yet finds none of the previous run's cached blocks. False sends
    # no salt: what the server cached before is reused (and reported as prefix-cache hits).
    fresh_prefix_cache: bool = True

    def check(self) -> None:
        if not self.lengths:
            raise BenchError("no input lengths given")
        if any(n <= 0 for n in self.lengths):
            raise BenchError(f"input lengths must be positive: {list(self.lengths)}")
        if len(set(self.lengths)) != len(self.lengths):
            raise BenchError(f"input lengths repeat: {list(self.lengths)}")
        if self.trials < 1:
            raise BenchError("trials must be at least 1")

    def plan(self) -> list[tuple[str, int, int]]:
        """(role, length, index) in run order."""
        steps = [("warmup", self.lengths[0], 0)]
        for n in self.lengths:
            steps.append(("excluded", n, 0))
            steps += [("trial", n, i) for i in range(self.trials)]
        return steps

    def prompt(self, role: str, length: int, index: int) -> prompts.Prompt:
        return prompts.make(self.seed, f"{PURPOSE}-{role}", length, index)

    def params(self) -> dict:
        p = {"lengths": list(self.lengths), "trials": self.trials, "seed": self.seed,
             "max_tokens": 1, "warmup_requests": 1, "excluded_passes_per_length": 1,
             "prefix_cache": "fresh (salted per run)" if self.fresh_prefix_cache else "shared"}
        if self.left_out:
            p["lengths_left_out"] = list(self.left_out)
        return p


def check_fits(lengths: tuple[int, ...], max_model_len: int | None, output_tokens: int) -> None:
    if max_model_len is None:
        return
    too_long = [n for n in lengths if n + output_tokens > max_model_len]
    if too_long:
        raise BenchError(f"input lengths {too_long} (+{output_tokens} output token(s)) do not fit the server's "
                         f"max_model_len of {max_model_len}; choose lengths up to {max_model_len - output_tokens}")


@dataclass(frozen=True)
class ServerPrefill:
    requests: float | None
    prompt_tokens: float | None
    computed_tokens: float | None
    prefill_time_s: float | None
    prefill_tok_s: float | None
    prefix_cache_hit_tokens: float | None
    overlap: bool
    notes: tuple[str, ...]


def judge(w: Window, expected_tokens: int) -> ServerPrefill:
    """Server-side figures of one prefill trial from the change between two scrapes.

    The rate is valid only if this trial alone moved the counters: exactly one request
    finished prefill (both histograms), the prompt-token counter moved by exactly the
    prompt's length, and no request was running or waiting at either scrape."""
    notes: list[str] = []
    overlap = False
    missing = [name for name, v in (("prefill-time histogram", w.prefill_time_s),
                                    ("KV-computed-tokens histogram", w.computed_tokens)) if v is None]
    if missing:
        notes.append("server does not report the " + " or ".join(missing))
    for name, v in (("requests finished prefill", w.prefill_requests),
                    ("requests reported computed tokens", w.computed_requests),
                    ("requests finished", w.requests_finished)):
        if v is not None and v != 1:
            overlap = True
            notes.append(f"{int(v)} {name} during the trial (expected 1)")
    if w.prompt_tokens is not None and w.prompt_tokens != expected_tokens:
        overlap = True
        notes.append(f"prompt-token counter moved by {int(w.prompt_tokens)}, expected {expected_tokens}")
    for when, busy in (("began", w.busy_before), ("ended", w.busy_after)):
        if busy:
            overlap = True
            notes.append(f"{int(busy)} other request(s) running or waiting when the trial {when}")
    hits = w.prefix_cache_hits
    if hits:
        notes.append(f"{int(hits)} prompt tokens came from the prefix cache")
    tok_s = None
    if not overlap and not missing:
        assert w.computed_tokens is not None  # not missing
        tok_s = stats.rate(w.computed_tokens, w.prefill_time_s)
    return ServerPrefill(requests=w.prefill_requests, prompt_tokens=w.prompt_tokens,
                         computed_tokens=w.computed_tokens, prefill_time_s=w.prefill_time_s,
                         prefill_tok_s=tok_s, prefix_cache_hit_tokens=hits, overlap=overlap, notes=tuple(notes))


def summarize(trials: list[PrefillTrial], lengths: tuple[int, ...]) -> list[PrefillSummary]:
    out = []
    for n in lengths:
        ts = [t for t in trials if t.length == n and t.counted]
        if not ts:
            continue
        clean = [t for t in ts if not t.prefix_cache_hit_tokens]
        valid = [t for t in ts if t.server_valid]
        out.append(PrefillSummary(
            length=n, trials=len(ts),
            ttft_s=stats.median([t.ttft_s for t in clean]),
            client_input_tok_s=stats.median([t.client_input_tok_s for t in clean]),
            server_prefill_tok_s=stats.median([t.server_prefill_tok_s for t in valid]),
            server_valid_trials=len(valid),
            overlapped_trials=sum(1 for t in ts if t.overlap),
            prefix_cache_hit_trials=sum(1 for t in ts if t.prefix_cache_hit_tokens)))
    return out


def measure(target: Target, model: str, prompt: prompts.Prompt, role: str, index: int,
            run_start: float, cache_salt: str | None = None) -> PrefillTrial:
    """One request between two scrapes."""
    before = scrape(target, model)
    at = time.perf_counter() - run_start
    res = stream_completion(target, model, prompt.token_ids, max_tokens=1, cache_salt=cache_salt)
    after = scrape(target, model)
    server = judge(window(before, after), len(prompt))
    notes = list(server.notes)
    if res.prompt_tokens is not None and res.prompt_tokens != len(prompt):
        notes.append(f"server counted {res.prompt_tokens} prompt tokens, sent {len(prompt)}")
    ttft = res.ttft_s
    return PrefillTrial(
        length=len(prompt), role=role, index=index, prompt_sha256=prompt.sha256, at_s=round(at, 6),
        ttft_s=ttft, e2e_s=res.e2e_s, client_input_tok_s=stats.rate(len(prompt), ttft),
        server_requests=server.requests, server_prompt_tokens=server.prompt_tokens,
        server_computed_tokens=server.computed_tokens, server_prefill_time_s=server.prefill_time_s,
        server_prefill_tok_s=server.prefill_tok_s, prefix_cache_hit_tokens=server.prefix_cache_hit_tokens,
        overlap=server.overlap, notes=notes)


def nothing_measured(report: Report) -> str | None:
    """Why a finished run measured no prefill at all (every measured trial was served from the
    prefix cache), or None."""
    measured = [t for t in report.trials if t.role == "trial"]
    if not measured or not all(t.prefix_cache_hit_tokens for t in measured):
        return None
    return (f"every measured trial ({len(measured)} of {len(measured)}) was served from the prefix cache, so "
            "no prefill was measured: the server has seen these prompts before (an earlier run with the same "
            "--seed, run with --shared-prefix-cache, or a server that ignores vLLM's cache_salt); run again without "
            "--shared-prefix-cache, with another --seed, or after restarting the server")


def new_report(spec: PrefillSpec, info: ServerInfo) -> Report:
    planned = [spec.prompt(*step).sha256 for step in spec.plan()]
    return Report(kind="prefill", label=spec.label, server=dataclasses.asdict(info), params=spec.params(),
                  prompt_set_sha256=prompts.set_fingerprint(planned), planned_prompts=planned)


def run(target: Target, spec: PrefillSpec, *, progress: Progress | None = None,
        on_update: Callable[[Report], object] | None = None, info: ServerInfo | None = None,
        settings: dict | None = None, before_request: Callable[[str, int, int], object] | None = None) -> Report:
    """Run the prefill matrix. Returns the report, partial (with `error`) if the server
    stopped answering; raises BenchError only when nothing could be measured at all.

    `on_update(report)` is called after every request (the CLI saves the report there);
    `before_request(role, length, index)` is a hook for tests."""
    spec.check()
    info = info or describe(target)
    if settings:
        info.settings.update(settings)
    if spec.fit_to_server and info.max_model_len:
        fitting = tuple(n for n in spec.lengths if n + 1 <= info.max_model_len)
        if fitting:
            spec = dataclasses.replace(spec, lengths=fitting,
                                       left_out=tuple(n for n in spec.lengths if n not in fitting))
    check_fits(spec.lengths, info.max_model_len, 1)
    report = new_report(spec, info)
    progress = or_silent(progress)
    steps = spec.plan()
    progress.begin(len(steps), f"prefill {', '.join(str(n) for n in spec.lengths)} tokens")
    run_start = time.perf_counter()
    salt = new_cache_salt() if spec.fresh_prefix_cache else None
    try:
        for role, length, index in steps:
            if before_request is not None:
                before_request(role, length, index)
            trial = measure(target, info.model, spec.prompt(role, length, index), role, index, run_start, salt)
            report.trials.append(trial)
            report.summary = summarize(report.trials, spec.lengths)
            if on_update is not None:
                on_update(report)
            progress.step(f"{role} {length} tok: TTFT {trial.ttft_s * 1000:.1f} ms" if trial.ttft_s else role)
        report.complete = True
    except BenchError as e:
        report.error = str(e)
    except KeyboardInterrupt:
        report.error = "interrupted"
    finally:
        progress.end()
    report.finished_at = now_iso()
    report.summary = summarize(report.trials, spec.lengths)
    if on_update is not None:
        on_update(report)
    return report
