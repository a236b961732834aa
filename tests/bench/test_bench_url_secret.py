"""`dspark bench --url http://user:password@host...` keeps the user name and
password out of every report file and every printed line (reports are world-readable)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from dspark.cli.main import main
from tests.bench.test_bench_hostile import routes
from tests.harness.hostile import HostileServer

SECRET = "pw-21-hush"


@pytest.mark.parametrize("userinfo", [f"operator:{SECRET}@", f"{SECRET}@", f"op%40x:{SECRET}@"])
def test_url_userinfo_never_reaches_a_report_or_a_line(tmp_path, userinfo):
    with HostileServer(routes()) as s:
        url = s.url.replace("http://", "http://" + userinfo, 1)
        r = CliRunner().invoke(main, ["bench", "decode", "--url", url, "--concurrency", "1", "--output-len", "4",
                                      "--input-len", "4", "--rounds", "2", "-o", str(tmp_path),
                                      "--request-timeout", "5"], env={"DSPARK_API_KEY": None})
    assert r.exit_code == 0 and r.exception is None, (r.output, r.exception)
    assert SECRET not in r.output and "operator" not in r.output, r.output
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.suffix == ".json" for p in written), written
    for p in written:
        data = p.read_bytes()
        assert SECRET.encode() not in data and b"operator" not in data, p
    report = next(p for p in written if p.suffix == ".json").read_text()
    assert s.url in report  # the URL itself is still recorded, without its user part


def test_url_refusal_does_not_echo_a_password():
    r = CliRunner().invoke(main, ["bench", "decode", "--url", f"ftp://operator:{SECRET}@127.0.0.1:9/"])
    assert r.exit_code == 2 and SECRET not in r.output, r.output
