"""Files of the model directory read with the cluster file's guards: a FIFO,
a link to /dev/zero, an oversized or too deeply nested config.json, and a safetensors shard
that is a FIFO or a device. `dspark plan` and `dspark check` end quickly with one clear line
(plan: exit 2, as for a missing config.json; check: a failed check, exit 1), never a hang,
a traceback or a process that grows without end.

Each command runs with a 2 GiB address-space limit, so that the unfixed reader of
/dev/zero fails with MemoryError instead of filling this shared machine's memory."""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import pytest

from tests.harness.pair import run_dspark
from tests.harness.plan_fixtures import write_tiny_llama
from tests.preflight.test_check_peer import cluster, free_port

LIMIT_S = 60  # a plan or check of a tiny model takes a second or two; a hang runs into this


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


def make_config(model: Path, kind: str) -> str:
    """Turn model/config.json into `kind`; the words the one-line error must hold."""
    cfg = model / "config.json"
    cfg.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(cfg)
        return "not a regular file (a FIFO)"
    if kind == "dev-zero":
        cfg.symlink_to("/dev/zero")
        return "not a regular file (a device)"
    if kind == "oversized":
        cfg.write_text(json.dumps({"num_hidden_layers": 2, "pad": "x" * (5 << 20)}))
        return "larger than 4 MiB"
    if kind == "deep":
        cfg.write_text("[" * 200_000)
        return "nested more than 64 levels"
    raise ValueError(kind)


def run_bounded(*args: str):
    t0 = time.monotonic()
    r = run_dspark(*args, timeout=LIMIT_S, preexec_fn=_limit_memory)
    return r, time.monotonic() - t0


def one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, text[-3000:]
    return lines[0]


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "oversized", "deep"])
def test_plan_refuses_a_hostile_config_json_at_once(tmp_path, kind):
    c = cluster(tmp_path, free_port(), free_port("127.0.0.2"))
    model = write_tiny_llama(tmp_path / "model")
    words = make_config(model, kind)
    r, took = run_bounded("plan", "--config", c.source, "--model-dir", str(model))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    line = one_line(r.stderr)
    assert "config.json" in line and words in line, line
    assert took < LIMIT_S / 2, took


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "oversized", "deep"])
def test_check_refuses_a_hostile_config_json_at_once(tmp_path, kind):
    c = cluster(tmp_path, free_port(), free_port("127.0.0.2"))
    words = make_config(tmp_path / "model", kind)
    r, took = run_bounded("check", "--config", c.source, "--node", "w", "--no-peers")
    assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr, (r.stdout + r.stderr)[-3000:]
    fails = [line for line in r.stdout.splitlines() if line.startswith("fail  model.dir")]
    assert len(fails) == 1 and "config.json" in fails[0] and words in fails[0], r.stdout[-3000:]
    assert took < LIMIT_S / 2, took


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_plan_refuses_a_shard_that_is_not_a_regular_file(tmp_path, kind):
    c = cluster(tmp_path, free_port(), free_port("127.0.0.2"))
    model = write_tiny_llama(tmp_path / "model")
    shard = model / "model.safetensors"
    shard.unlink()
    if kind == "fifo":
        os.mkfifo(shard)
    else:
        shard.symlink_to("/dev/zero")
    r, took = run_bounded("plan", "--config", c.source, "--model-dir", str(model))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    line = one_line(r.stderr)
    assert "model.safetensors" in line and "not a regular file" in line, line
    assert took < LIMIT_S / 2, took
