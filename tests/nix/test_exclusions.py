"""What nix/lock-runtime.py leaves out of the runtime (EXCLUDED) is not needed to serve text:
the tests' venv, where the real vLLM 0.28.0 (CPU build) serves the local pair, lacks each of
them, vLLM imports there, and the pair answers a completion."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest

from tests.nix.nix_support import REPO

LOCK = json.loads((REPO / "nix/runtime-lock.json").read_text())

pytestmark = pytest.mark.nix  # the Nix runtime's lock, checked against the tests' venv (no Nix needed)


@pytest.mark.vllm  # imports vLLM (seconds)
def test_excluded_packages_are_absent_where_vllm_imports():
    code = ("import importlib.util, importlib.metadata as m, json, sys; "
            "names = json.loads(sys.argv[1]); "
            "present = [n for n in names if importlib.util.find_spec(n) is not None]; "
            "import vllm; print(json.dumps(present)); print(m.version('vllm'))")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(sorted(LOCK["excluded"]))],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    present, version = proc.stdout.strip().splitlines()[-2:]
    assert json.loads(present) == []
    assert version.startswith("0.28.0")


@pytest.mark.pair
def test_the_pair_serves_without_them(local_pair):
    req = urllib.request.Request(local_pair.api_url + "/v1/completions", method="POST",
                                 data=json.dumps({"model": "dspark-local", "prompt": [1, 2, 3],
                                                  "max_tokens": 2}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.loads(r.read())
    assert out["choices"] and out["usage"]["completion_tokens"] == 2
