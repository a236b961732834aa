"""A stand-in for `vllm serve` in supervisor tests: same CLI shape, log lines and HTTP API.

Behaviour is chosen with STANDIN_* environment variables:
  STANDIN_ENV_FILE     write this process's environment there (JSON)
  STANDIN_T0_FILE      write the monotonic moment the *_AFTER times count from there
  STANDIN_IGNORE_TERM  ignore SIGTERM (the supervisor must escalate to SIGKILL)
  STANDIN_EXIT_AFTER   exit with code 1 after this many seconds
  STANDIN_FAIL_AFTER   answer completions with HTTP 500 after this many seconds
  STANDIN_CHILD_FILE   start a grandchild in the same process group and write its PID there
  STANDIN_READY_DELAY  seconds of "loading" before the API answers
  STANDIN_SLOTS        requests the "engine" runs at once (others wait), like max_num_seqs
  STANDIN_TOKEN_S      seconds per generated token of each running request
  STANDIN_STALL_AFTER  after this many seconds the engine stops making progress (a wedged
                       collective): running requests never finish, queued ones never start,
                       /health still answers and /metrics keeps showing the values of that moment
  STANDIN_LAUNCH_DELAY seconds before the first log line (vLLM's imports): a headless rank enters
                       the rendezvous that much later
  STANDIN_COLLECTIVE_S (with --nnodes) the ranks share a collective, as vLLM's do: each headless
                       rank stays connected to the head's rendezvous port and sends a beat every
                       0.1 s; the head's engine stalls (as with STANDIN_STALL_AFTER) once a connected
                       rank has been silent this many seconds (its vLLM SIGSTOPped: a wedged worker).
                       A rank whose connection closes just leaves it (its death is the supervisors'
                       to find). Meant for the cluster file's serving.env, which every rank gets.
The API serves /metrics with vLLM's own metric names for the requests it ran, /v1/models, and
completions plain or streamed (one chunk per token, then the usage chunk: what dspark bench reads).
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

argv = sys.argv[1:]
env = os.environ
t0 = time.monotonic()
if env.get("STANDIN_T0_FILE"):  # the moment the stand-in's clocks (STANDIN_*_AFTER) start from
    with open(env["STANDIN_T0_FILE"], "w") as f:
        f.write(repr(t0))

if env.get("STANDIN_ENV_FILE"):
    with open(env["STANDIN_ENV_FILE"], "w") as f:
        json.dump(dict(env), f)
if env.get("STANDIN_IGNORE_TERM"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if env.get("STANDIN_CHILD_FILE"):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    with open(env["STANDIN_CHILD_FILE"], "w") as f:
        f.write(str(child.pid))


def log(line):
    print(f"INFO standin {line}", flush=True)


def arg(flag, default=None):
    return argv[argv.index(flag) + 1] if flag in argv else default


# STANDIN_COLLECTIVE_S: when each connected rank was last heard (by connection), on the head.
peers_heard: dict = {}
peers_lock = threading.Lock()


def beat(conn) -> None:
    """A headless rank's part of the collective: a beat every 0.1 s while the head listens."""
    try:
        while True:
            conn.sendall(b".")
            time.sleep(0.1)
    except OSError:
        return


def collective_listen(conn) -> None:
    key = id(conn)
    with peers_lock:
        peers_heard[key] = time.monotonic()
    try:
        while conn.recv(4096):
            with peers_lock:
                peers_heard[key] = time.monotonic()
    except OSError:
        pass
    with peers_lock:  # closed: the rank left the collective
        peers_heard.pop(key, None)


def collective_accept(store) -> None:
    while True:
        try:
            conn, _ = store.accept()
        except OSError:
            return
        threading.Thread(target=collective_listen, args=(conn,), daemon=True).start()


def collective_silent() -> bool:
    """A connected rank silent for STANDIN_COLLECTIVE_S (never without that variable)."""
    limit = float(env.get("STANDIN_COLLECTIVE_S") or "inf")
    now = time.monotonic()
    with peers_lock:
        return any(now - heard > limit for heard in peers_heard.values())


time.sleep(float(env.get("STANDIN_LAUNCH_DELAY", "0")))
log("Launching vLLM (v0.28.0-standin) " + ("headless multiproc executor" if "--headless" in argv else "API server"))
master = (arg("--master-addr"), int(arg("--master-port", "0")))
log(f"world_size=2 rank=0 distributed_init_method=tcp://{master[0]}:{master[1]} backend=gloo")
if "--nnodes" in argv:
    # Like torch.distributed's TCPStore: the head listens on the master port, the others
    # wait in the rendezvous until they can reach it.
    import socket

    if "--headless" in argv:
        while True:
            try:
                conn = socket.create_connection(master, timeout=0.5)
                break
            except OSError:
                time.sleep(0.1)
        if env.get("STANDIN_COLLECTIVE_S"):
            threading.Thread(target=beat, args=(conn,), daemon=True).start()
        else:
            conn.close()
    else:
        store = socket.create_server(master)
        if env.get("STANDIN_COLLECTIVE_S"):
            threading.Thread(target=collective_accept, args=(store,), daemon=True).start()
log("Starting to load model")
time.sleep(float(env.get("STANDIN_READY_DELAY", "0.3")))
log("Warming up model for the compilation...")

class Engine:
    """Requests in `slots`, tokens at `token_s` each, counters as vLLM reports them."""

    def __init__(self):
        self.slots = threading.Semaphore(int(env.get("STANDIN_SLOTS", "64")))
        self.token_s = float(env.get("STANDIN_TOKEN_S", "0"))
        self.stall_at = t0 + float(env.get("STANDIN_STALL_AFTER", "1e9"))
        self.lock = threading.Lock()
        self.c = {"running": 0, "waiting": 0, "prompt": 0, "gen": 0, "success": 0}
        self.frozen = None

    def stalled(self) -> bool:
        if time.monotonic() < self.stall_at and not collective_silent():
            return False
        self.stall_at = min(self.stall_at, time.monotonic())  # a wedge, once seen, stays
        with self.lock:
            if self.frozen is None:
                self.frozen = dict(self.c)
        return True

    def hang(self):
        while time.monotonic() - t0 < 600:  # until the supervisor stops this process
            time.sleep(0.1)
        os._exit(1)

    def add(self, **d):
        with self.lock:
            for k, v in d.items():
                self.c[k] += v

    def run(self, prompt_len: int, max_tokens: int) -> None:
        if self.stalled():
            self.hang()
        self.add(waiting=1)
        while not self.slots.acquire(timeout=0.1):
            if self.stalled():
                self.hang()
        if self.stalled():
            self.hang()
        self.add(waiting=-1, running=1, prompt=prompt_len)
        for _ in range(max_tokens):
            if self.token_s:
                time.sleep(self.token_s)
            if self.stalled():
                self.hang()
            self.add(gen=1)
        self.add(running=-1, success=1)
        self.slots.release()

    def metrics(self) -> str:
        self.stalled()
        with self.lock:
            c = self.frozen or self.c
            lab = '{engine="0",model_name="m"}'
            return "".join([
                "# TYPE process_start_time_seconds gauge\n",
                f"process_start_time_seconds {START}\n",
                "# TYPE vllm:num_requests_running gauge\n", f"vllm:num_requests_running{lab} {c['running']}\n",
                "# TYPE vllm:num_requests_waiting gauge\n", f"vllm:num_requests_waiting{lab} {c['waiting']}\n",
                "# TYPE vllm:prompt_tokens_total counter\n", f"vllm:prompt_tokens_total{lab} {c['prompt']}\n",
                "# TYPE vllm:generation_tokens_total counter\n", f"vllm:generation_tokens_total{lab} {c['gen']}\n",
                "# TYPE vllm:request_success_total counter\n", f"vllm:request_success_total{lab} {c['success']}\n",
            ])


START = time.time()

if "--headless" not in argv:
    fail_after = float(env.get("STANDIN_FAIL_AFTER", "1e9"))
    engine = Engine()

    class H(BaseHTTPRequestHandler):
        def _send(self, code, obj):
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                self._send(200, {})
            elif self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": arg("--served-model-name", "m"),
                                                             "max_model_len": int(arg("--max-model-len", "4096"))}]})
            elif self.path == "/version":
                self._send(200, {"version": "0.28.0-standin"})
            elif self.path == "/metrics":
                data = engine.metrics().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            else:
                self._send(404, {})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if time.monotonic() - t0 > fail_after:
                self._send(500, {"error": "engine dead"})
                return
            prompt = body.get("prompt", [0])
            n_prompt, n_out = len(prompt) if isinstance(prompt, list) else 1, int(body.get("max_tokens", 1))
            engine.run(n_prompt, n_out)
            if not body.get("stream"):
                self._send(200, {"choices": [{"text": "x", "finish_reason": "length"}]})
                return
            # Streamed as vLLM streams (one chunk per token, then usage, then [DONE]), after the
            # engine ran it; the connection's close ends the body (HTTP/1.0).
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            chunks = [{"choices": [{"index": 0, "text": "x", "finish_reason": None if i < n_out - 1 else "length"}]}
                      for i in range(n_out)]
            chunks.append({"choices": [], "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out}})
            self.wfile.write(b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
                             + b"data: [DONE]\n\n")

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer((arg("--host", "127.0.0.1"), int(arg("--port", "8000"))), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    log("Starting vLLM server on http://...")

deadline = float(env.get("STANDIN_EXIT_AFTER", "1e9"))
while time.monotonic() - t0 < min(deadline, 600):
    time.sleep(0.05)
sys.exit(1)
