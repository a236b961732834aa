"""The bench against the real local pair (tiny model, max_model_len 4096): small lengths,
short outputs. The supervisor's liveness probe (a 1-token completion every 5 s) is real
traffic too: where a check needs a quiet window it retries a bounded number of times."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.parse

import pytest

from dspark.bench import decode, prefill, prompts
from dspark.bench.client import Target, completion_body, scrape, stream_completion
from dspark.bench.report import Report
from dspark.engine import facts as F
from dspark.engine.metrics import busy, window
from dspark.net import http
from tests.harness.pair import run_dspark

pytestmark = pytest.mark.pair
MODEL = "dspark-local"


class CuttableProxy:
    """A TCP forwarder in front of the real server; `cut()` makes the server unreachable
    at once (listener closed, open connections reset), as a dead head would."""

    def __init__(self, upstream_url: str):
        u = urllib.parse.urlsplit(upstream_url)
        self.upstream = (u.hostname, u.port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.upstream, timeout=30)
            with self.lock:
                self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src, dst):
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            src.close()  # each socket is the source of exactly one pump

    def cut(self):
        self.listener.close()
        with self.lock:
            for s in self.conns:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                    s.close()
                except OSError:
                    pass


def test_exact_prompt_lengths_reach_the_server(local_pair):
    target = Target(local_pair.api_url, MODEL)
    for n in (64, 200, 511):
        p = prompts.make(101, "exact-length", n)
        for attempt in range(5):  # a liveness probe in the window moves the counter too
            before = scrape(target, MODEL)
            res = stream_completion(target, MODEL, p.token_ids, 1)
            w = window(before, scrape(target, MODEL))
            if w.requests_finished == 1 and not w.busy_before:
                break
            p = prompts.make(101, "exact-length", n, f"retry{attempt}")
        assert w.requests_finished == 1, "no quiet window in 5 attempts"
        assert w.prompt_tokens == n and res.prompt_tokens == n and res.completion_tokens == 1


def test_prefill_reports_reproduce_and_compare(local_pair, tmp_path):
    # Without their per-run cache salt, so the second run meets the first one's cached blocks.
    args = ["bench", "prefill", "--url", local_pair.api_url, "--lengths", "64,128,512", "--trials", "2",
            "--seed", "7", "-o", str(tmp_path), "--quiet", "--shared-prefix-cache"]
    a = run_dspark(*args, "--label", "a", timeout=180)
    assert a.returncode == 0, a.stderr
    assert a.stdout == ""  # --quiet
    b = run_dspark(*args, "--label", "b", timeout=180)
    assert b.returncode == 0, b.stderr
    ra, rb = Report.load(tmp_path / "prefill-a.json"), Report.load(tmp_path / "prefill-b.json")
    for suffix in (".md", ".png"):
        assert (tmp_path / f"prefill-a{suffix}").stat().st_size > 0

    # Fingerprints reproduce across runs, and are those of the prompts the plan defines.
    assert ra.planned_prompts == rb.planned_prompts and ra.prompt_set_sha256 == rb.prompt_set_sha256
    assert [t.prompt_sha256 for t in ra.trials] == [t.prompt_sha256 for t in rb.trials] == ra.planned_prompts
    spec = prefill.PrefillSpec(lengths=(64, 128, 512), trials=2, seed=7)
    assert ra.planned_prompts == [spec.prompt(*s).sha256 for s in spec.plan()]

    # Context and every trial are recorded.
    assert ra.complete and ra.error is None and ra.server["runtime_version"] == "0.28.0"
    assert ra.server["max_model_len"] == 4096 and ra.server["settings"]["cache_config"]["block_size"] == "128"
    assert [t.role for t in ra.trials].count("trial") == 6 and len(ra.trials) == 1 + 3 * 3
    for t in ra.trials:
        if t.server_requests == 1 and not t.overlap:
            assert t.server_prompt_tokens == t.length  # the server saw exactly the length sent
    assert all(s.server_valid_trials >= 1 for s in ra.summary)

    # The second run resent the same prompts: the 512-token ones (four 128-token blocks)
    # hit the prefix cache, and the report says so; in the first run nothing did.
    by_len = {s.length: s for s in rb.summary}
    assert by_len[512].prefix_cache_hit_trials == 2 and by_len[512].server_prefill_tok_s is None
    assert all(s.prefix_cache_hit_trials == 0 for s in ra.summary)
    assert "hit the prefix cache" in (tmp_path / "prefill-b.md").read_text()

    # compare: a table of the two real reports (64 and 128 fit in one block: no hits).
    c = run_dspark("bench", "compare", str(tmp_path / "prefill-a.json"), str(tmp_path / "prefill-b.json"))
    assert c.returncode == 0, c.stderr
    rows = [r for r in c.stdout.splitlines() if r.startswith("| 64 ") or r.startswith("| 128 ")]
    cells = [[c.strip() for c in r.split("|")[1:-1]] for r in rows]  # length, figure, a, b, gain, noise, verdict
    assert len(rows) == 6 and all(c[4].endswith("%") for c in cells), rows
    assert all(c[6] in ("within noise", "better", "worse", "noise unknown") for c in cells), rows
    assert "**b hit the prefix cache** at 512" in c.stdout

    # ... and it refuses a report of other prompts.
    d = run_dspark("bench", "prefill", "--url", local_pair.api_url, "--lengths", "64,128", "--trials", "2",
                   "--seed", "8", "-o", str(tmp_path), "--label", "other", "--quiet", timeout=180)
    assert d.returncode == 0, d.stderr
    c = run_dspark("bench", "compare", str(tmp_path / "prefill-a.json"), str(tmp_path / "prefill-other.json"))
    assert c.returncode == 3 and "prompt fingerprints differ" in c.stderr and "Traceback" not in c.stderr


class HeldRequest:
    """A long streamed completion that stays in the server until `release()`: its thread reads
    the first chunk (the request is then running), holds the stream open, and closes it when
    released, which makes vLLM abort the request. Its length does not decide whether it is
    still running when the test looks (a short one can finish between two scrapes on a loaded
    host, and then overlaps nothing)."""

    def __init__(self, target: Target, prompt, max_tokens: int):
        self.started, self.released = threading.Event(), threading.Event()
        self.error: BaseException | None = None
        body = completion_body(MODEL, prompt.token_ids, max_tokens)
        self.thread = threading.Thread(target=self._hold, args=(target.endpoint(F.COMPLETIONS), body),
                                       daemon=True)
        self.thread.start()

    def _hold(self, url, body):
        try:
            with http.stream(url, data=body, timeout=120) as resp:
                assert resp.status == 200, resp.status
                lines = resp.lines()  # held: closing this generator would close the connection
                for line in lines:
                    if line.strip().startswith(b"data:"):
                        break
                self.started.set()
                self.released.wait(300)
        except BaseException as e:  # reported by release()
            self.error = e
            self.started.set()

    def release(self):
        self.released.set()
        self.thread.join(timeout=60)
        assert not self.thread.is_alive() and self.error is None, self.error


def wait_idle(target: Target, timeout_s: float = 120):
    """Until the server runs and queues nothing (the liveness probe's 1-token completions
    come and go)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not busy(scrape(target, MODEL)):
            return
        time.sleep(0.1)
    raise AssertionError(f"the server was still busy after {timeout_s} s")


def test_a_request_during_a_prefill_trial_is_an_overlap(local_pair):
    target = Target(local_pair.api_url, MODEL)
    held: list[HeldRequest] = []

    def meddle(role, length, index):
        while held:
            held.pop().release()
            wait_idle(target)
        if (role, length, index) == ("trial", 256, 0):
            h = HeldRequest(target, prompts.make(102, "meddler", 64), max_tokens=2048)
            held.append(h)
            assert h.started.wait(120) and h.error is None, h.error
            deadline = time.monotonic() + 60
            while not scrape(target, MODEL).gauge(F.RUNNING):
                assert time.monotonic() < deadline, "the held request never showed as running"
                time.sleep(0.05)

    spec = prefill.PrefillSpec(lengths=(128, 256), trials=2, seed=9)
    try:
        report = prefill.run(target, spec, before_request=meddle)
    finally:
        for h in held:
            h.release()
    hit = next(t for t in report.trials if (t.role, t.length, t.index) == ("trial", 256, 0))
    assert hit.overlap and hit.server_prefill_tok_s is None and not hit.server_valid
    assert any("running or waiting" in n for n in hit.notes)
    s256 = next(s for s in report.summary if s.length == 256)
    assert s256.overlapped_trials >= 1 and s256.server_valid_trials <= 1


def test_decode_sweep_on_the_pair(local_pair, tmp_path):
    r = run_dspark("bench", "decode", "--url", local_pair.api_url, "--concurrency", "1,3", "--output-len", "24",
                   "--input-len", "32", "--rounds", "1", "-o", str(tmp_path), timeout=180)
    assert r.returncode == 0, r.stderr
    assert "| 3 | 3 |" in r.stdout  # the Markdown summary on stdout
    rep = Report.load(tmp_path / "decode-run.json")
    assert rep.complete and [s.concurrency for s in rep.summary] == [1, 3]
    trials = [t for t in rep.trials if t.role == "trial"]
    assert len(trials) == 4
    assert all(t.output_tokens == 24 and t.prompt_tokens == 32 for t in trials)  # ignore_eos: exact
    # One chunk per token without speculation, unless vLLM merged a slow reader's chunks.
    assert all(1 <= len(t.itl_s) <= 23 for t in trials)
    for s in rep.summary:
        assert s.output_tokens == 24 * s.concurrency
        assert s.server_generation_tokens >= s.output_tokens  # liveness probes add a token now and then
        assert s.aggregate_tok_s == pytest.approx(s.output_tokens / s.duration_s)
        assert s.itl_s_p50 <= s.itl_s_p90 <= s.itl_s_p99
        assert s.spec_acceptance_rate is None and s.prefix_cache_hit_tokens == 0
    assert (tmp_path / "decode-run.png").stat().st_size > 0


def test_lengths_beyond_max_model_len_are_refused(local_pair, tmp_path):
    r = run_dspark("bench", "prefill", "--url", local_pair.api_url, "--lengths", "1K,4K,8K", "-o", str(tmp_path))
    assert r.returncode == 1
    assert "[4096, 8192]" in r.stderr and "max_model_len of 4096" in r.stderr and "Traceback" not in r.stderr
    r = run_dspark("bench", "decode", "--url", local_pair.api_url, "--input-len", "4000", "-o", str(tmp_path))
    assert r.returncode == 1 and "do not fit" in r.stderr


def test_server_lost_mid_run_keeps_measured_trials(local_pair, tmp_path):
    """The CLI against a server that goes away after a few trials: one clear line, exit 1,
    and the report (JSON, Markdown, plot) holds what was measured."""
    import subprocess

    from tests.harness.pair import dspark_cmd

    proxy = CuttableProxy(local_pair.api_url)
    proc = subprocess.Popen(dspark_cmd("bench", "prefill", "--url", proxy.url, "--lengths", "64,128,256,512",
                                       "--trials", "3", "--seed", "11", "-o", str(tmp_path), "--label", "cut"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    json_path = tmp_path / "prefill-cut.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if sum(t["role"] == "trial" for t in json.loads(json_path.read_text())["trials"]) >= 3:
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.01)
    proxy.cut()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    assert "Traceback" not in err
    assert "bench prefill stopped: server unreachable or failing" in err and "kept in" in err
    rep = Report.load(json_path)
    assert not rep.complete and "unreachable" in rep.error
    measured = [t for t in rep.trials if t.role == "trial"]
    assert 3 <= len(measured) < 12 and all(t.ttft_s > 0 for t in measured)
    assert rep.summary and (tmp_path / "prefill-cut.md").read_text().count("INCOMPLETE") == 1
    assert (tmp_path / "prefill-cut.png").exists()


def test_decode_stream_cut_mid_level_keeps_finished_levels(local_pair):
    proxy = CuttableProxy(local_pair.api_url)
    target = Target(proxy.url, MODEL, timeout_s=30)
    spec = decode.DecodeSpec(concurrency=(1, 2), output_len=200, input_len=16, seed=12, warmup=False)
    armed: list[threading.Timer] = []

    def on_update(rep):  # once level 1 is summarised, cut while level 2 streams
        if len(rep.summary) == 1 and not armed:
            armed.append(threading.Timer(1.0, proxy.cut))
            armed[0].start()

    report = decode.run(target, spec, on_update=on_update)
    assert not report.complete and report.error
    assert "unreachable" in report.error or "ended early" in report.error
    assert [s.concurrency for s in report.summary] == [1]
    assert report.trials and report.trials[0].output_tokens == 200


def test_config_names_the_server_and_its_settings(local_pair, tmp_path):
    r = run_dspark("bench", "prefill", "--config", str(local_pair.cluster_file), "--lengths", "64", "--trials", "1",
                   "--seed", "13", "-o", str(tmp_path), "--label", "cfg", "--quiet", timeout=120)
    assert r.returncode == 0, r.stderr
    rep = Report.load(tmp_path / "prefill-cfg.json")
    assert rep.server["url"] == local_pair.api_url and rep.server["model"] == MODEL
    serving = rep.server["settings"]["serving"]
    assert serving["max_model_len"] == 4096 and serving["tensor_parallel_size"] == 2
    assert "env" not in serving  # may hold secrets
    assert rep.server["settings"]["cluster_file"].endswith("cluster.toml")
