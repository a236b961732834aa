"""README.md's runnable commands, run as written against the real local pair: every
`sh` block is read; each command that can run on this machine runs (with the pair's own ports
and directory in place of the defaults), and every other one must be of a kind listed here
with the reason it cannot, so a new README command cannot go untested unnoticed. A `python`
block is a script the README says to save ("save it as `chat.py`:"); a command runs it."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.harness.docs_text import documents
from tests.harness.pair import ROOT

pytestmark = pytest.mark.pair

README = ROOT / "README.md"  # and docs/*.md: every document's commands (docs_text's documents)
# Documents whose commands another test runs against the pair, and which.
OTHER_TESTS = {"clients.md": "tests/local/test_other_clients.py runs the clients' commands"}
# Commands that cannot run in this test, by their first word(s), and why.
NOT_HERE = {
    ".ci/setup": "sets up the venv the tests already run in",
    ".ci/run": "runs this very suite",
    "sudo": "installs units or switches a NixOS system (root, a real host: tests/systemd covers the units)",
    "nix": "needs nixpkgs, which cannot be fetched here (README: What was built and evaluated)",
    "python3": "the runtime lock and replay: minutes and 4 GB of wheels (tests/nix covers them where cached)",
    "/tmp/lockenv/bin/python": "the runtime lock (needs the network)",
    ".venv/bin/vllm": "vllm bench serve: tests/local/test_local_model.py runs it against the pair "
                      "with the local model's tokenizer",
    "hf": "downloads the 155 GiB checkpoint (docs/nixos.md)",
    "openssl": "makes an API key and encrypts it with agenix, which is not installed here "
               "(tests/nix/test_nixos_doc_snippets.py evaluates the files it goes with)",
}


def docs_text() -> str:
    """Every document whose commands this test runs: all but OTHER_TESTS'."""
    return "\n".join(p.read_text() for p in documents() if p.name not in OTHER_TESTS)


def commands() -> list[str]:
    out = []
    for block in re.findall(r"```sh\n(.*?)```", docs_text(), re.S):
        text = re.sub(r"\\\n\s*", " ", block)  # join continued lines
        for line in text.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line:
                out.append(line)
    return out


def scripts() -> dict[str, str]:
    """The README's `python` blocks, by the file name it says to save each as."""
    text = docs_text()
    named = dict((name, code) for name, code in
                 re.findall(r"save it as `([\w.-]+\.py)`:\n\n```python\n(.*?)```", text, re.S))
    assert len(named) == len(re.findall(r"```python\n", text)), "a README python block not named a file to save"
    return named


def runnable(cmd: str) -> bool:
    first = cmd.split()[0]
    if first in ("dspark", ".venv/bin/dspark", "curl", ".venv/bin/python"):
        return True
    assert first in NOT_HERE, f"README command of an unknown kind (run it here, or list why not): {cmd}"
    return False


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_here(cmd: str, pair, tmp: Path) -> str:
    """The command with this pair's directory and ports, and dspark as this checkout has it."""
    cmd = re.sub(r"^dspark ", ".venv/bin/dspark ", cmd)
    cmd = cmd.replace(".dspark/local/cluster.toml", str(pair.cluster_file))
    cmd = cmd.replace("http://127.0.0.1:8000", pair.api_url)
    cmd = cmd.replace(" cluster.toml", f" {tmp / 'cluster.toml'}").replace(" results/", f" {tmp / 'results'}/")
    for name, code in scripts().items():  # the saved script, with this pair's API address
        if cmd.endswith(f" {name}") or f" {name} " in cmd:
            (tmp / name).write_text(code.replace("http://127.0.0.1:8000", pair.api_url))
            cmd = re.sub(rf"(?<= ){re.escape(name)}(?= |$)", str(tmp / name), cmd)
    return cmd


def test_every_readme_command_is_run_here_or_says_why_not():
    cmds = commands()
    assert cmds
    ran = [c for c in cmds if runnable(c)]
    assert any(c.startswith("curl ") for c in ran) and any(" status " in c for c in ran)
    assert "chat.py" in scripts() and "openai.OpenAI(" in scripts()["chat.py"]
    for name in scripts():  # every script the README gives is run by one of its commands
        assert any(c.startswith(".venv/bin/python ") and c.split()[-1] == name for c in ran), name


def test_readme_commands_run_against_the_local_pair(local_pair, tmp_path):
    results = {}
    for cmd in filter(runnable, commands()):
        here = as_here(cmd, local_pair, tmp_path)
        if " dashboard " in here:  # a server: started, read, stopped
            port = free_port()
            proc = subprocess.Popen(shlex.split(here) + ["--port", str(port)], cwd=ROOT,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                snap = None
                for _ in range(60):
                    try:
                        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/snapshot", timeout=2) as r:
                            snap = json.loads(r.read())
                        if snap["round"] >= 2:
                            break
                    except OSError:
                        pass
                    time.sleep(0.5)
                assert snap and snap["serving"] and snap["model"] == "dspark-local", snap
            finally:
                proc.terminate()
                proc.wait(timeout=30)
            results[cmd] = 0
            continue
        r = subprocess.run(here, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=300)
        results[cmd] = r.returncode
        if cmd.startswith("curl "):  # the reply the request asked for: its length, its token ids
            assert r.returncode == 0, (cmd, r.stderr[-2000:])
            body = json.loads(re.search(r"-d '(\{.*?\})'", cmd).group(1))
            reply = json.loads(r.stdout)
            assert reply["choices"] and 0 < reply["usage"]["completion_tokens"] <= body["max_tokens"], r.stdout
            if body.get("return_token_ids"):
                assert len(reply["choices"][0]["token_ids"]) == reply["usage"]["completion_tokens"], r.stdout
            if "messages" in body:
                assert reply["choices"][0]["message"]["role"] == "assistant", r.stdout
        elif cmd.startswith(".venv/bin/python "):  # the chat script: a reply, then a streamed one
            assert r.returncode == 0 and r.stdout.strip(), (cmd, r.stdout[-2000:], r.stderr[-2000:])
        elif " config check " in cmd:  # the fresh template: every CHANGEME named, nothing passes
            assert r.returncode != 0 and "CHANGEME" in r.stderr and "Traceback" not in r.stderr, r.stderr
            continue
        assert r.returncode == 0, (cmd, here, r.stdout[-2000:], r.stderr[-2000:])
    assert len(results) >= 6, results
