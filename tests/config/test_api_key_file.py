"""The head's API key file (the NixOS module's apiKeyFile, DSPARK_API_KEY_FILE): missing or empty,
`dspark serve` on the head refuses in one line that names the file and what to do (exit 2, which
the units never restart), instead of systemd's bare 243/CREDENTIALS; a worker never reads it.
Run through the real CLI, as the units run it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dspark.config import credentials
from tests.harness.pair import run_dspark

FIXTURE = Path(__file__).parents[1] / "fixtures" / "cluster-two-node.toml"
# What the module passes: the credential (from the file, or the fallback where it is missing)
# and the file's name.
KEY_ENV = ("CREDENTIALS_DIRECTORY", "DSPARK_API_KEY_FILE", "DSPARK_API_KEY", "VLLM_API_KEY")


def serve(node: str, **env: str):
    clean = {k: v for k, v in os.environ.items() if k not in KEY_ENV}
    # No --skip-plan: past the key check, the fixture's model directory (absent here) is the next
    # refusal, which shows how far serve got without starting anything.
    return run_dspark("serve", "--config", str(FIXTURE), "--node", node, timeout=60, env={**clean, **env})


def credential_dir(tmp_path: Path, text: str) -> str:
    d = tmp_path / "credentials"
    d.mkdir()
    (d / credentials.API_KEY_CREDENTIAL).write_text(text)
    return str(d)


def one_line_refusal(r) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_under_systemd_a_missing_key_file_is_refused_by_name(tmp_path):
    """systemd found no file: the module's SetCredential= fallback stands in for it."""
    key_file = tmp_path / "secrets" / "dspark-api-key"
    line = one_line_refusal(serve("spark-a", CREDENTIALS_DIRECTORY=credential_dir(tmp_path, credentials.NO_KEY_FILE),
                                  DSPARK_API_KEY_FILE=str(key_file)))
    assert line.startswith(f"refusing to start: the API key file {key_file} (DSPARK_API_KEY_FILE; "
                           "services.dspark.apiKeyFile on NixOS) does not exist"), line
    assert "write the key into it" in line and "remove apiKeyFile" in line


def test_under_systemd_an_empty_key_file_is_refused(tmp_path):
    line = one_line_refusal(serve("spark-a", CREDENTIALS_DIRECTORY=credential_dir(tmp_path, "\n"),
                                  DSPARK_API_KEY_FILE="/run/secrets/dspark-api-key"))
    assert "/run/secrets/dspark-api-key" in line and " is empty;" in line


@pytest.mark.parametrize("content, why", [(None, "does not exist"), ("", "is empty")])
def test_outside_systemd_the_file_itself_is_read(tmp_path, content, why):
    key_file = tmp_path / "key"
    if content is not None:
        key_file.write_text(content)
    line = one_line_refusal(serve("spark-a", DSPARK_API_KEY_FILE=str(key_file)))
    assert f"the API key file {key_file} " in line and why in line


def test_a_key_lets_the_head_past_the_check(tmp_path):
    r = serve("spark-a", CREDENTIALS_DIRECTORY=credential_dir(tmp_path, "sk-local-test\n"),
              DSPARK_API_KEY_FILE="/run/secrets/dspark-api-key")
    line = one_line_refusal(r)  # the next refusal: the model directory
    assert line.startswith("refusing to start: plan:") and "API key" not in line


def test_a_worker_never_refuses_over_the_head_key(tmp_path):
    r = serve("spark-b", DSPARK_API_KEY_FILE=str(tmp_path / "missing"))
    line = one_line_refusal(r)
    assert line.startswith("refusing to start: plan:") and "API key" not in line


def test_the_fallback_marker_is_never_taken_for_a_key(tmp_path):
    env = {"CREDENTIALS_DIRECTORY": credential_dir(tmp_path, credentials.NO_KEY_FILE + "\n")}
    assert credentials.read_api_key(env) is None
    assert credentials.read_api_key({**env, "DSPARK_API_KEY": "sk-env"}) == "sk-env"
    # The module writes the same marker (modules/dspark.nix: SetCredential=api-key:<marker>).
    module = (Path(__file__).parents[2] / "modules" / "dspark.nix").read_text()
    assert f'SetCredential = "api-key:{credentials.NO_KEY_FILE}";' in module


def test_the_readme_quotes_the_refusal_as_serve_prints_it(tmp_path):
    from tests.harness.docs_text import docs_text

    readme = docs_text()
    line = one_line_refusal(serve("spark-a", CREDENTIALS_DIRECTORY=credential_dir(tmp_path, credentials.NO_KEY_FILE),
                                  DSPARK_API_KEY_FILE="/run/secrets/dspark-api-key"))
    assert f"```text\n{line}\n```" in readme


def test_the_units_dspark_renders_load_no_credential_for_a_worker():
    """`dspark systemd render/install` (hosts without the NixOS module): no unit file and no
    worker drop-in loads a credential (an operator who wants the key adds LoadCredential= to the
    head's unit alone)."""
    from dspark.units.dropins import NodeRole, node_dropins
    from dspark.units.render import render_units

    files = render_units("/opt/dspark/bin/dspark")
    for role in ([NodeRole("spark-b", False)], [NodeRole("w1", False), NodeRole("w2", False)]):
        files.update(node_dropins(role))
    assert [name for name, text in files.items() if "Credential" in text] == []
