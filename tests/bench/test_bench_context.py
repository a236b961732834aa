"""What bench tells a user: compare names the parameter in which two
reports differ, in the options of their own kind."""

import pytest

from dspark.bench import compare, decode, prompts
from dspark.bench.report import Report


def decode_report(**spec) -> Report:
    s = decode.DecodeSpec(concurrency=(1, 2), output_len=16, **spec)
    planned = [p.sha256 for p in s.planned()]
    return Report(kind="decode", label="x", server={"url": "u", "runtime_version": "0.28.0"}, params=s.params(),
                  prompt_set_sha256=prompts.set_fingerprint(planned), planned_prompts=planned)


@pytest.mark.parametrize("spec, named", [({"input_len": 64}, "input_len 128 vs 64"),
                                         ({"rounds": 2}, "rounds 4 vs 2"), ({"seed": 3}, "seed 0 vs 3")])
def test_compare_names_the_decode_parameter_that_differs(spec, named):
    with pytest.raises(compare.CompareRefused) as e:
        compare.check_comparable(decode_report(), decode_report(**spec))
    msg = str(e.value)
    assert named in msg, msg
    assert "lengths" not in msg and "trials" not in msg, msg  # a decode report has neither
    assert "--input-len" in msg or "workload parameters differ" in msg


def figure_texts(fig) -> list[str]:
    texts = [fig._suptitle.get_text()] if fig._suptitle else []
    for ax in fig.axes:
        texts += [t.get_text() for t in ax.texts] + [ax.get_ylabel()]
    return texts


def test_decode_plot_says_the_workload_and_the_samples_behind_each_percentile(tmp_path):
    from dspark.bench import plot
    from dspark.bench.report import DecodeRequest

    r = decode_report(rounds=2)
    for c in (1, 2):
        for i in range(c * 2):
            r.trials.append(DecodeRequest(concurrency=c, role="trial", index=i, prompt_sha256="x", prompt_tokens=128,
                                          output_tokens=16, start_s=0.0, ttft_s=0.05, e2e_s=0.5, decode_tok_s=30.0,
                                          itl_s=[0.03] * 15))
    r.summary = [decode.summarize_level(c, [t for t in r.trials if t.concurrency == c], 1.0, None) for c in (1, 2)]
    texts = figure_texts(plot.figure(r))
    title = texts[0]
    assert "input 128 tok" in title and "output 16 tok" in title and "requests per level 2, 4" in title, title
    assert "n=2 req" in texts and "n=4 req" in texts, texts
    assert "n=30 gaps" in texts and "n=60 gaps" in texts, texts  # 15 gaps per request
    assert plot.plot(r, tmp_path / "p.png").stat().st_size > 0


def test_prefill_plot_says_trials_per_length(tmp_path):
    from dspark.bench import plot
    from tests.bench.test_bench_units import make_report

    texts = figure_texts(plot.figure(make_report()))
    assert "2 trial(s) per input length" in texts[0], texts[0]
    assert "n=1" in texts, texts  # one clean trial at 64 tokens in the fixture report
