"""Figures and claims in README.md that the code decides: the restart backoff
is the supervisor's, and `dspark render` never reads the API key (the README said it printed
it as <redacted>)."""

import re

from dspark.node.policy import BACKOFF_MAX_S, backoff_delay
from tests.harness.docs_text import docs_text
from tests.harness.dspark_cli import invoke_dspark

README = docs_text()  # README.md and docs/


def test_readme_backoff_is_the_supervisors():
    m = re.search(r"the first restart at once, then ([\d, ]+) … (\d+) s", README)
    assert m, "README.md: the backoff sequence is not stated"
    stated = [0.0] + [float(x) for x in m.group(1).split(",") if x.strip()]
    assert stated == [backoff_delay(n) for n in range(1, len(stated) + 1)]
    assert float(m.group(2)) == BACKOFF_MAX_S


def test_render_never_reads_the_api_key(tmp_path):
    cluster = tmp_path / "c.toml"
    cluster.write_text(f'[model]\npath = "{tmp_path}"\n[[nodes]]\nname = "a"\nrank = 0\naddress = "10.0.0.1"\n'
                       '[[nodes]]\nname = "b"\nrank = 1\naddress = "10.0.0.2"\n')
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "api-key").write_text("key-from-credential")
    env = {"DSPARK_API_KEY": "key-from-dspark-env", "VLLM_API_KEY": "key-from-vllm-env",
           "CREDENTIALS_DIRECTORY": str(creds)}
    for fmt in ([], ["--json"]):
        r = invoke_dspark("render", "--config", str(cluster), "--node", "a", *fmt, env=env)
        assert r.returncode == 0, r.stderr
        assert "key-from" not in r.stdout and "<redacted>" not in r.stdout, r.stdout
    assert "prints it as `<redacted>`" not in README


def test_the_setup_options_the_documents_give_are_setups():
    """Every `.ci/setup --OPTION` the documents give is one .ci/setup takes (its usage line, printed
    for an unknown option before anything is installed)."""
    import re
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([str(root / ".ci" / "setup"), "--no-such-option"], capture_output=True, text=True,
                       timeout=60, cwd=root)
    assert r.returncode == 2 and r.stderr.startswith("usage: .ci/setup "), r.stderr
    taken = set(re.findall(r"\[(--[\w-]+)\]", r.stderr))
    given = set(re.findall(r"\.ci/setup((?: --[\w-]+)+)", README))
    options = {o for g in given for o in g.split()}
    assert {"--default-line-only", "--no-clients"} <= options <= taken, (options, taken)
