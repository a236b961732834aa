"""What bench tells a user (issue 15 items 9 and 11): compare names the parameter in which two
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
                                         ({"rounds": 2}, "rounds 1 vs 2"), ({"seed": 3}, "seed 0 vs 3")])
def test_compare_names_the_decode_parameter_that_differs(spec, named):
    with pytest.raises(compare.CompareRefused) as e:
        compare.check_comparable(decode_report(), decode_report(**spec))
    msg = str(e.value)
    assert named in msg, msg
    assert "lengths" not in msg and "trials" not in msg, msg  # a decode report has neither
    assert "--input-len" in msg or "workload parameters differ" in msg
