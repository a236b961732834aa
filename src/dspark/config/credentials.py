"""Where secrets come from: the API key (bearer token) of the head's vLLM API.

Never from the cluster file, which is world-readable and may live in the Nix store: from
systemd's credentials directory (`LoadCredential=api-key:...`) or the environment.

A key file the head was configured with (the NixOS module's `apiKeyFile`) is named in
DSPARK_API_KEY_FILE beside the credential. Where that file is missing, systemd would fail the
unit before dspark runs (243/CREDENTIALS, no word of which file); the module therefore gives a
fallback (`SetCredential=api-key:` + NO_KEY_FILE), which makes a missing file non-fatal to
systemd, and `dspark serve` refuses to start with the file's name (`api_key_refusal`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from dspark.files.safe_read import MAX_SECRET_BYTES, read_text

API_KEY_ENV = ("DSPARK_API_KEY", "VLLM_API_KEY")
API_KEY_CREDENTIAL = "api-key"  # systemd LoadCredential= name
# The key file the head is configured with (set by the NixOS module with apiKeyFile).
API_KEY_FILE_ENV = "DSPARK_API_KEY_FILE"
# The credential's text when the key file was missing: the module's SetCredential= fallback
# (systemd 252 refuses an empty SetCredential= value, so the fallback has to say something).
NO_KEY_FILE = "dspark:no-key-file"


def _credential(env: Mapping[str, str]) -> str | None:
    """The text of $CREDENTIALS_DIRECTORY/api-key (stripped), or None where there is none."""
    cred_dir = env.get("CREDENTIALS_DIRECTORY")
    if not cred_dir:
        return None
    path = Path(cred_dir) / API_KEY_CREDENTIAL
    try:
        return read_text(path, MAX_SECRET_BYTES).strip() if path.is_file() else None
    except OSError:
        return None


def read_api_key(env: Mapping[str, str] | None = None) -> str | None:
    """The API key from systemd's credentials directory or the environment, or None."""
    env = os.environ if env is None else env
    key = _credential(env)
    if key and key != NO_KEY_FILE:
        return key
    for name in API_KEY_ENV:
        if env.get(name):
            return env[name]
    return None


def api_key_refusal(env: Mapping[str, str] | None = None) -> str | None:
    """Why the head must not start, in one line, when it was configured with a key file
    (DSPARK_API_KEY_FILE) that gave no key; None when there is none or it gave one. Serving
    the API without the key it was configured with would open it to anyone who reaches it."""
    env = os.environ if env is None else env
    path = env.get(API_KEY_FILE_ENV)
    if not path:
        return None
    if env.get("CREDENTIALS_DIRECTORY"):
        key = _credential(env)
        if key is None or key == NO_KEY_FILE:
            why = "does not exist (systemd found no file there to pass as the credential 'api-key')"
        elif not key:
            why = "is empty"
        else:
            return None
    else:  # started outside systemd: read the file itself
        try:
            key = read_text(path, MAX_SECRET_BYTES).strip()
        except FileNotFoundError:
            why = "does not exist"
        except OSError as e:
            why = f"cannot be read ({e.strerror})"
        else:
            if key:
                return None
            why = "is empty"
    return (f"refusing to start: the API key file {path} ({API_KEY_FILE_ENV}; services.dspark.apiKeyFile on "
            f"NixOS) {why}; write the key into it (one line, owned by root, mode 0400, outside the Nix store) "
            "and restart the unit, or remove apiKeyFile to serve the API without a key")
