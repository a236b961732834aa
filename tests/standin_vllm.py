"""A stand-in for `vllm serve` in supervisor tests: same CLI shape, log lines and HTTP API.

Behaviour is chosen with STANDIN_* environment variables:
  STANDIN_ENV_FILE     write this process's environment there (JSON)
  STANDIN_IGNORE_TERM  ignore SIGTERM (the supervisor must escalate to SIGKILL)
  STANDIN_EXIT_AFTER   exit with code 1 after this many seconds
  STANDIN_FAIL_AFTER   answer completions with HTTP 500 after this many seconds
  STANDIN_CHILD_FILE   start a grandchild in the same process group and write its PID there
  STANDIN_READY_DELAY  seconds of "loading" before the API answers
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
                socket.create_connection(master, timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.1)
    else:
        store = socket.create_server(master)
log("Starting to load model")
time.sleep(float(env.get("STANDIN_READY_DELAY", "0.3")))
log("Warming up model for the compilation...")

if "--headless" not in argv:
    fail_after = float(env.get("STANDIN_FAIL_AFTER", "1e9"))

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
            elif self.path == "/version":
                self._send(200, {"version": "0.28.0-standin"})
            else:
                self._send(404, {})

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if time.monotonic() - t0 > fail_after:
                self._send(500, {"error": "engine dead"})
            else:
                self._send(200, {"choices": [{"text": "x"}]})

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer((arg("--host", "127.0.0.1"), int(arg("--port", "8000"))), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    log("Starting vLLM server on http://...")

deadline = float(env.get("STANDIN_EXIT_AFTER", "1e9"))
while time.monotonic() - t0 < min(deadline, 600):
    time.sleep(0.05)
sys.exit(1)
