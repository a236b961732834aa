"""`config check` on the fresh template: each node's hints suggest values of
its own (the second node: spark-b, .11, rank 1), never the first node's name and address, which
a user who follows them would then have twice."""

import re

from tests.harness.dspark_cli import invoke_dspark


def test_template_hints_differ_per_node(tmp_path):
    path = tmp_path / "cluster.toml"
    assert invoke_dspark("config", "init", str(path)).returncode == 0
    r = invoke_dspark("config", "check", "-c", str(path))
    assert r.returncode != 0
    hint = {}
    for m in re.finditer(r"nodes\[(\d)\]\.(\w+): .*Write e\.g\. \w+ = (.+)", r.stderr):
        hint[(int(m.group(1)), m.group(2))] = m.group(3).strip()
    for key in ("name", "address"):
        assert (0, key) in hint and (1, key) in hint, r.stderr
        assert hint[(0, key)] != hint[(1, key)], (key, hint)
    assert hint[(1, "name")] == '"spark-b"' and hint[(1, "address")] == '"192.168.100.11"'
    # following every hint gives a file that passes (apart from the model path, which must exist)
    text = path.read_text()
    for (i, key), value in hint.items():
        text = _set_nth(text, key, i, value)
    text = text.replace('"/var/lib/dspark/models/CHANGEME"', f'"{tmp_path}"')
    path.write_text(text)
    r = invoke_dspark("config", "check", "-c", str(path))
    assert r.returncode == 0, r.stderr


def _set_nth(text: str, key: str, n: int, value: str) -> str:
    """Replace the n-th [[nodes]] table's `key = ...` line."""
    parts = re.split(r"(?m)^\[\[nodes\]\]$", text)
    parts[n + 1] = re.sub(rf"(?m)^{key} = .*$", f"{key} = {value}", parts[n + 1], count=1)
    return "[[nodes]]".join(parts)
