"""The local appliance's tiny vision model (dspark.local.vision) and `dspark local up --vision`:
the directory is the same bytes on every write; transformers' own Idefics3 loads its weights
and runs them on an image, and its processor gives every image local_vision.IMAGE_TOKENS prompt
tokens; a line whose vLLM does not serve it is refused before anything is written; and the real
pair on runtime line v0.32.0 (TP=2) answers an image sent through the OpenAI SDK as an
`image_url` data URL with HTTP 200, the image's tokens counted in `usage`."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dspark.config import validate as C
from dspark.local import cluster as L
from dspark.local import vision as V
from dspark.node.launch import vllm_argv
from tests.harness.dspark_cli import invoke_dspark
from tests.harness.pair import kill_leftovers, start_pair, vllm_groups

LINE = "v0.32.0"  # the runtime line whose vLLM serves the tiny vision model (V.SERVING_LINES)
TEXT = "Describe this picture."
# The weights' bytes: pure integer arithmetic, so the same on every machine and numpy release.
WEIGHTS_SHA256 = "39fbef0f994b3fd687f80cbd2ac6e4ba6913e49bddce4ee485bc3c3969b9c668"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny-vision") / "model"
    V.write(d)
    return d


@pytest.fixture(scope="module")
def processor(model_dir):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(model_dir))


def png(width: int, height: int, seed: int = 0) -> bytes:
    """A PNG of stripes (not one flat colour: the vision tower sees varied pixels)."""
    from PIL import Image

    img = Image.new("RGB", (width, height))
    img.putdata([((x * 7 + seed) % 256, (y * 5) % 256, ((x + y) * 3) % 256)
                 for y in range(height) for x in range(width)])
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


# --- the directory ----------------------------------------------------------------------------

def test_the_directory_holds_the_model_its_processor_and_tokenizer(model_dir):
    assert sorted(p.name for p in model_dir.iterdir()) == sorted(V.FILES)
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg == V.TINY_VISION_MODEL and cfg["architectures"] == ["Idefics3ForConditionalGeneration"]
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    assert len(tok["model"]["vocab"]) + len(V.IMAGE_SPECIAL_TOKENS) == V.VOCAB_SIZE == cfg["text_config"]["vocab_size"]
    assert ids[V.IMAGE] == cfg["image_token_id"] == V.IMAGE_TOKEN_ID
    assert max(ids.values()) == V.VOCAB_SIZE - 1  # every id the random model can generate decodes
    proc = json.loads((model_dir / "processor_config.json").read_text())
    pre = json.loads((model_dir / "preprocessor_config.json").read_text())
    assert proc["image_seq_len"] == V.IMAGE_SEQ_LEN and pre["do_image_splitting"] is False
    # image_seq_len as transformers' Idefics3Processor defines it: the tower's patches over scale_factor^2.
    vis = cfg["vision_config"]
    assert proc["image_seq_len"] == (vis["image_size"] // vis["patch_size"]) ** 2 // cfg["scale_factor"] ** 2
    assert pre["max_image_size"]["longest_edge"] == vis["image_size"]


def test_writes_are_byte_identical_and_the_weights_are_pinned(tmp_path):
    V.tokenizer_json.cache_clear()
    V.safetensors_bytes.cache_clear()
    t0 = time.process_time()
    V.write(tmp_path / "a")
    took = time.process_time() - t0
    assert took < 10, f"write() took {took:.2f} s of CPU"
    # Another process (its own hash seeds, its own thread pool) writes the same bytes.
    code = f"from dspark.local import vision as V; V.write({str(tmp_path / 'b')!r})"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300,
                   env={**os.environ, "RAYON_NUM_THREADS": "1", "PYTHONHASHSEED": "12345"})
    for name in V.FILES:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    weights = (tmp_path / "a" / "model.safetensors").read_bytes()
    assert hashlib.sha256(weights).hexdigest() == WEIGHTS_SHA256
    assert len(weights) < 4 << 20, len(weights)
    mtime = (tmp_path / "a" / "model.safetensors").stat().st_mtime_ns
    V.write(tmp_path / "a")  # equal files are left alone
    assert (tmp_path / "a" / "model.safetensors").stat().st_mtime_ns == mtime


def test_transformers_idefics3_loads_every_weight_and_runs_an_image(model_dir, processor):
    """The names and shapes are exactly transformers' Idefics3ForConditionalGeneration's (strict
    load: none missing, none left over), and the random model turns an image into finite logits."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, Idefics3ForConditionalGeneration

    model = Idefics3ForConditionalGeneration(AutoConfig.from_pretrained(str(model_dir)))
    weights = load_file(str(model_dir / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in weights.items()} == V.weight_shapes()
    model.load_state_dict(weights, strict=True)
    model.eval()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": TEXT}]}]
    prompt = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    from PIL import Image

    inputs = processor(text=[prompt], images=[Image.open(io.BytesIO(png(300, 200)))], return_tensors="pt",
                       add_special_tokens=False)
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], V.VOCAB_SIZE)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("size", [(300, 200), (40, 500), (112, 112), (1024, 768)])
def test_an_image_of_any_size_is_image_tokens_prompt_tokens(processor, size):
    """transformers' Idefics3Processor (the one vLLM's Idefics3 runs) on the chat template's
    rendering: the image adds processor_config.json's image_seq_len <image> tokens and 3 tags."""
    with_image = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": TEXT}]}]
    text_only = [{"role": "user", "content": TEXT}]
    prompt = processor.tokenizer.apply_chat_template(with_image, tokenize=False, add_generation_prompt=True)
    assert prompt == f"<s><|user|>\n{V.IMAGE}{TEXT}</s><|assistant|>\n"
    from PIL import Image

    out = processor(text=[prompt], images=[Image.open(io.BytesIO(png(*size)))], add_special_tokens=False)
    plain_prompt = processor.tokenizer.apply_chat_template(text_only, tokenize=False, add_generation_prompt=True)
    plain = processor.tokenizer(plain_prompt, add_special_tokens=False)
    ids = out["input_ids"][0]
    assert len(ids) - len(plain["input_ids"]) == V.IMAGE_TOKENS == processor.image_seq_len + 3
    assert ids.count(V.IMAGE_TOKEN_ID) == processor.image_seq_len == V.IMAGE_SEQ_LEN
    assert tuple(out["pixel_values"].shape[-2:]) == (V.IMAGE_SIZE, V.IMAGE_SIZE)  # one tile, never split


def test_string_content_renders_as_the_text_models_template(processor):
    from dspark.local import model as M

    chat = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello"}]
    got = processor.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert got == "<s><|system|>\nYou are terse.</s><|user|>\nHello</s><|assistant|>\n"
    assert V.CHAT_TEMPLATE.endswith(M.CHAT_TEMPLATE.replace("(message['content'] or '')", "content(message['content'])")
                                    .replace("(messages[0]['content'] or '')", "content(messages[0]['content'])"))


def test_the_readme_states_the_image_token_count_and_tile():
    from tests.harness.docs_text import docs_text

    m = re.search(r"resized to one (\d+)x(\d+) tile and counts (\d+) prompt tokens", docs_text())
    assert m, "README.md: the vision model's image tokens are not stated"
    assert tuple(map(int, m.groups())) == (V.IMAGE_SIZE, V.IMAGE_SIZE, V.IMAGE_TOKENS)


# --- local up --vision: the cluster file and the refusals ---------------------------------------

@pytest.fixture
def line_installed(tmp_path, monkeypatch) -> Path:
    """A lines folder where LINE's vLLM is a stub (the cluster file only names it)."""
    exe = tmp_path / "lines" / LINE / "bin" / "vllm"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\nexit 1\n")
    exe.chmod(0o755)
    monkeypatch.setenv(L.LINES_DIR_ENV, str(tmp_path / "lines"))
    return exe


def test_the_vision_cluster_file_serves_the_weights_with_one_image_a_prompt(tmp_path, line_installed):
    path = L.prepare(tmp_path / "w", line=LINE, vision=True)
    c = C.load(path)  # the very validation a hand-written file gets
    assert Path(c.model.path) == (tmp_path / "w" / "model-vision").resolve()
    assert sorted(p.name for p in Path(c.model.path).iterdir()) == sorted(V.FILES)
    s = c.serving
    assert s.runtime_line == LINE and s.load_format == "auto" and s.limit_mm_per_prompt == {"image": 1}
    assert s.line_commands == {LINE: [str(line_installed)]}  # a switch only to a line that serves it
    argv = vllm_argv(c, c.head)
    assert argv[argv.index("--limit-mm-per-prompt") + 1] == '{"image":1}'
    assert argv[argv.index("--load-format") + 1] == "auto"
    text = C.load(L.prepare(tmp_path / "t", line=LINE))  # without --vision: the text model, as before
    assert text.serving.load_format == "dummy" and text.serving.limit_mm_per_prompt is None
    assert Path(text.model.path).name == "model"


def test_vision_on_a_line_that_does_not_serve_it_is_refused_before_anything_is_written(tmp_path):
    r = invoke_dspark("local", "up", "--vision", "--dir", str(tmp_path / "w"))  # the default line, v0.28.0
    assert r.returncode == 2, r.stderr
    assert "--vision: runtime line v0.28.0" in r.stderr and f"--line {LINE}" in r.stderr, r.stderr
    assert "engine dies on the first image" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "w").exists()


def test_vision_on_four_nodes_is_refused(tmp_path, line_installed):
    r = invoke_dspark("local", "up", "--vision", "--line", LINE, "--nodes", "4", "--dir", str(tmp_path / "w"))
    assert r.returncode == 2 and "2 attention heads" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "w").exists()
    with pytest.raises(L.LocalError, match="2 attention heads"):
        L.prepare(tmp_path / "w", nodes=4, line=LINE, vision=True)
    assert not (tmp_path / "w").exists()


# --- the real pair on v0.32.0 -------------------------------------------------------------------

@pytest.fixture(scope="module")
def vision_pair(tmp_path_factory):
    """`dspark local up --line v0.32.0 --vision`: the real pair (TP=2) of this module, the one
    place the vision model is served (one start-up)."""
    exe = L.lines_dir() / LINE / "bin" / "vllm"
    if not exe.exists():
        pytest.skip(f"runtime line {LINE}'s CPU build is not installed ({exe}); .ci/setup installs it")
    workdir = tmp_path_factory.mktemp("vision-pair")
    pair = start_pair(workdir, timeout=900, line=LINE, vision=True)  # cleans up itself if it does not come up
    groups: set[int] = set()
    try:
        groups = vllm_groups(pair)
        yield pair
    finally:
        pair.stop()
        kill_leftovers(workdir, groups | pair.groups)


@pytest.fixture(scope="module")
def client(vision_pair):
    import openai

    with openai.OpenAI(base_url=vision_pair.api_url + "/v1", api_key="unused", timeout=300, max_retries=0) as c:
        yield c


def chat(client, content, max_tokens: int = 8):
    """One chat request through the SDK; the raw response (its status) and the parsed one."""
    raw = client.chat.completions.with_raw_response.create(
        model=L.SERVED_NAME, messages=[{"role": "user", "content": content}], max_tokens=max_tokens,
        extra_body={"ignore_eos": True})
    return raw.status_code, raw.parse()


@pytest.mark.pair
def test_the_pair_counts_an_images_tokens_in_usage(client, vision_pair):
    text_status, text_only = chat(client, TEXT)
    assert text_status == 200 and text_only.choices[0].message.content and text_only.usage.completion_tokens == 8
    seen = {}
    for size in ((300, 200), (40, 500)):  # any size: one tile, the same count
        status, out = chat(client, [{"type": "image_url", "image_url": {"url": data_url(png(*size))}},
                                    {"type": "text", "text": TEXT}])
        assert status == 200 and out.choices[0].message.role == "assistant" and out.usage.completion_tokens == 8
        seen[size] = out.usage.prompt_tokens
    assert {n - text_only.usage.prompt_tokens for n in seen.values()} == {V.IMAGE_TOKENS}, (seen, text_only.usage)
    print(f"\nprompt_tokens: {text_only.usage.prompt_tokens} text only, {seen} with one image "
          f"(IMAGE_TOKENS {V.IMAGE_TOKENS})")


@pytest.mark.pair
def test_the_pair_refuses_a_second_image_in_one_prompt(client):
    """limit_mm_per_prompt {image = 1} reaches vLLM: two images are a 400, not a crash."""
    import openai

    part = {"type": "image_url", "image_url": {"url": data_url(png(64, 64))}}
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, [part, part, {"type": "text", "text": TEXT}])
    assert e.value.status_code == 400 and "image" in str(e.value)
    status, _ = chat(client, TEXT)  # and the pair still serves
    assert status == 200


def group_members(groups: set[int]) -> list[int]:
    """Every live process now in one of these process groups (a zombie has exited already: its
    new parent, init, reaps it)."""
    out = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != b"Z" and int(fields[2]) in groups:
            out.append(int(name))
    return out


@pytest.mark.pair
def test_the_vision_pair_stops_cleanly(vision_pair):
    """Ctrl-C, as a user stops it: exit 0, and nothing of either node's supervisor or vLLM (its
    engine and TP workers rename themselves: found by their process groups) is left."""
    assert "(vision: a user message may carry one image" in vision_pair.log()
    groups = vllm_groups(vision_pair)
    assert len(groups) == 2, groups  # each node's vLLM leads a group of its own
    code = vision_pair.stop()
    assert code == 0, vision_pair.log()[-3000:]
    assert "stopped; no process left behind" in vision_pair.log()
    left = subprocess.run(["pgrep", "-f", str(vision_pair.workdir)], capture_output=True, text=True).stdout.split()
    assert not left and not group_members(groups), (left, group_members(groups))
