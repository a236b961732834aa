"""The model directory: config.json, every shard its index names (present, readable by the
service user, whole), and its size against what the memory plan reads."""

from __future__ import annotations

from pathlib import Path

from dspark.files.safe_read import MAX_MODEL_CONFIG_BYTES, MAX_MODEL_INDEX_BYTES, read_json
from dspark.preflight.result import Check, fail, ok, warn
from dspark.units.user import ServiceUser, readable_by

GiB = 1 << 30
INDEX = "model.safetensors.index.json"



def check_model_dir(model_path: str, load_format: str | None, user: ServiceUser) -> tuple[list[Check], object]:
    """Returns the checks and the model facts (dspark.plan.ModelFacts) when the shards parse."""
    from dspark.plan.facts import PlanError, load_model_facts

    d = Path(model_path)
    where = f"model.path {model_path}"
    if not d.is_dir():
        return [fail("model.dir", f"{where}: not a directory", "download the model to the same path on every node, "
                     "or correct model.path")], None
    cfg = d / "config.json"
    try:  # safe_read's guards: a FIFO, a device or an oversized file is refused at once
        data = read_json(cfg, MAX_MODEL_CONFIG_BYTES)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
    except FileNotFoundError:
        return [fail("model.dir", f"{where}: no config.json", "an incomplete download: fetch the model again")], None
    except OSError as e:
        return [fail("model.dir", f"{cfg}: unreadable ({e.strerror or e})", "fetch config.json again")], None
    except ValueError as e:
        return [fail("model.dir", f"{cfg}: not a JSON object ({e})", "fetch config.json again")], None
    out: list[Check] = []
    index_path = d / INDEX
    present = sorted(p.name for p in d.glob("*.safetensors"))
    expected_total = None
    if index_path.exists():
        try:
            index = read_json(index_path, MAX_MODEL_INDEX_BYTES)
            weight_map = index["weight_map"]
            named = sorted(set(weight_map.values()))
            expected_total = (index.get("metadata") or {}).get("total_size")
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
            return [fail("model.dir", f"{index_path}: not a safetensors index ({e})", "fetch it again")], None
        missing = [n for n in named if n not in present]
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            return [fail("model.shards", f"{len(missing)} of the {len(named)} shards {INDEX} names are missing: "
                         f"{', '.join(missing[:5])}{more}", "finish the download (the same files on every node)")], None
        extra = [n for n in present if n not in named]
        out.append(ok("model.shards", f"config.json and all {len(named)} shards {INDEX} names"))
        if extra:
            out.append(warn("model.shards", f"{len(extra)} *.safetensors not in the index ({', '.join(extra[:3])}): "
                            "the plan counts them, vLLM does not load them", "remove them from the model directory"))
        files = named
    elif present:
        out.append(ok("model.shards", f"config.json and {len(present)} shard(s), no index"))
        files = present
    elif load_format == "dummy":
        out.append(ok("model.shards", "no weight shards: serving.load_format = \"dummy\" (random weights)"))
        files = []
    else:
        return [fail("model.shards", f"{where}: config.json but no *.safetensors shards", "finish the download, or "
                     "set serving.load_format = \"dummy\" for random weights")], None
    unreadable = []
    for name in ["config.json", *([INDEX] if index_path.exists() else []), *files]:
        why = readable_by(d / name, user)
        if why:
            unreadable.append(why)
    extra_files = [p for p in d.iterdir()
                   if p.is_file() and p.name not in files and p.name not in ("config.json", INDEX)]
    for p in sorted(extra_files)[:200]:  # tokenizer and generation config files vLLM also reads
        why = readable_by(p, user)
        if why:
            unreadable.append(why)
    if unreadable:
        out.append(fail("model.readable", f"{user.name} ({user.why}) cannot read {len(unreadable)} file(s): "
                        f"{unreadable[0]}", f"chmod -R a+rX {d} (or give {user.name}'s group read access)"))
    else:
        out.append(ok("model.readable", f"readable by {user.name} ({user.why})"))
    if not files:
        return out, None
    try:
        facts = load_model_facts(d)
    except PlanError as e:
        out.append(fail("model.size", str(e), "fetch that shard again (a truncated or corrupt download)"))
        return out, None
    seen = f"{facts.weight_bytes / GiB:.2f} GiB of tensors in {len(present)} shard(s), as the memory plan reads them"
    if index_path.exists():
        held = {(t.shard, t.name) for t in facts.tensors}
        absent = [f"{k} ({v})" for k, v in weight_map.items() if (v, k) not in held]
        if absent:
            out.append(fail("model.size", f"{len(absent)} tensor(s) {INDEX} names are not in their shard's header: "
                            f"{', '.join(absent[:3])}", "fetch those shards again (a mixed or partial download)"))
            return out, facts
        seen += "; every tensor of the index is in its shard"
    # The index's total_size is what the publisher wrote, not always the tensors' exact sum:
    # a difference is worth a look, not a refusal (the headers above are the proof of a whole download).
    if (isinstance(expected_total, int) and not isinstance(expected_total, bool)
            and expected_total != facts.weight_bytes):
        out.append(warn("model.size", f"{seen}; {INDEX} says total_size {expected_total:,} bytes, the shards hold "
                        f"{facts.weight_bytes:,}", "compare with the publisher's file list; fetch the model again "
                        "if a shard is from another revision"))
        return out, facts
    out.append(ok("model.size", seen))
    return out, facts


def vision_checks(model_path: str, line_id: str) -> list[Check]:
    """Whether the runtime line serves the checkpoint: a DeepSeek V4 config.json with a vision
    tower needs a line whose vLLM has the DeepSeek V4 VL model (dspark.lines.runtime). Nothing
    is said for a directory whose config.json cannot be read (check_model_dir says why)."""
    from dspark.lines import runtime as runtime_lines

    try:
        data = read_json(Path(model_path) / "config.json", MAX_MODEL_CONFIG_BYTES)
    except (OSError, ValueError):
        return []
    lines = runtime_lines.load()
    if not isinstance(data, dict) or line_id not in lines.lines:
        return []
    why = runtime_lines.vision_refusal(lines.lines[line_id], lines, data)
    if why is None:
        return []
    return [fail("model.line", why, runtime_lines.vision_fix(lines))]
