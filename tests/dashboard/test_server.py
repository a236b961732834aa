"""The dashboard's HTTP server: read-only, loopback by default, the access token, the schema
of the JSON endpoint, and the CLI's refusals."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from dspark.dashboard import collector as C
from dspark.dashboard import server as S
from tests.harness.dashboard import scrape_text, snapshot_schema, validate_snapshot

TOKEN = "s3cret-token-for-tests"


def get(url: str, headers: dict | None = None, method: str = "GET") -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


@pytest.fixture
def dashboard(metrics_stand_in, agents, request):
    states, running = agents
    metrics_stand_in.text = scrape_text("b")
    nodes = tuple(C.NodeTarget(name, i, "head" if i == 0 else "worker", f"http://127.0.0.1:{a.port}")
                  for i, (name, a) in enumerate(sorted(running.items())))
    col = C.Collector(C.Targets(metrics_stand_in.url, nodes))
    col.tick()
    token = getattr(request, "param", None)
    srv = S.DashboardServer("127.0.0.1", 0, col, token=token).start()
    yield srv
    srv.stop()


def test_page_assets_and_snapshot(dashboard):
    code, headers, body = get(dashboard.url + "/")
    assert code == 200 and headers["Content-Type"].startswith("text/html")
    assert "script-src 'self'" in headers["Content-Security-Policy"]
    assert b'data-panel="nodes"' in body and b"/static/app.js" in body
    for asset in ("app.js", "style.css", "snapshot.schema.json"):
        assert get(dashboard.url + "/static/" + asset)[0] == 200
    code, headers, body = get(dashboard.url + S.SNAPSHOT_PATH)
    assert code == 200 and headers["Content-Type"] == "application/json"
    assert headers["Cache-Control"] == "no-store"
    validate_snapshot(json.loads(body))


def test_schema_served_is_the_documented_one(dashboard):
    assert json.loads(get(dashboard.url + "/static/snapshot.schema.json")[2]) == snapshot_schema()


def test_schema_rejects_what_it_should():
    import jsonschema

    snap = C.Collector(C.Targets("http://127.0.0.1:1", ()), timeout_s=0.5).tick()
    validate_snapshot(snap)
    for broken in ({**snap, "extra": 1}, {**snap, "vllm": {**snap["vllm"], "available": "no"}},
                   {k: v for k, v in snap.items() if k != "nodes"}):
        with pytest.raises(jsonschema.ValidationError):
            validate_snapshot(broken)


@pytest.mark.parametrize("path", ["/../../etc/passwd", "/static/../server.py", "/static/missing.js", "/v1/models",
                                  "/metrics"])
def test_only_known_paths(dashboard, path):
    assert get(dashboard.url + path)[0] == 404


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
def test_read_only(dashboard, method):
    code, headers, _ = get(dashboard.url + S.SNAPSHOT_PATH, method=method)
    assert code == 405 and headers["Allow"] == "GET, HEAD"


def test_foreign_host_header_refused_on_loopback(dashboard):
    assert get(dashboard.url + S.SNAPSHOT_PATH, {"Host": "attacker.example:8899"})[0] == 421
    assert get(dashboard.url + S.SNAPSHOT_PATH, {"Host": f"localhost:{dashboard.port}"})[0] == 200


@pytest.mark.parametrize("dashboard", [TOKEN], indirect=True)
def test_token_enforced(dashboard):
    url = dashboard.url + S.SNAPSHOT_PATH
    code, headers, body = get(url)
    assert code == 401 and "Bearer" in headers["WWW-Authenticate"] and b"snapshot" not in body
    assert get(url, {"Authorization": "Bearer wrong"})[0] == 401
    assert get(url, {"Authorization": TOKEN})[0] == 401  # not a Bearer header
    assert get(url, {"Authorization": "Bearer " + TOKEN[:-1]})[0] == 401
    code, _, body = get(url, {"Authorization": "Bearer " + TOKEN})
    assert code == 200 and json.loads(body)["schema_version"] == 1
    assert get(dashboard.url + "/")[0] == 200  # the page itself holds no data


def test_token_file_rules(tmp_path):
    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")
    f.chmod(0o644)
    with pytest.raises(S.DashboardError, match="chmod 600"):
        S.load_token(f)
    f.chmod(0o600)
    assert S.load_token(f) == TOKEN
    f.write_text("\n")
    with pytest.raises(S.DashboardError, match="empty"):
        S.load_token(f)
    with pytest.raises(S.DashboardError, match="cannot read"):
        S.load_token(tmp_path / "absent")
    cred = tmp_path / "creds"
    cred.mkdir()
    (cred / S.TOKEN_CREDENTIAL).write_text(TOKEN)
    assert S.default_token_file({"CREDENTIALS_DIRECTORY": str(cred)}) == cred / S.TOKEN_CREDENTIAL
    assert S.default_token_file({}) is None


def test_non_loopback_needs_a_token():
    col = C.Collector(C.Targets("http://127.0.0.1:1", ()))
    for host in ("0.0.0.0", "192.168.100.10", "::", "spark-a"):
        with pytest.raises(S.DashboardError, match="needs an access token"):
            S.DashboardServer(host, 0, col)
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert S.is_loopback(host)


def _cli(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dspark", "dashboard", *args], capture_output=True, text=True,
                          timeout=60, env=env)


@pytest.fixture
def cluster_file(tmp_path):
    from dspark.local.cluster import LocalPorts, prepare

    return prepare(tmp_path / "local", LocalPorts(api=1, master=2, agent=3))


def test_cli_refuses_public_bind_without_token(cluster_file):
    r = _cli("--config", str(cluster_file), "--host", "0.0.0.0", "--port", "0")
    assert r.returncode != 0 and "needs an access token" in r.stderr and "Traceback" not in r.stderr


def test_cli_refuses_readable_token_file(cluster_file, tmp_path):
    f = tmp_path / "tok"
    f.write_text(TOKEN)
    f.chmod(0o644)
    r = _cli("--config", str(cluster_file), "--host", "0.0.0.0", "--port", "0", "--token-file", str(f))
    assert r.returncode != 0 and "chmod 600" in r.stderr and TOKEN not in r.stderr + r.stdout


def test_cli_has_no_token_option():
    r = _cli("--help")
    assert r.returncode == 0 and "--token-file" in r.stdout and "--token " not in r.stdout


def test_cli_serves_and_stops_on_sigterm(cluster_file, tmp_path):
    import signal
    import time

    from tests.harness.dashboard import free_port

    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "dspark", "dashboard", "--config", str(cluster_file),
                          "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                code, _, body = get(f"http://127.0.0.1:{port}{S.SNAPSHOT_PATH}")
                snap = json.loads(body)
                if snap["round"] >= 1:
                    break
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.3)
        validate_snapshot(snap)
        assert snap["vllm"]["available"] is False  # nothing serves on the file's ports
        assert [n["state"] for n in snap["nodes"]] == ["unreachable", "unreachable"]
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=15) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)
