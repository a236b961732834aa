"""Every route of vLLM's own API server, asked with and without the API key (run by
tests/node/test_api_guard.py in the runtime line's Python, with dspark's API guard on PYTHONPATH).

    PYTHONPATH=GUARD_DIR python tests/harness/api_guard_probe.py FLAGS_JSON KEY [ORIGIN]

builds the app the way `vllm serve` does (its argument parser and build_app, no engine: a route
that needs one answers 500 or 400 once past the middleware), then sends each route's methods
without a key and with `Authorization: Bearer KEY`, and a CORS preflight from ORIGIN (default
http://evil.example). Prints ``@@`` and JSON: [method, path, status without, status with] per
route, and the preflight's access-control-allow-origin."""
import json
import os
import sys
import warnings

warnings.simplefilter("ignore")
argv_json, key = sys.argv[1], sys.argv[2]
origin = sys.argv[3] if len(sys.argv) > 3 else "http://evil.example"
if key:  # vLLM reads it when the app is built, as dspark's supervisor sets it
    os.environ["VLLM_API_KEY"] = key
from starlette.testclient import TestClient  # noqa: E402
from vllm.entrypoints.openai.api_server import build_app  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402

try:
    from vllm.entrypoints.openai.cli_args import make_arg_parser
except ImportError:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
parser = make_arg_parser(FlexibleArgumentParser())
args = parser.parse_args(json.loads(argv_json))
app = build_app(args, supported_tasks=("generate",))
client = TestClient(app, raise_server_exceptions=False)
out = []
for r in app.routes:
    methods = sorted(getattr(r, "methods", None) or ["GET"])
    path = getattr(r, "path", None)
    if not path:
        continue
    path = path.replace("{", "").replace("}", "")  # a path parameter: its own name as the value
    for m in methods:
        if m in ("HEAD", "OPTIONS"):
            continue
        res = {}
        for who, hdrs in (("none", {}), ("key", {"Authorization": f"Bearer {key}"})):
            try:
                resp = client.request(m, path, headers=hdrs, json={} if m == "POST" else None, timeout=5)
                res[who] = resp.status_code
            except Exception as e:  # noqa: BLE001 - reported as the route's answer
                res[who] = f"{type(e).__name__}"
        out.append([m, path, res["none"], res["key"]])
pre = client.options("/v1/chat/completions", headers={"Origin": origin, "Access-Control-Request-Method": "POST"})
print("@@" + json.dumps({"routes": out, "cors": pre.headers.get("access-control-allow-origin"),
                         "cors_status": pre.status_code}))
