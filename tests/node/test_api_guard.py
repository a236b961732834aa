"""The API key on every route vLLM serves but /health, and no browser origin unless the cluster
file names one (issue 33, item 2).

vLLM's own key check guards the paths under /v1 only: with a key set, POST /invocations ran
completions and /tokenize answered without it, and a CORS preflight from any origin got
`access-control-allow-origin: *`. dspark renders `--middleware dspark_api_guard.GuardEveryRoute`
(dspark/data/vllm_middleware/, on vLLM's PYTHONPATH) and `--allowed-origins` from
serving.allowed_origins (default none). tests/harness/api_guard_probe.py builds vLLM's own app from the
flags dspark renders, with each line's vLLM, and asks every route of its router with and without
the key; the stock flags show the hole it closes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from dspark.config import validate as C
from dspark.config.schema import Cluster
from dspark.node.launch import API_GUARD_DIR, node_env, render

TESTS = Path(__file__).parents[1]
FIXTURE = TESTS / "fixtures" / "cluster-two-node.toml"
PROBE = TESTS / "harness" / "api_guard_probe.py"
KEY = "sk-guard-test"

pytestmark = pytest.mark.vllm


def frontend_flags(cluster: Cluster) -> list[str]:
    """The rendered head's flags that shape vLLM's HTTP app."""
    argv = render(cluster, cluster.head).argv
    out = []
    for flag in ("--middleware", "--allowed-origins"):
        if flag in argv:
            out += argv[argv.index(flag):argv.index(flag) + 2]
    return out


def probe(python, flags: list[str], origin: str = "http://evil.example") -> dict:
    env = dict(os.environ, PYTHONPATH=str(API_GUARD_DIR))  # as the supervisor gives vLLM the guard
    r = subprocess.run([str(python), str(PROBE), json.dumps(flags), KEY, origin],
                       capture_output=True, text=True, timeout=300, check=False, env=env)
    found = [line for line in r.stdout.splitlines() if line.startswith("@@")]
    assert found, f"the probe did not report:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return json.loads(found[0][2:])


def pythons():
    """(line, python) for each runtime line installed here: this venv's vLLM 0.28.0, and
    .venv-lines/v0.32.0 when .ci/setup installed it."""
    out = [pytest.param(sys.executable, id="v0.28.0")]
    line = TESTS.parent / ".venv-lines" / "v0.32.0" / "bin" / "python"
    out.append(pytest.param(line, id="v0.32.0", marks=pytest.mark.skipif(
        not line.is_file(), reason="no .venv-lines/v0.32.0 here (.ci/setup installs it)")))
    return out


@pytest.fixture(scope="module")
def cluster():
    return C.load(FIXTURE)


@pytest.mark.parametrize("python", pythons())
def test_every_route_but_health_wants_the_key_and_no_origin_is_allowed(python, cluster):
    pytest.importorskip("vllm")
    out = probe(python, frontend_flags(cluster))
    routes = {(m, p): (without, with_key) for m, p, without, with_key in out["routes"]}
    # vLLM's router as the probe saw it: the doors the issue names are there.
    for door in [("POST", "/invocations"), ("POST", "/tokenize"), ("GET", "/metrics"), ("GET", "/version"),
                 ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/health")]:
        assert door in routes, sorted(routes)
    open_ = {door for door, (without, _) in routes.items() if without != 401}
    assert open_ == {("GET", "/health")}, open_
    refused_with_key = {door for door, (_, with_key) in routes.items() if with_key == 401}
    assert not refused_with_key
    assert out["cors"] is None


@pytest.mark.parametrize("python", pythons())
def test_vllms_own_flags_leave_the_other_doors_open(python):
    """The before: vLLM's key check alone (no dspark flags)."""
    pytest.importorskip("vllm")
    out = probe(python, [])
    open_ = {(m, p) for m, p, without, _ in out["routes"] if without != 401}
    assert {("POST", "/invocations"), ("POST", "/tokenize"), ("GET", "/metrics")} <= open_
    # vLLM 0.28.0 lets every origin in; 0.32.0 lets none in by default (launchers/cli_args.py).
    assert out["cors"] == ("*" if python == sys.executable else None)


def test_a_named_origin_is_the_only_one_allowed(cluster):
    pytest.importorskip("vllm")
    named = replace(cluster, serving=replace(cluster.serving, allowed_origins=["https://chat.example.org"]))
    flags = frontend_flags(named)
    assert flags[flags.index("--allowed-origins") + 1] == '["https://chat.example.org"]'
    assert probe(sys.executable, flags, "https://chat.example.org")["cors"] == "https://chat.example.org"
    assert probe(sys.executable, flags)["cors"] is None


def test_the_guard_directory_leads_vllms_pythonpath(cluster):
    with_path = replace(cluster, serving=replace(cluster.serving, env={**cluster.serving.env, "PYTHONPATH": "/opt/x"}))
    assert node_env(with_path, with_path.head)["PYTHONPATH"] == f"{API_GUARD_DIR}:/opt/x"
    assert node_env(cluster, cluster.nodes[1])["PYTHONPATH"] == str(API_GUARD_DIR)
    assert (API_GUARD_DIR / "dspark_api_guard.py").is_file()
