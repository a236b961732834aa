"""Pure parts of the bench: prompts, percentiles, /metrics deltas (on text captured from the
real local pair), reports and compare."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from dspark.bench import compare, prefill, prompts, stats
from dspark.bench.decode import DecodeSpec
from dspark.bench.prefill import PrefillSpec
from dspark.bench.report import SCHEMA_VERSION, PrefillSummary, PrefillTrial, Report, ReportError
from dspark.engine import metrics

FIXTURES = Path(__file__).parent / "fixtures"
MODEL = "dspark-local"


# ---------------------------------------------------------------------------- prompts
def test_prompt_has_exact_length_and_stays_in_range():
    for n in (1, 7, 64, 1000, 32768):
        p = prompts.make(0, "prefill-trial", n, 0)
        assert len(p.token_ids) == n
        assert min(p.token_ids) >= prompts.TOKEN_LOW and max(p.token_ids) < prompts.TOKEN_HIGH


def test_prompt_is_a_pure_function_of_its_key():
    a, b = prompts.make(3, "decode-c4", 128, 2), prompts.make(3, "decode-c4", 128, 2)
    assert a.token_ids == b.token_ids and a.sha256 == b.sha256
    # Pinned: changing the generator would silently break comparisons with old reports.
    assert prompts.make(0, "prefill-trial", 1024, 0).sha256 == \
        "5e016263c42a82b5ef3657447eb1939cf42c825ef574e9d5af430bb49bb6661c"


def test_fingerprint_is_sha256_of_little_endian_uint32_ids():
    ids = [1000, 2000, 3999]
    assert prompts.fingerprint(ids) == hashlib.sha256(struct.pack("<3I", *ids)).hexdigest()


def test_every_prompt_of_a_plan_is_unique_from_its_first_block():
    spec = PrefillSpec(lengths=(128, 256, 512), trials=3)
    ps = [spec.prompt(*step) for step in spec.plan()]
    assert len({p.sha256 for p in ps}) == len(ps)
    # Distinct first 16 tokens: no two prompts can share a KV-cache block (16 is the smallest block size).
    assert len({p.token_ids[:16] for p in ps}) == len(ps)
    d = DecodeSpec(concurrency=(1, 2, 4), rounds=2)
    dp = d.planned()
    assert len(dp) == 1 + 2 * (1 + 2 + 4) and len({p.token_ids[:16] for p in dp}) == len(dp)


def test_different_seeds_give_different_prompts():
    assert prompts.make(0, "x", 64).sha256 != prompts.make(1, "x", 64).sha256


def test_prompt_rejects_bad_length():
    with pytest.raises(ValueError):
        prompts.make(0, "x", 0)


# ---------------------------------------------------------------------------- stats
@pytest.mark.parametrize("q", [0, 1, 10, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear(q):
    rng = np.random.default_rng(7)
    for n in (1, 2, 5, 100):
        xs = rng.exponential(size=n).tolist()
        assert stats.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_percentile_small_cases():
    assert stats.percentile([], 50) is None
    assert stats.median([3.0, 1.0, 2.0]) == 2.0
    assert stats.median([1.0, 2.0, 3.0, 4.0]) == 2.5
    assert stats.percentile([10.0, 20.0], 90) == pytest.approx(19.0)
    assert stats.rate(10, 0) is None and stats.rate(10, 2) == 5
    with pytest.raises(ValueError):
        stats.percentile([1.0], 101)


# ---------------------------------------------------------------------------- metrics
def window_of(name: str) -> metrics.Window:
    before = metrics.parse_samples((FIXTURES / f"metrics-{name}-before.txt").read_text(), MODEL)
    after = metrics.parse_samples((FIXTURES / f"metrics-{name}-after.txt").read_text(), MODEL)
    return metrics.window(before, after)


def test_parse_reads_counters_histograms_gauges_and_info():
    snap = metrics.parse_samples((FIXTURES / "metrics-single-before.txt").read_text(), MODEL)
    assert snap.counter("vllm:prompt_tokens") > 0
    assert snap.hist_count("vllm:request_prefill_time_seconds") >= 1
    assert snap.gauge("vllm:num_requests_running") == 0
    assert snap.info("vllm:cache_config_info")["block_size"] == "128"
    # Another model's samples are not counted; an unknown metric is None, never 0.
    assert metrics.parse_samples((FIXTURES / "metrics-single-before.txt").read_text(), "other").counter(
        "vllm:prompt_tokens") is None
    assert snap.counter("vllm:no_such_metric") is None


def test_one_request_window_gives_a_valid_server_prefill_rate():
    w = window_of("single")  # one 256-token prompt, max_tokens=1, nothing else running
    assert (w.prefill_requests, w.computed_requests, w.prompt_tokens, w.computed_tokens) == (1, 1, 256, 256)
    j = prefill.judge(w, 256)
    assert not j.overlap and j.notes == ()
    assert j.prefill_tok_s == pytest.approx(w.computed_tokens / w.prefill_time_s)


def test_a_request_running_during_the_trial_is_an_overlap():
    w = window_of("overlap")  # a 32-token decode was in flight while the 256-token trial ran
    j = prefill.judge(w, 256)
    assert j.overlap and j.prefill_tok_s is None
    assert any("running or waiting" in n for n in j.notes)


def test_a_resent_prompt_is_a_prefix_cache_hit():
    w = window_of("cachehit")  # the 256-token prompt of "single" sent again
    j = prefill.judge(w, 256)
    assert j.prefix_cache_hit_tokens == 128 and w.computed_tokens == 128
    assert any("prefix cache" in n for n in j.notes)


def test_judge_counts_extra_requests_and_tokens():
    w = window_of("single")
    two = metrics.Window(**{**w.__dict__, "prefill_requests": 2.0, "computed_requests": 2.0,
                            "requests_finished": 2.0, "prompt_tokens": 257.0})
    j = prefill.judge(two, 256)
    assert j.overlap and j.prefill_tok_s is None
    assert any("2 requests finished prefill" in n for n in j.notes)
    assert any("moved by 257, expected 256" in n for n in j.notes)


def test_missing_histograms_mean_not_reported_not_zero():
    text = "\n".join(line for line in (FIXTURES / "metrics-single-after.txt").read_text().splitlines()
                     if "request_prefill_time_seconds" not in line) + "\n"
    before = metrics.parse_samples((FIXTURES / "metrics-single-before.txt").read_text(), MODEL)
    w = metrics.window(before, metrics.parse_samples(text, MODEL))
    assert w.prefill_time_s is None
    j = prefill.judge(w, 256)
    assert j.prefill_tok_s is None and any("does not report" in n for n in j.notes)


def test_spec_decode_figures():
    w = window_of("single")
    assert metrics.spec_decode(w) is None  # the local pair has no speculative decoding
    s = metrics.spec_decode(metrics.Window(**{**w.__dict__, "spec_drafts": 10.0, "spec_draft_tokens": 50.0,
                                               "spec_accepted_tokens": 30.0}))
    assert s.acceptance_rate == pytest.approx(0.6) and s.mean_acceptance_length == pytest.approx(4.0)


# ---------------------------------------------------------------------------- reports
def make_report(seed: int = 0, label: str = "a", ttft: float = 0.1) -> Report:
    spec = PrefillSpec(lengths=(64, 128), trials=2, seed=seed, label=label)
    planned = [spec.prompt(*s).sha256 for s in spec.plan()]
    r = Report(kind="prefill", label=label, server={"url": "u", "runtime_version": "0.28.0"},
               params=spec.params(), prompt_set_sha256=prompts.set_fingerprint(planned), planned_prompts=planned)
    r.trials = [PrefillTrial(length=64, role="trial", index=0, prompt_sha256=planned[2], at_s=0.0, ttft_s=ttft,
                             e2e_s=ttft, client_input_tok_s=64 / ttft, server_requests=1, server_prompt_tokens=64,
                             server_computed_tokens=64, server_prefill_time_s=ttft / 2,
                             server_prefill_tok_s=128 / ttft, prefix_cache_hit_tokens=0)]
    r.summary = prefill.summarize(r.trials, spec.lengths)
    return r


def test_report_saves_and_loads_itself(tmp_path):
    r = make_report()
    path = r.save(tmp_path / "x" / "r.json")
    back = Report.load(path)
    assert back == r and isinstance(back.trials[0], PrefillTrial) and isinstance(back.summary[0], PrefillSummary)
    data = json.loads(path.read_text())
    assert data["schema"] == "dspark.bench.report" and data["schema_version"] == SCHEMA_VERSION


def test_report_load_refuses_foreign_and_newer_files(tmp_path):
    (tmp_path / "a.json").write_text('{"hello": 1}')
    with pytest.raises(ReportError, match="not a dspark bench report"):
        Report.load(tmp_path / "a.json")
    data = make_report().to_dict() | {"schema_version": SCHEMA_VERSION + 1}
    (tmp_path / "b.json").write_text(json.dumps(data))
    with pytest.raises(ReportError, match="upgrade dspark"):
        Report.load(tmp_path / "b.json")
    (tmp_path / "c.json").write_text("{")
    with pytest.raises(ReportError, match="not JSON"):
        Report.load(tmp_path / "c.json")


def test_compare_table_and_gains():
    text = compare.table(make_report(label="before", ttft=0.2), make_report(label="after", ttft=0.1))
    assert "| 64 | TTFT median (ms) | 200.0 | 100.0 | +100.0% |" in text
    assert "| 64 | client input tok/s (tok/s) | 320.0 | 640.0 | +100.0% |" in text
    assert compare.gain(100, 50, higher_is_better=True) == pytest.approx(-0.5)
    assert compare.gain(None, 50, True) is None


def test_compare_refuses_different_prompts_and_kinds():
    with pytest.raises(compare.CompareRefused, match="prompt fingerprints differ"):
        compare.table(make_report(seed=0), make_report(seed=1))
    other = make_report()
    other.kind = "decode"
    with pytest.raises(compare.CompareRefused, match="prefill report with a decode report"):
        compare.check_comparable(make_report(), other)
