"""docs/clients.md, run as written against the shared local pair: the OpenAI SDK, litellm,
GuideLLM 0.8, llama-benchy and `vllm bench serve`, one short run each. Every `sh` command of the
page runs, with the pair's address, its model directory and a free port for the book's server in
place of the defaults; every `python` block is the script a command runs. The clients come from
.ci/setup (.venv/clients); without them the clients' tests skip, saying so."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.harness.pair import ROOT

pytestmark = pytest.mark.pair

PAGE = ROOT / "docs" / "clients.md"
CLIENTS = ROOT / ".venv" / "clients" / "bin"


def page_commands() -> list[str]:
    out = []
    for block in re.findall(r"```sh\n(.*?)```", PAGE.read_text(), re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line:
                out.append(line)
    return out


def page_scripts() -> dict[str, str]:
    text = PAGE.read_text()
    named = dict(re.findall(r"save it\s+as `([\w.-]+\.py)`:\n\n```python\n(.*?)```", text, re.S))
    assert len(named) == text.count("```python\n"), "a clients.md python block not named a file to save"
    return named


def command_for(word: str) -> str:
    """The page's one command that runs `word` (a client, or a saved script)."""
    found = [c for c in page_commands() if word in shlex.split(c)]
    assert len(found) == 1, (word, found)
    return found[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Here:
    """The page's commands as they run against this pair, in a directory of the test's own."""

    def __init__(self, pair, workdir: Path):
        self.pair, self.workdir = pair, workdir
        self.book_port = free_port()

    def as_here(self, cmd: str) -> str:
        cmd = cmd.replace("http://127.0.0.1:8000", self.pair.api_url)
        cmd = cmd.replace("http://127.0.0.1:8001", f"http://127.0.0.1:{self.book_port}")
        cmd = cmd.replace("-m http.server 8001", f"-m http.server {self.book_port}")
        cmd = cmd.replace(".dspark/local/model", str(self.pair.workdir / "model"))
        cmd = cmd.replace("--directory docs", f"--directory {ROOT / 'docs'}")
        cmd = re.sub(r"(?<![\w/])\.venv/", f"{ROOT}/.venv/", cmd)
        for name, code in page_scripts().items():
            (self.workdir / name).write_text(code.replace("http://127.0.0.1:8000", self.pair.api_url))
        return cmd

    def run(self, cmd: str, timeout: float = 150) -> subprocess.CompletedProcess:
        t0 = time.monotonic()
        r = subprocess.run(self.as_here(cmd), shell=True, cwd=self.workdir, capture_output=True, text=True,
                           timeout=timeout)
        print(f"{time.monotonic() - t0:6.1f} s  exit {r.returncode}  {cmd[:100]}")
        return r


@pytest.fixture
def here(local_pair, tmp_path):
    return Here(local_pair, tmp_path)


@pytest.fixture
def clients():
    if not (CLIENTS / "python").exists():
        pytest.skip(".venv/clients is not installed (.ci/setup installs it unless --no-clients)")


def test_every_command_of_the_page_is_run_here():
    """Each command of clients.md is one of those the tests below run, and each script is run by
    a command: a new client on the page cannot go untested unnoticed."""
    tested = {"sdk_env.py", "litellm_chat.py", "guidellm", "http.server", "llama-benchy", "vllm"}
    for cmd in page_commands():
        words = {Path(w).name for w in shlex.split(cmd)}
        assert words & tested, f"clients.md command no test here runs: {cmd}"
    assert set(page_scripts()) == {"sdk_env.py", "litellm_chat.py"}


def test_openai_sdk_from_the_environment(here):
    r = here.run(command_for("sdk_env.py"))
    assert r.returncode == 0, r.stderr[-3000:]
    n = int(re.search(r"^(\d+) tokens$", r.stdout, re.M).group(1))
    assert 0 < n <= 16, r.stdout


def test_litellm_hosted_vllm_offline(here, clients):
    cmd = command_for("litellm_chat.py")
    assert cmd.startswith("LITELLM_LOCAL_MODEL_COST_MAP=True ")
    r = here.run(cmd)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    n = int(re.fullmatch(r"(\d+) tokens", lines[1]).group(1))
    assert 0 < n <= 16 and lines[2].strip(), r.stdout  # a reply, its usage, then the streamed one


def test_guidellm_08_run(here, clients):
    r = here.run(command_for(".venv/clients/bin/guidellm"))
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    report = json.loads((here.workdir / "guidellm.json").read_text())
    (bench,) = report["benchmarks"]
    assert bench["metrics"]["request_totals"] == {"successful": 8, "errored": 0, "incomplete": 0, "total": 8}
    assert "Benchmarking complete" in r.stdout + r.stderr


def test_llama_benchy_with_a_local_book(here, clients):
    book = next(c for c in page_commands() if "http.server" in c)
    assert book.endswith(" &")
    server = subprocess.Popen(shlex.split(here.as_here(book[:-1])), cwd=here.workdir,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):  # up to 10 s for the book's server to listen
            try:
                socket.create_connection(("127.0.0.1", here.book_port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        # Its corpus cache (~/.cache/llama-benchy, by the URL's hash) is the test's own.
        env = {**os.environ, "HOME": str(here.workdir)}
        cmd = here.as_here(command_for(".venv/clients/bin/llama-benchy"))
        r = subprocess.run(cmd, shell=True, cwd=here.workdir, capture_output=True, text=True, timeout=150, env=env)
    finally:
        server.terminate()
        server.wait(timeout=10)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert "Downloading book from http://127.0.0.1:" in r.stdout and "Skipping coherence test" in r.stdout
    result = json.loads((here.workdir / "llama-benchy.json").read_text())
    (bench,) = result["benchmarks"]  # one run: --pp 128 --tg 32, at concurrency 1
    assert (bench["prompt_size"], bench["response_size"], bench["concurrency"]) == (128, 32, 1), result
    assert bench["pp_throughput"]["mean"] > 0 and bench["tg_throughput"]["mean"] > 0, result
    assert result["model"] == "dspark-local", result


def test_vllm_bench_serve(here):
    r = here.run(command_for(".venv/bin/vllm"), timeout=240)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    result = json.loads((here.workdir / "vllm-bench.json").read_text())
    assert result["completed"] == 8 and result["failed"] == 0 and result["total_output_tokens"] > 0, result
    assert result["total_input_tokens"] == 8 * 64, result
