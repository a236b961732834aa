"""`bench compare` shows the noise (issue 34, item 3): every figure with its standard error, every
gain with the band it is judged against, and a difference inside the noise marked so. Reports
are built the way a run builds them (decode.summarize_level, prefill.summarize over the trials),
saved, and compared through the command line."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from dspark.bench import compare, decode, prefill, prompts
from dspark.bench.report import DecodeRequest, PrefillTrial, Report
from tests.harness.dspark_cli import invoke_dspark

OUT = 16  # output tokens per request


def decode_report(label: str, e2e: list[float], itl_jitter: float) -> Report:
    """One level (c = 1, 4 rounds), the requests back to back: each request's time is its e2e,
    its tokens evenly spaced (ITL e2e / OUT, jittered by +/- itl_jitter of it)."""
    spec = decode.DecodeSpec(concurrency=(1,), output_len=OUT, rounds=len(e2e), label=label)
    planned = [p.sha256 for p in spec.planned()]
    r = Report(kind="decode", label=label, server={"url": "u", "runtime_version": "0.28.0"}, params=spec.params(),
               prompt_set_sha256=prompts.set_fingerprint(planned), planned_prompts=planned, complete=True)
    for i, t in enumerate(e2e):
        gap = t / OUT
        itl = [gap * (1 + itl_jitter * (-1) ** k) for k in range(OUT - 1)]
        r.trials.append(DecodeRequest(concurrency=1, role="trial", index=i, prompt_sha256=planned[i + 1],
                                      prompt_tokens=128, output_tokens=OUT, start_s=sum(e2e[:i]), ttft_s=gap,
                                      e2e_s=t, decode_tok_s=(OUT - 1) / (t - gap), itl_s=itl))
    r.summary = [decode.summarize_level(1, r.trials, sum(e2e), None)]
    return r


def rows(text: str) -> dict[str, list[str]]:
    """The table's rows by figure: [before, after, gain, noise, verdict]."""
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 7 and cells[0].replace(",", "").isdigit():
            out[cells[1]] = cells[2:]
    return out


def compared(tmp_path, a: Report, b: Report) -> str:
    r = invoke_dspark("bench", "compare", str(a.save(tmp_path / "a.json")), str(b.save(tmp_path / "b.json")))
    assert r.returncode == 0, r.stderr
    return r.stdout


# Nothing changed but the host's mood: request times spread from 1 to 4 s, the same spread
# 1.5x slower (a -33 % "drop" in throughput, as two runs on a loaded host show).
NOISY = [1.0, 2.0, 3.0, 4.0]
# The same 1.5x, measured by steady requests: far beyond their noise.
STEADY = [2.0, 2.02, 1.98, 2.0]


def test_a_drop_inside_the_noise_is_marked_within_noise(tmp_path):
    text = compared(tmp_path, decode_report("before", NOISY, 0.5),
                    decode_report("after", [x * 1.5 for x in NOISY], 0.5))
    agg = rows(text)["aggregate tok/s (tok/s)"]
    assert agg[2] == "-33.3%" and agg[4] == "within noise", agg
    assert re.fullmatch(r"6\.4\d* ± \d+\.\d+", agg[0]) and " ± " in agg[1], agg  # the ± of each run
    # the band is twice the standard error of the difference, over the figure the gain divides by
    a, b = (Report.load(tmp_path / n) for n in ("a.json", "b.json"))
    se_a, se_b = a.summary[0].aggregate_tok_s_se, b.summary[0].aggregate_tok_s_se
    band = 2 * math.hypot(se_a, se_b) / a.summary[0].aggregate_tok_s
    assert agg[3] == f"±{band:.1%}" and band > 1 / 3, (agg, band)
    assert "± is one standard error" in text and "within noise" in text


def test_the_same_drop_beyond_the_noise_is_marked_worse(tmp_path):
    text = compared(tmp_path, decode_report("before", STEADY, 0.01),
                    decode_report("after", [x * 1.5 for x in STEADY], 0.01))
    table = rows(text)
    agg = table["aggregate tok/s (tok/s)"]
    assert agg[2] == "-33.3%" and agg[4] == "worse", agg
    assert float(agg[3].strip("±%")) < 5, agg
    for figure in ("per-stream decode tok/s (median) (tok/s)", "TTFT p50 (ms)", "ITL p50 (ms)", "ITL p99 (ms)"):
        assert table[figure][4] == "worse" and " ± " in table[figure][0], (figure, table[figure])
    assert "0 of 5 differences with a known noise are within it; beyond it: 0 better, 5 worse" in text, text


def test_nothing_changed_is_within_noise_both_ways(tmp_path):
    """The same requests in another order: every figure within its noise, gains of either sign."""
    text = compared(tmp_path, decode_report("before", NOISY, 0.3), decode_report("after", NOISY[::-1], 0.3))
    judged = {k: v[4] for k, v in rows(text).items()}
    assert set(judged.values()) == {"within noise"}, judged
    assert "5 of 5 differences with a known noise are within it." in text, text


def prefill_report(label: str, ttfts: list[float]) -> Report:
    spec = prefill.PrefillSpec(lengths=(64,), trials=len(ttfts), label=label)
    planned = [spec.prompt(*s).sha256 for s in spec.plan()]
    r = Report(kind="prefill", label=label, server={"url": "u", "runtime_version": "0.28.0"}, params=spec.params(),
               prompt_set_sha256=prompts.set_fingerprint(planned), planned_prompts=planned, complete=True)
    r.trials = [PrefillTrial(length=64, role="trial", index=i, prompt_sha256=planned[i], at_s=float(i), ttft_s=t,
                             e2e_s=t, client_input_tok_s=64 / t, server_requests=1, server_prompt_tokens=64,
                             server_computed_tokens=64, server_prefill_time_s=t / 2, server_prefill_tok_s=128 / t,
                             prefix_cache_hit_tokens=0) for i, t in enumerate(ttfts)]
    r.summary = prefill.summarize(r.trials, spec.lengths)
    return r


def test_prefill_medians_carry_their_order_statistic_noise(tmp_path):
    noisy = compared(tmp_path, prefill_report("before", [0.1, 0.2, 0.3, 0.4, 0.5]),
                     prefill_report("after", [0.15, 0.25, 0.35, 0.45, 0.55]))
    ttft = rows(noisy)["TTFT median (ms)"]
    assert ttft[0].startswith("300.0 ± ") and ttft[1].startswith("350.0 ± "), ttft
    assert ttft[2] == "-14.3%" and ttft[4] == "within noise", ttft
    steady = compared(tmp_path, prefill_report("before", [0.300, 0.301, 0.299, 0.300, 0.302]),
                      prefill_report("after", [0.350, 0.351, 0.349, 0.350, 0.352]))
    table = rows(steady)
    assert table["TTFT median (ms)"][2] == "-14.3%" and table["TTFT median (ms)"][4] == "worse", table
    assert {v[4] for v in table.values()} == {"worse"}, table


def test_a_single_trial_has_no_noise_to_judge_by(tmp_path):
    text = compared(tmp_path, prefill_report("before", [0.2]), prefill_report("after", [0.1]))
    ttft = rows(text)["TTFT median (ms)"]
    assert ttft == ["200.0", "100.0", "+100.0%", "unknown", "noise unknown"], ttft
    assert "3 without a standard error on both sides" in text, text


def test_percentile_se_matches_the_median_standard_error_of_a_normal_sample():
    """The order-statistic standard error against the known one, 1.2533 sigma / sqrt(n)."""
    rng = np.random.default_rng(34)
    n = 400
    ses = [compare.percentile_se(rng.normal(size=n).tolist(), 50) for _ in range(50)]
    assert all(se is not None for se in ses)
    mean = float(np.mean(ses))
    assert mean == pytest.approx(1.2533 / math.sqrt(n), rel=0.15), mean
    assert compare.percentile_se([1.0], 50) is None and compare.percentile_se([2.0, 2.0, 2.0], 50) == 0.0
