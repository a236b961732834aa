"""The pieces of a runtime-line switch that need no pair: the cluster file's line_commands
(dspark.config.validate), the line state a node keeps (dspark.lines.state) and the switch's verdict
(dspark.switch.judge) on real decode reports' shape."""

from __future__ import annotations

import json

import pytest

from dspark.bench.report import DecodeLevel, Report
from dspark.config import validate as C
from dspark.config.schema import Cluster, ConfigError
from dspark.lines import state as L
from dspark.lines.history import table as history_table
from dspark.switch import judge, score

A, B = "v0.28.0", "v0.32.0"


def cluster(**serving) -> Cluster:
    return C.from_dict({"model": {"path": "/m"},
                        "serving": {"vllm_command": ["/a/bin/vllm"], "kv_cache_dtype": "auto", "moe_backend": "auto",
                                    **serving},
                        "nodes": [{"name": "h", "rank": 0, "address": "10.0.0.1"},
                                  {"name": "w", "rank": 1, "address": "10.0.0.2"}]})


def refusals(**serving) -> str:
    with pytest.raises(ConfigError) as e:
        cluster(**serving)
    return "\n".join(e.value.problems)


def test_line_commands_name_each_installed_lines_command_and_on_line_picks_it():
    c = cluster(line_commands={B: ["/b/bin/vllm"], A: ["/a/bin/vllm"]})
    assert c.on_line(B).serving.vllm_command == ["/b/bin/vllm"] and c.on_line(B).serving.runtime_line == B
    assert c.on_line(A).serving.vllm_command == ["/a/bin/vllm"]
    assert cluster().on_line(A).serving.vllm_command == ["/a/bin/vllm"]  # the file's own line: vllm_command
    with pytest.raises(ConfigError) as e:
        cluster().on_line(B)
    assert "not installed" in e.value.problems[0] and B in e.value.problems[0]


def test_line_commands_are_validated_like_the_rest_of_the_file():
    assert "not a known runtime line" in refusals(line_commands={"v9.9.9": ["/x"]})
    assert "must name that line's vLLM CLI" in refusals(line_commands={B: []})
    assert "differs from serving.vllm_command" in refusals(line_commands={A: ["/other/vllm"]})
    assert "takes a secret" in refusals(line_commands={B: ["/b/vllm", "--api-key=x"]})
    assert "expected" in refusals(line_commands={B: "/b/vllm"}) or "line_commands" in refusals(line_commands={B: "/b"})


def test_the_state_overrides_the_files_line_until_the_file_names_another(tmp_path):
    assert L.current(tmp_path, A) == L.LineState(A, A)             # no state: the file's line
    sw = L.Switch("s1", A, B, 1.0)
    L.write(tmp_path, L.LineState(B, A, sw))
    assert L.current(tmp_path, A) == L.LineState(B, A, sw)
    assert L.current(tmp_path, B) == L.LineState(B, B)             # a new file's line supersedes it
    (tmp_path / L.FILE).write_text("{not json")
    assert L.current(tmp_path, A) == L.LineState(A, A)             # unreadable: the file's line holds
    assert json.loads(json.dumps(L.LineState(B, A, sw).to_json()))["switch"]["to"] == B


def report(*tok_s: float, error: str | None = None) -> Report:
    import dataclasses

    blank = {f.name: None for f in dataclasses.fields(DecodeLevel)}
    levels = [DecodeLevel(**{**blank, "concurrency": c, "requests": 4, "output_tokens": 100, "duration_s": 100 / t,
                             "aggregate_tok_s": t}) for c, t in zip((1, 4), tok_s, strict=True)]
    return Report(kind="decode", label="x", server={}, params={}, prompt_set_sha256="", summary=levels, error=error)


def test_the_verdict_uses_the_band_the_runs_measured():
    before = [report(10, 40), report(11, 44)]            # 10 % apart: 1 - 20/22 ~ 9.1 %
    v = judge(before, [report(10, 40), report(10, 40)])
    assert v.kept and v.band == pytest.approx(1 - score(before[0]) / score(before[1]))
    slow = judge(before, [report(10, 10), report(10, 10)])  # c=4 at a quarter: the geometric mean halves
    assert not slow.kept and "regression" in slow.reason and slow.gain < -slow.band
    noisy = judge([report(10, 40), report(10, 40)], [report(10, 40), report(5, 20)])  # the new line's spread counts
    assert noisy.kept and noisy.band == pytest.approx(0.5)  # its runs scored 20 and 10
    assert not judge(before, [report(10, 40), report(10, 40, error="HTTP 500")]).kept
    assert not judge(before, []).kept
    flat = [report(10, 40), report(10, 40)]
    assert judge(flat, [report(9.7, 39), report(9.7, 39)]).band == 0.05  # the floor
    assert not judge(flat, [report(9, 36), report(9, 36)]).kept         # -10 % beyond 5 %


def test_history_is_listed_as_a_table():
    rows = history_table([{"started_at": 0, "from_line": A, "to_line": B, "verdict": "rolled back", "band": 0.1,
                           "gain": -0.5, "down_s": 61.2, "serving_on": A, "reason": "regression"}])
    assert "rolled back" in rows and "-50.0%" in rows and "61 s" in rows
    assert history_table([]) == "no switch recorded"


def test_a_noisy_old_line_never_blinds_the_gate():
    # CI, 2026-12-03: the old line's two runs scored 124.2 and 304.5 tok/s, the slowed line 51.2
    # and 40.7. Judged on the arithmetic mean, the band (84 %) nearly reached 100 %, beyond which
    # no drop at all could be a regression; on the log scale the runs are 2.45x apart and the new
    # line 4.3x below the old one.
    one_level = lambda t: report(t, t)  # noqa: E731 (both levels at t: the run's score is t)
    ci = judge([one_level(124.2), one_level(304.5)], [one_level(51.2), one_level(40.7)])
    assert not ci.kept and "regression" in ci.reason, ci
    assert ci.band == pytest.approx(1 - 124.2 / 304.5) and ci.gain < -ci.band
    for spread in (2.0, 3.0, 10.0):  # however far apart the old line's runs are, a larger drop is caught
        v = judge([one_level(100.0), one_level(100.0 * spread)], [one_level(1.0), one_level(1.0)])
        assert not v.kept and v.band < 1, (spread, v)
    # a drop the runs' own spread allows is still kept
    assert judge([one_level(124.2), one_level(304.5)], [one_level(150.0), one_level(160.0)]).kept
