"""The local appliance's tiny model directory (dspark.local.model), proven through its callers:
transformers' AutoTokenizer and vLLM's own tokenizer loader read it; and the real local pair
(`dspark local up`, vLLM's CPU build at TP=2) answers text completions, chat completions (plain
and streamed, through the OpenAI SDK), token-id prompts and `vllm bench serve --dataset-name
random` with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from dspark.config import validate as C
from dspark.local import cluster as L
from dspark.local import model as M

VOCAB = M.TINY_MODEL["vocab_size"]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello, how are you?"}]
TEXT = "Hello, world! Ünïcödé 日本語 🙂\ttabs\nand  double  spaces; numbers 12345."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny") / "model"
    M.write(d)
    return d


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def vllm_tokenizer(model_dir):
    from vllm.tokenizers import get_tokenizer

    return get_tokenizer(str(model_dir))


def test_the_directory_holds_the_model_and_its_tokenizer(model_dir):
    assert sorted(p.name for p in model_dir.iterdir()) == sorted(M.FILES)
    assert json.loads((model_dir / "config.json").read_text()) == M.TINY_MODEL
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    assert len(tok["model"]["vocab"]) == VOCAB
    assert {t["content"]: t["id"] for t in tok["added_tokens"]} == {t: i for i, t in enumerate(M.SPECIAL_TOKENS)}
    assert M.SPECIAL_TOKENS[M.TINY_MODEL["bos_token_id"]] == M.BOS
    assert M.SPECIAL_TOKENS[M.TINY_MODEL["eos_token_id"]] == M.EOS
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (0, 1)


def test_writes_are_byte_identical_and_fast(tmp_path):
    M.tokenizer_json.cache_clear()
    t0 = time.process_time()  # CPU time of every thread: a loaded host's waits are not write()'s
    M.write(tmp_path / "a")
    took = time.process_time() - t0
    M.tokenizer_json.cache_clear()
    M.write(tmp_path / "b")
    for name in M.FILES:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert took < 5, f"write() took {took:.2f} s of CPU"
    # Another process (its own hash seeds, its own thread pool) writes the same bytes.
    code = f"from dspark.local import model as M; M.write({str(tmp_path / 'c')!r})"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120,
                   env={**os.environ, "RAYON_NUM_THREADS": "1", "PYTHONHASHSEED": "12345"})
    for name in M.FILES:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "c" / name).read_bytes(), name


def test_write_over_an_old_directory_leaves_equal_files_alone(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(M.TINY_MODEL))  # what local.py wrote before
    M.write(d)
    assert json.loads((d / "config.json").read_text()) == M.TINY_MODEL
    before = {n: (d / n).stat().st_mtime_ns for n in M.FILES}
    time.sleep(0.01)
    M.write(d)
    assert {n: (d / n).stat().st_mtime_ns for n in M.FILES} == before
    assert sorted(p.name for p in d.iterdir()) == sorted(M.FILES)  # no temporary file left


@pytest.mark.parametrize("which", ["hf", "vllm"])
def test_loaders_read_it_and_text_round_trips(which, request):
    tok = request.getfixturevalue(f"{which}_tokenizer")
    assert tok.vocab_size == VOCAB and len(tok) == VOCAB
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)
    assert sorted(tok.all_special_ids) == list(range(len(M.SPECIAL_TOKENS)))
    ids = tok.encode(TEXT)
    assert ids[0] == 0 and 0 not in ids[1:] and max(ids) < VOCAB
    assert tok.decode(ids, skip_special_tokens=True) == TEXT
    assert tok.decode(tok.encode(TEXT, add_special_tokens=False)) == TEXT
    assert len(ids) < len(TEXT.encode())  # merges, not bytes only


@pytest.mark.parametrize("which", ["hf", "vllm"])
def test_every_id_decodes(which, request):
    tok = request.getfixturevalue(f"{which}_tokenizer")
    pieces = [tok.decode([i]) for i in range(VOCAB)]
    assert all(isinstance(p, str) and p for p in pieces)
    assert pieces[: len(M.SPECIAL_TOKENS)] == list(M.SPECIAL_TOKENS)
    assert all(tok.decode([i], skip_special_tokens=True) == "" for i in range(len(M.SPECIAL_TOKENS)))
    tokens = tok.convert_ids_to_tokens(list(range(VOCAB)))
    assert None not in tokens and len(set(tokens)) == VOCAB


@pytest.mark.parametrize("which", ["hf", "vllm"])
def test_chat_template_renders_a_conversation(which, request):
    tok = request.getfixturevalue(f"{which}_tokenizer")
    convo = CHAT + [{"role": "assistant", "content": "Fine."}, {"role": "user", "content": "Bye"}]
    text = tok.apply_chat_template(convo, tokenize=False, add_generation_prompt=True)
    assert text == ("<s><|system|>\nYou are terse.</s><|user|>\nHello, how are you?</s>"
                    "<|assistant|>\nFine.</s><|user|>\nBye</s><|assistant|>\n")
    assert tok.apply_chat_template(convo, tokenize=False).endswith("Bye</s>")
    ids = tok.encode(text, add_special_tokens=False)  # how vLLM tokenizes a rendered chat
    assert ids[:2] == [0, 2] and ids[-2:] == [4, tok.encode("\n", add_special_tokens=False)[0]]
    assert ids.count(1) == 4 and ids.count(3) == 2 and ids.count(4) == 2
    with pytest.raises(Exception, match="system, user, assistant and tool, not developer"):
        tok.apply_chat_template([{"role": "developer", "content": "x"}], tokenize=False)


# --- one real vLLM server on the written directory ----------------------------------------------

def n_tokens(text: str, add_special_tokens: bool) -> int:
    from tokenizers import Tokenizer

    return len(Tokenizer.from_str(M.tokenizer_json()).encode(text, add_special_tokens=add_special_tokens).ids)


@pytest.fixture(scope="module")
def server(local_pair):
    """The real local pair (`dspark local up`: TP=2, the tokenizer on), as a client sees it."""
    assert C.load(local_pair.cluster_file).serving.skip_tokenizer_init is False
    return {"url": local_pair.api_url, "model_dir": local_pair.workdir / "model",
            "env": {**os.environ, "HF_HUB_OFFLINE": "1"}}  # nothing may be downloaded


@pytest.fixture(scope="module")
def client(server):
    import openai

    with openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused", timeout=120, max_retries=0) as c:
        yield c


@pytest.mark.pair
def test_server_text_completion(client):
    out = client.completions.create(model=L.SERVED_NAME, prompt="The quick brown fox", max_tokens=8,
                                 extra_body={"ignore_eos": True})
    assert out.choices[0].text and out.usage.completion_tokens == 8
    assert out.usage.prompt_tokens == n_tokens("The quick brown fox", add_special_tokens=True)  # bos added


@pytest.mark.pair
def test_server_chat_completion(client):
    out = client.chat.completions.create(model=L.SERVED_NAME, messages=CHAT, max_tokens=8,
                                         extra_body={"ignore_eos": True})
    msg = out.choices[0].message
    assert msg.role == "assistant" and msg.content and out.usage.completion_tokens >= 1
    # The prompt is the template's rendering, bos included by the template (not added again).
    assert out.usage.prompt_tokens == n_tokens(
        "<s><|system|>\nYou are terse.</s><|user|>\nHello, how are you?</s><|assistant|>\n", add_special_tokens=False)


@pytest.mark.pair
def test_server_chat_completion_streamed(client):
    stream = client.chat.completions.create(model=L.SERVED_NAME, messages=CHAT, max_tokens=8, stream=True,
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and len(chunks) >= 2
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)


@pytest.mark.pair
def test_server_token_id_prompt(server):
    body = json.dumps({"model": L.SERVED_NAME, "prompt": [1, 2, 3], "max_tokens": 8,
                       "return_token_ids": True, "ignore_eos": True}).encode()
    req = urllib.request.Request(server["url"] + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.loads(r.read())
    choice = out["choices"][0]
    assert len(choice["token_ids"]) == 8 and all(0 <= i < VOCAB for i in choice["token_ids"])
    assert out["usage"]["prompt_tokens"] == 3 and choice["text"]


@pytest.mark.pair
def test_server_vllm_bench_random(server, tmp_path):
    vllm = L.vllm_command()
    cmd = [*vllm, "bench", "serve", "--backend", "openai", "--base-url", server["url"],
           "--model", L.SERVED_NAME, "--tokenizer", str(server["model_dir"]),
           "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "8",
           "--num-prompts", "8", "--ignore-eos", "--seed", "14", "--disable-tqdm",
           "--save-result", "--result-dir", str(tmp_path), "--result-filename", "bench.json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=server["env"])
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["completed"] == 8 and result["failed"] == 0, result
    assert result["total_output_tokens"] == 64
    assert 8 * 28 <= result["total_input_tokens"] <= 8 * 36, result["total_input_tokens"]
