"""Where secrets come from: the API key (bearer token) of the head's vLLM API.

Never from the cluster file, which is world-readable and may live in the Nix store: from
systemd's credentials directory (`LoadCredential=api-key:...`) or the environment."""

from __future__ import annotations

import os
from pathlib import Path

API_KEY_ENV = ("DSPARK_API_KEY", "VLLM_API_KEY")
API_KEY_CREDENTIAL = "api-key"  # systemd LoadCredential= name


def read_api_key(env: dict[str, str] | None = None) -> str | None:
    """The API key from systemd's credentials directory or the environment, or None."""
    env = os.environ if env is None else env
    cred_dir = env.get("CREDENTIALS_DIRECTORY")
    if cred_dir:
        path = Path(cred_dir) / API_KEY_CREDENTIAL
        if path.is_file():
            return path.read_text().strip() or None
    for key in API_KEY_ENV:
        if env.get(key):
            return env[key]
    return None
