"""vLLM's command line as a cluster file sets it (`check_command_line`): no secret (ps shows it),
nothing vLLM reads as an option where a value belongs, no argument too long, and in extra_args no
option dspark writes itself (`owned_flag`, from the table in dspark.config.flags).
"""

from __future__ import annotations

import dataclasses

from dspark.config.flags import DSPARK_FLAGS
from dspark.config.schema import Cluster, ModelConfig
from dspark.config.toml import toml_key, toml_value

# The longest single argument dspark puts on vLLM's command line (a path is at most 4096 bytes).
MAX_ARG_CHARS = 4096


def owned_flag(arg: str) -> str | None:
    """The DSPARK_FLAGS option `arg` sets (in any spelling argparse takes), or None. argparse takes
    `--opt=v`, `--opt_name` (vLLM reads _ as -), an unambiguous abbreviation (`--node-r`),
    `--opt.key=v` for a JSON option, and `--no-opt` for a switch: each is the same option."""
    if not arg.startswith("-") or arg == "-" or arg[1:2].isdigit():
        return None
    dashes = "--" if arg.startswith("--") else "-"
    name = arg[len(dashes):].split("=", 1)[0].split(".", 1)[0].replace("_", "-")
    if dashes == "-":
        return "-" + name if "-" + name in DSPARK_FLAGS else None
    if name.startswith("no-") and "--" + name[3:] in DSPARK_FLAGS:
        name = name[3:]
    if "--" + name in DSPARK_FLAGS:
        return "--" + name
    if len(name) >= 3:  # argparse's abbreviations (vLLM's parser keeps allow_abbrev on)
        hits = [f for f in DSPARK_FLAGS if f.startswith("--" + name)]
        if hits:
            return hits[0]
    return None


def check_command_line(c: Cluster) -> list[str]:
    """What dspark puts on vLLM's command line: no secret (ps shows it), nothing vLLM reads
    as an option where a value belongs, no option dspark sets itself, no argument too long."""
    from dspark.config.secret_policy import secret_args, secret_keys

    p: list[str] = []
    m, s = c.model, c.serving
    for key in ("path", "served_name"):
        value = getattr(m, key)
        if value.startswith("-"):  # the value itself is not echoed: it may be a secret
            p.append(f"model.{key}: starts with '-', which vLLM would read as an option (and ps would show); "
                     f"write a {'directory' if key == 'path' else 'name'}, e.g. {key} = "
                     f"{toml_value(dataclasses.fields(ModelConfig)[0 if key == 'path' else 1].metadata['example'])}")
        elif not value:
            p.append(f"model.{key}: empty; write e.g. {key} = \"deepseek-v4-flash\"" if key == "served_name"
                     else "model.path: empty; write the model directory, e.g. path = \"/var/lib/dspark/models/x\"")
        if len(value) > MAX_ARG_CHARS:
            p.append(f"model.{key}: {len(value)} characters, longer than {MAX_ARG_CHARS}")
    if not s.vllm_command or not s.vllm_command[0]:
        p.append("serving.vllm_command: must name vLLM's CLI, e.g. vllm_command = [\"vllm\"] or "
                 "[\"/opt/runtime/bin/vllm\"]")
    commands = [(f"serving.line_commands.{toml_key(k)}", v) for k, v in s.line_commands.items()]
    for where, args in (("serving.extra_args", s.extra_args), ("serving.vllm_command", s.vllm_command), *commands):
        for flag in secret_args(args):
            p.append(f"{where}: {flag} takes a secret, which does not belong in the cluster file nor on "
                     "vLLM's command line (ps shows it); the API key goes in the 'api-key' credential or "
                     "DSPARK_API_KEY in the service's environment file")
        long = [a for a in args if len(a) > MAX_ARG_CHARS]
        if long:
            p.append(f"{where}: an argument of {len(long[0])} characters, longer than {MAX_ARG_CHARS}; vLLM's "
                     "options and paths are shorter")
    for arg in s.extra_args:
        owned = owned_flag(arg)
        if owned:
            shown = arg.split("=", 1)[0]
            p.append(f"serving.extra_args: {shown} sets {owned}, which dspark writes itself from "
                     f"{DSPARK_FLAGS[owned]}; set that instead and remove {shown} from extra_args")
    if s.speculative_config is not None:
        for where in secret_keys(s.speculative_config, "serving.speculative_config"):
            p.append(f"{where}: a secret does not belong in the cluster file nor on vLLM's command line "
                     "(speculative_config is passed as JSON in --speculative-config); remove it")
    return p
