"""CLI errors that need no server."""

from __future__ import annotations

import socket

import pytest

from dspark.bench import prefill
from dspark.bench.client import BenchError, Target
from tests.harness.dspark_cli import invoke_dspark


def test_unreachable_server_is_one_clear_line(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    r = invoke_dspark("bench", "prefill", "--url", f"http://127.0.0.1:{port}", "-o", str(tmp_path))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "server unreachable or failing" in r.stderr and "Connection refused" in r.stderr
    with pytest.raises(BenchError, match="unreachable"):
        prefill.run(Target(f"http://127.0.0.1:{port}"), prefill.PrefillSpec(lengths=(64,)))


def test_no_server_named_is_a_clear_error(tmp_path):
    env = {"DSPARK_CONFIG": None}  # unset for the call
    r = invoke_dspark("bench", "decode", "-o", str(tmp_path), env=env)
    assert r.returncode == 2 and "no server named" in r.stderr and "--url" in r.stderr
    r = invoke_dspark("bench", env=env)
    assert r.returncode == 0 and "prefill" in r.stdout and "compare" in r.stdout


def test_bad_options_are_usage_errors(tmp_path):
    r = invoke_dspark("bench", "prefill", "--url", "http://127.0.0.1:9", "--lengths", "1K,x", "-o", str(tmp_path))
    assert r.returncode == 2 and "'x' is not a whole number" in r.stderr
    r = invoke_dspark("bench", "decode", "--url", "127.0.0.1:9", "-o", str(tmp_path))
    assert r.returncode == 2 and "must start with http://" in r.stderr


def test_compare_of_unreadable_files(tmp_path):
    (tmp_path / "a.json").write_text("[]")
    r = invoke_dspark("bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "missing.json"))
    assert r.returncode == 2 and "not a dspark bench report" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("command, spec", [("decode", "DecodeSpec"), ("prefill", "PrefillSpec")])
def test_the_options_defaults_are_the_specs(command, spec):
    """Each default is stated once, on the spec the run takes: the options read it from there."""
    import dataclasses

    import click

    from dspark.bench import decode, prefill
    from dspark.bench.client import Target
    from dspark.cli import bench as bench_cli

    cls = getattr(decode if command == "decode" else prefill, spec)
    options = [p for p in bench_cli.bench.commands[command].params if isinstance(p, click.Option)]
    defaults = {p.name: p.default for p in options}
    if command == "prefill":  # no fixed default: the spec's lengths that fit the server, named in the help
        lengths = next(p for p in options if p.name == "lengths")
        assert defaults.pop("lengths") is None and ",".join(f"{n // 1024}K" for n in cls().lengths) in lengths.help
    for f in dataclasses.fields(cls):
        if f.name in defaults:
            want = ",".join(map(str, f.default)) if isinstance(f.default, tuple) else f.default
            assert defaults[f.name] == want, f.name
    assert {"seed", "label"} <= set(defaults) and (command == "prefill" or "rounds" in defaults)
    timeout = next(f.default for f in dataclasses.fields(Target) if f.name == "timeout_s")
    assert defaults["request_timeout"] == timeout
