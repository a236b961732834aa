"""One error idiom across the command line: a bad cluster file is one line and exit 2 in every
command that reads it; a name that is not a command is click's usage error (exit 2); a
registered command whose module does not import is a bug and keeps its traceback."""

from __future__ import annotations

import pytest

from tests.harness.dspark_cli import invoke_dspark

COMMANDS = [
    ("config", "check"), ("plan",), ("render",), ("status",), ("wait-worker", "--timeout", "1"),
    ("check", "--no-peers"), ("dashboard", "--port", "0"), ("systemd", "render", "--node", "x"),
    ("systemd", "install", "--node", "x", "--root", "ROOT"), ("bench", "decode"), ("switch", "v0"),
]


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_a_bad_cluster_file_exits_2_everywhere(tmp_path, args):
    bad = tmp_path / "cluster.toml"
    bad.write_text("[serving\nnot toml at all\n")
    args = tuple(str(tmp_path / "root") if a == "ROOT" else a for a in args)
    r = invoke_dspark(*args, "--config", str(bad))
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert str(bad) in r.stderr and "Traceback" not in r.stderr


def test_an_unknown_command_is_a_usage_error():
    r = invoke_dspark("no-such-command")
    assert r.returncode == 2 and "No such command" in r.stderr


def test_a_registered_command_that_does_not_import_surfaces_its_import_error(monkeypatch):
    from dspark.cli.main import LazyGroup

    monkeypatch.setitem(LazyGroup.lazy, "broken", ("dspark._no_such_module_here", "broken", "A broken command."))
    with pytest.raises(ModuleNotFoundError, match="dspark._no_such_module_here"):
        invoke_dspark("broken", "--help")
    # the listing still reads the stored help only: `dspark --help` imports no command module
    r = invoke_dspark("--help")
    assert r.returncode == 0 and "A broken command." in r.stdout


@pytest.fixture
def local_cluster(tmp_path):
    from dspark.local.cluster import LocalPorts, prepare

    return prepare(tmp_path / "local", LocalPorts(api=1, master=2, agent=3))


@pytest.mark.parametrize("extra, says", [
    (("--node", "no-such-node"), "no node named 'no-such-node'"),  # config: not a node of the file
    (("--host", "0.0.0.0"), "needs an access token"),  # usage: a public address needs --token-file
], ids=["unknown node", "public without token"])
def test_dashboard_usage_and_config_errors_exit_2(local_cluster, extra, says):
    r = invoke_dspark("dashboard", "--config", str(local_cluster), "--port", "0", *extra)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr
