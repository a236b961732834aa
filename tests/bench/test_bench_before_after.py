"""The README's before/after on one pair: the same commands run twice against
the same running server, then `bench compare`. Each run salts its requests with a prefix-cache
salt of its own (vLLM's `cache_salt`), so the second run sends the identical prompts (the same
fingerprints, which `compare` demands) yet is measured afresh, not served from the cache the
first one left. Small lengths: the shared local pair is a CPU one."""

from __future__ import annotations

from dspark.bench.report import Report
from tests.harness.pair import run_dspark


def test_before_and_after_on_one_running_pair_compare(local_pair, tmp_path):
    out = str(tmp_path / "results")
    runs = {
        # 512 tokens: four full 128-token KV blocks, which an unsalted rerun takes from the cache
        "prefill": ["--lengths", "512", "--trials", "2"],
        "decode": ["--concurrency", "1,2", "--output-len", "16", "--input-len", "256"],  # default rounds
    }
    for label in ("before", "after"):
        for kind, args in runs.items():
            r = run_dspark("bench", kind, "--config", str(local_pair.cluster_file), *args, "--label", label,
                           "-o", out, "--quiet", timeout=300)
            assert r.returncode == 0, (kind, label, r.stderr)

    for kind in runs:
        a, b = (Report.load(tmp_path / "results" / f"{kind}-{label}.json") for label in ("before", "after"))
        assert a.prompt_set_sha256 == b.prompt_set_sha256  # identical prompts ...
        assert a.params["prefix_cache"] == b.params["prefix_cache"] == "fresh (salted per run)"
        c = run_dspark("bench", "compare", f"{out}/{kind}-before.json", f"{out}/{kind}-after.json")
        assert c.returncode == 0, c.stderr
        assert "hit the prefix cache" not in c.stdout, c.stdout  # ... and none served from the cache

    pre = Report.load(tmp_path / "results" / "prefill-after.json")
    assert all(s.prefix_cache_hit_trials == 0 and s.server_valid_trials >= 1 for s in pre.summary), pre.summary
    dec = Report.load(tmp_path / "results" / "decode-after.json")
    # The default rounds: 4 requests per stream, so every level has a standard error.
    assert [s.requests for s in dec.summary] == [4, 8]
    assert all(not s.prefix_cache_hit_tokens and s.aggregate_tok_s_se is not None for s in dec.summary)
    assert " ± " in (tmp_path / "results" / "decode-after.md").read_text()


def test_the_aggregate_standard_error_is_the_mean_request_times():
    from dspark.bench.decode import aggregate_se

    assert aggregate_se(100.0, [2.0, 2.0, 2.0]) == 0.0
    assert abs(aggregate_se(100.0, [1.0, 3.0]) - 100.0 * (2 ** 0.5 / 2) / 2 ** 0.5) < 1e-9  # sd / mean / sqrt(n)
    assert aggregate_se(100.0, [2.0]) is None and aggregate_se(None, [1.0, 2.0]) is None
