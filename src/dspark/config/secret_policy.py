"""What dspark counts as a secret: the one policy, used by the cluster file's check (refused),
`dspark render` and the supervisor's log line (redacted) and bench's reports (redacted).

A secret never goes into the cluster file (world-readable, and in the Nix store on NixOS) nor
onto vLLM's command line (every user can read it in `ps`): the API key reaches vLLM through
its environment, from the systemd credential `api-key` or the service's environment file.

- An environment variable is a secret when it is one of SECRET_ENV_NAMES, or when its name,
  split at `_`, ends in a secret word (TOKEN, SECRET, PASSWORD, PASSWD, CREDENTIAL(S)) or in
  a secret pair (API_KEY, ACCESS_KEY, PRIVATE_KEY, SECRET_KEY, AUTH_KEY): HF_TOKEN,
  OPENAI_API_KEY, AWS_SECRET_ACCESS_KEY, but not TOKENIZERS_PARALLELISM.
- A command-line flag is a secret when its name, split at `-`, ends the same way: --api-key,
  --hf-token, `--api-key=VALUE` (but not --max-num-batched-tokens or --tokenizer).
- A key of a table dspark passes to vLLM as JSON (`speculative_config`) is a secret by the
  environment rule, with `-` read as `_`: api_key, api-key, hf_token.
"""

from __future__ import annotations

REDACTED = "<redacted>"
SECRET_ENV_NAMES = frozenset({"VLLM_API_KEY", "DSPARK_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN",
                              "OPENAI_API_KEY", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"})
SECRET_WORDS = frozenset({"token", "secret", "password", "passwd", "credential", "credentials"})
SECRET_PAIRS = frozenset({("api", "key"), ("access", "key"), ("private", "key"), ("secret", "key"),
                          ("auth", "key"), ("apikey",)})


def _ends_secret(words: list[str]) -> bool:
    words = [w for w in words if w]
    if not words:
        return False
    return words[-1] in SECRET_WORDS or tuple(words[-2:]) in SECRET_PAIRS or (words[-1],) in SECRET_PAIRS


def is_secret_env(name: str) -> bool:
    return name.upper() in SECRET_ENV_NAMES or _ends_secret(name.lower().split("_"))


def is_secret_flag(arg: str) -> bool:
    """`--api-key` or `--api-key=VALUE` (an option whose value is a secret)."""
    if not arg.startswith("-"):
        return False
    name = arg.lstrip("-").split("=", 1)[0]
    return _ends_secret(name.lower().replace("_", "-").split("-"))


def is_secret_key(name: str) -> bool:
    """A key of a table passed to vLLM (speculative_config): `api_key`, `api-key`, `hf_token`."""
    return is_secret_env(name.replace("-", "_"))


def secret_keys(value: object, where: str, depth: int = 0) -> list[str]:
    """Where a table nested in tables and lists has a secret key (their paths, never the values)."""
    if depth > 64:
        return []
    out: list[str] = []
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str) and is_secret_key(k):
                out.append(f"{where}.{k}")
            else:
                out += secret_keys(v, f"{where}.{k}", depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += secret_keys(v, f"{where}[{i}]", depth + 1)
    return out


def redact_args(args: list[str]) -> list[str]:
    """A command line with the value of every secret option replaced by REDACTED."""
    out: list[str] = []
    hide_next = False
    for a in args:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        if is_secret_flag(a):
            if "=" in a:
                out.append(a.split("=", 1)[0] + "=" + REDACTED)
            else:
                out.append(a)
                hide_next = True
            continue
        out.append(a)
    return out


def redact_env(env: dict[str, str]) -> dict[str, str]:
    return {k: (REDACTED if is_secret_env(k) else v) for k, v in env.items()}


def secret_args(args: list[str]) -> list[str]:
    """The secret options on a command line (their names only, never their values)."""
    return [a.split("=", 1)[0] for a in args if is_secret_flag(a)]
