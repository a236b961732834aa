"""Decode benchmark: a concurrency sweep of fixed-length outputs.

At each level, `concurrency x rounds` requests run through a pool of `concurrency` streams
(like `vllm bench serve --max-concurrency C --num-prompts C*rounds --request-rate inf`),
every one with a unique prompt, `max_tokens=output_len` and `ignore_eos`, so every request
decodes exactly `output_len` tokens. Aggregate throughput is all output tokens over the
level's wall time; per-stream decode rate counts the tokens after the first one over the
time after the first one. Speculative acceptance comes from the server's spec-decode
counters over the level, when it reports any.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import cast

from dspark.bench import prompts, stats
from dspark.bench.client import (
    BenchError,
    ServerInfo,
    StreamResult,
    Target,
    describe,
    new_cache_salt,
    scrape,
    stream_completion,
)
from dspark.bench.progress import Progress, or_silent
from dspark.bench.report import DecodeLevel, DecodeRequest, Report, now_iso
from dspark.engine.metrics import Window, spec_decode, window

DEFAULT_CONCURRENCY = (1, 2, 4, 8)
# Requests per level = concurrency x rounds. One round left c=1 and c=2 on one and two
# requests: a single slow request put c=2 below c=1. Four give every level a standard
# error (DecodeLevel.aggregate_tok_s_se) that the report prints beside the throughput.
DEFAULT_ROUNDS = 4
# One thread (and one connection) per stream: beyond this a client machine runs out of
# threads or sockets before the server is measured. Requests per level are capped likewise
# (every prompt is generated up front).
MAX_CONCURRENCY = 1024
MAX_REQUESTS_PER_LEVEL = 100_000
PURPOSE = "decode"


@dataclass(frozen=True)
class DecodeSpec:
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    output_len: int = 512
    input_len: int = 128
    rounds: int = DEFAULT_ROUNDS
    seed: int = 0
    temperature: float = 0.0
    warmup: bool = True
    label: str = "run"
    # A prefix-cache salt of the run's own (client.new_cache_salt): a rerun with the same seed
    # sends identical prompts yet finds none of the previous run's cached blocks. False sends
    # no salt: what the server cached before is reused (and reported as prefix-cache hits).
    fresh_prefix_cache: bool = True

    def check(self) -> None:
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise BenchError(f"concurrency levels must be positive: {list(self.concurrency)}")
        if max(self.concurrency) > MAX_CONCURRENCY:
            raise BenchError(f"concurrency {max(self.concurrency)} is more than {MAX_CONCURRENCY} streams "
                             "(one thread and connection each); use a smaller level")
        if self.output_len < 2:
            raise BenchError("output length must be at least 2 tokens (decode starts after the first)")
        if self.input_len < 1:
            raise BenchError("input length must be positive")
        if self.rounds < 1:
            raise BenchError("rounds must be at least 1")
        if max(self.concurrency) * self.rounds > MAX_REQUESTS_PER_LEVEL:
            raise BenchError(f"concurrency x rounds = {max(self.concurrency) * self.rounds} requests in one level; "
                             f"at most {MAX_REQUESTS_PER_LEVEL} (lower --rounds)")

    def level_prompts(self, concurrency: int) -> list[prompts.Prompt]:
        return [prompts.make(self.seed, f"{PURPOSE}-c{concurrency}", self.input_len, i)
                for i in range(concurrency * self.rounds)]

    def warmup_prompt(self) -> prompts.Prompt:
        return prompts.make(self.seed, f"{PURPOSE}-warmup", self.input_len, 0)

    def planned(self) -> list[prompts.Prompt]:
        out = [self.warmup_prompt()] if self.warmup else []
        for c in self.concurrency:
            out += self.level_prompts(c)
        return out

    def params(self) -> dict:
        return {"concurrency": list(self.concurrency), "output_len": self.output_len, "input_len": self.input_len,
                "rounds": self.rounds, "seed": self.seed, "temperature": self.temperature,
                "ignore_eos": True, "warmup": self.warmup,
                "prefix_cache": "fresh (salted per run)" if self.fresh_prefix_cache else "shared"}


def request_record(res: StreamResult, prompt: prompts.Prompt, concurrency: int, role: str, index: int,
                   level_start: float) -> DecodeRequest:
    n = res.completion_tokens
    decode_time = None if res.first_token is None or res.finished is None else res.finished - res.first_token
    return DecodeRequest(
        concurrency=concurrency, role=role, index=index, prompt_sha256=prompt.sha256,
        prompt_tokens=res.prompt_tokens, output_tokens=n, start_s=round(res.started - level_start, 6),
        ttft_s=res.ttft_s, e2e_s=res.e2e_s,
        decode_tok_s=stats.rate(n - 1, decode_time) if n else None,
        itl_s=[round(x, 6) for x in res.itl_s])


def aggregate_se(aggregate: float | None, e2e_s: list[float | None]) -> float | None:
    """The level throughput's standard error: the level lasts about (requests / concurrency)
    request times, so its relative error is that of the mean request time, the requests'
    coefficient of variation over sqrt(requests). None below two requests."""
    xs = [x for x in e2e_s if x is not None]
    m = stats.mean(xs)
    if aggregate is None or len(xs) < 2 or not m:
        return None
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
    return aggregate * sd / m / math.sqrt(len(xs))


def summarize_level(concurrency: int, reqs: list[DecodeRequest], duration_s: float, w: Window | None) -> DecodeLevel:
    out_tokens = sum(r.output_tokens or 0 for r in reqs)
    ttfts = [r.ttft_s for r in reqs]
    itls = [x for r in reqs for x in r.itl_s]
    rates = [r.decode_tok_s for r in reqs if r.decode_tok_s is not None]
    spec = spec_decode(w) if w is not None else None
    aggregate = stats.rate(out_tokens, duration_s)
    return DecodeLevel(
        concurrency=concurrency, requests=len(reqs), output_tokens=out_tokens, duration_s=duration_s,
        aggregate_tok_s=aggregate, aggregate_tok_s_se=aggregate_se(aggregate, [r.e2e_s for r in reqs]),
        decode_tok_s_median=stats.median(rates), decode_tok_s_min=min(rates) if rates else None,
        ttft_s_p50=stats.percentile(ttfts, 50), ttft_s_p90=stats.percentile(ttfts, 90),
        ttft_s_p99=stats.percentile(ttfts, 99),
        itl_s_p50=stats.percentile(itls, 50), itl_s_p90=stats.percentile(itls, 90),
        itl_s_p99=stats.percentile(itls, 99),
        server_generation_tokens=None if w is None else w.generation_tokens,
        prefix_cache_hit_tokens=None if w is None else w.prefix_cache_hits,
        preemptions=None if w is None else w.preemptions,
        spec_acceptance_rate=spec.acceptance_rate if spec else None,
        spec_mean_acceptance_length=spec.mean_acceptance_length if spec else None,
        spec_drafts=cast(int, spec.drafts) if spec else None)  # a window's counters: spec_decode() makes them ints


def run_level(target: Target, model: str, spec: DecodeSpec, concurrency: int, level_prompts: list[prompts.Prompt],
              progress: Progress, report: Report, on_update: Callable[[Report], object] | None,
              cache_salt: str | None = None) -> DecodeLevel:
    """Run one level; completed requests are added to the report as they finish, so a
    failure keeps them."""
    before = scrape(target, model)
    level_start = time.perf_counter()

    def one(i: int) -> tuple[int, StreamResult]:
        res = stream_completion(target, model, level_prompts[i].token_ids, spec.output_len,
                                ignore_eos=True, temperature=spec.temperature, cache_salt=cache_salt)
        return i, res

    done_reqs: list[DecodeRequest] = []
    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix=f"bench-c{concurrency}")
    try:
        pending = {pool.submit(one, i) for i in range(len(level_prompts))}
        while pending:
            finished, pending = wait(pending, return_when=FIRST_EXCEPTION)
            for fut in finished:
                i, res = fut.result()  # raises the first BenchError
                rec = request_record(res, level_prompts[i], concurrency, "trial", i, level_start)
                done_reqs.append(rec)
                report.trials.append(rec)
                progress.step(f"c={concurrency} request {i}: {rec.output_tokens} tokens")
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        if on_update is not None:
            on_update(report)
    duration = time.perf_counter() - level_start
    after = scrape(target, model)
    done_reqs.sort(key=lambda r: r.index)
    return summarize_level(concurrency, done_reqs, duration, window(before, after))


def new_report(spec: DecodeSpec, info: ServerInfo) -> Report:
    planned = [p.sha256 for p in spec.planned()]
    return Report(kind="decode", label=spec.label, server=dataclasses.asdict(info), params=spec.params(),
                  prompt_set_sha256=prompts.set_fingerprint(planned), planned_prompts=planned)


def run(target: Target, spec: DecodeSpec, *, progress: Progress | None = None,
        on_update: Callable[[Report], object] | None = None,
        info: ServerInfo | None = None, settings: dict | None = None,
        level_prompts: dict[int, list[prompts.Prompt]] | None = None) -> Report:
    """Run the sweep; returns the report, partial (with `error`) if the server stopped
    answering. `level_prompts` replaces the generated prompts of a level (the fidelity
    check uses it to send exactly what `vllm bench serve` sent)."""
    spec.check()
    info = info or describe(target)
    if settings:
        info.settings.update(settings)
    if info.max_model_len is not None and spec.input_len + spec.output_len > info.max_model_len:
        raise BenchError(f"input {spec.input_len} + output {spec.output_len} tokens do not fit the server's "
                         f"max_model_len of {info.max_model_len}")
    plans = {c: (level_prompts or {}).get(c) or spec.level_prompts(c) for c in spec.concurrency}
    report = new_report(spec, info)
    if level_prompts:
        planned = ([spec.warmup_prompt().sha256] if spec.warmup else []) + \
                  [p.sha256 for c in spec.concurrency for p in plans[c]]
        report.planned_prompts = planned
        report.prompt_set_sha256 = prompts.set_fingerprint(planned)
    progress = or_silent(progress)
    total = (1 if spec.warmup else 0) + sum(len(p) for p in plans.values())
    progress.begin(total, f"decode c={','.join(map(str, spec.concurrency))}, {spec.output_len} tokens each")
    salt = new_cache_salt() if spec.fresh_prefix_cache else None
    try:
        if spec.warmup:
            p = spec.warmup_prompt()
            t0 = time.perf_counter()
            res = stream_completion(target, info.model, p.token_ids, min(spec.output_len, 16),
                                    temperature=spec.temperature, cache_salt=salt)
            report.trials.append(request_record(res, p, 1, "warmup", 0, t0))
            progress.step("warm-up")
        for c in spec.concurrency:
            level = run_level(target, info.model, spec, c, plans[c], progress, report, on_update, salt)
            report.summary.append(level)
            if on_update is not None:
                on_update(report)
        report.complete = True
    except BenchError as e:
        report.error = str(e)
    except KeyboardInterrupt:
        report.error = "interrupted"
    finally:
        progress.end()
    report.finished_at = now_iso()
    if on_update is not None:
        on_update(report)
    return report
