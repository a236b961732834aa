"""Each runtime line's claim about DeepSeek-V4-Flash-Vision-Exp (runtime_lines.toml's
deepseek_v4_vision), proven through the line's own vLLM: the checkpoint's config.json (the text
model's fields plus the vision_* ones, architecture still DeepseekV4ForCausalLM) goes through
vLLM's own config class and architecture convertor, and the model registry is asked for the class
that comes out. vLLM 0.32.0 routes it to DeepseekV4ForConditionalGeneration, which its registry
holds; vLLM 0.28.0 has no such class (so the checkpoint would load as the text model), which is
why dspark's checks refuse it there (tests/node/test_vision_serving.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dspark.lines import runtime as R
from tests.node.test_vision_serving import vision_exp_config

pytestmark = pytest.mark.vllm

PROBE = r"""
import json, sys, warnings
warnings.simplefilter("ignore")
cfg = json.loads(sys.argv[1])
from vllm.model_executor.models.registry import ModelRegistry
archs = set(ModelRegistry.get_supported_archs())
out = {"registry_has_vl": "DeepseekV4ForConditionalGeneration" in archs}
try:
    from vllm.transformers_utils.configs.deepseek_v4 import DeepseekV4Config
    from vllm.transformers_utils.model_arch_config_convertor import DeepseekV4ModelArchConfigConvertor
except ImportError as e:
    out["convertor"] = f"absent: {e}"
else:
    hf = DeepseekV4Config(**cfg)
    DeepseekV4ModelArchConfigConvertor(hf, hf)
    out["architectures"] = hf.architectures
print("@@" + json.dumps(out))
"""


def probe(python, config: dict) -> dict:
    r = subprocess.run([str(python), "-c", PROBE, json.dumps(config)], capture_output=True, text=True,
                       timeout=300, check=False)
    found = [line for line in r.stdout.splitlines() if line.startswith("@@")]
    assert found, f"the probe did not report:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return json.loads(found[0][2:])


def test_v0_32_0_routes_vision_exp_to_its_vl_model(python_032):
    assert R.load().lines["v0.32.0"].deepseek_v4_vision is not None
    out = probe(python_032, vision_exp_config())
    assert out == {"registry_has_vl": True, "architectures": ["DeepseekV4ForConditionalGeneration"]}
    # The text model stays the text model.
    text = {**vision_exp_config(), "vision_n_layers": 0}
    assert probe(python_032, text)["architectures"] == ["DeepseekV4ForCausalLM"]


def test_v0_28_0_has_no_deepseek_v4_vision_model():
    pytest.importorskip("vllm")
    assert R.load().lines["v0.28.0"].deepseek_v4_vision is None
    out = probe(sys.executable, vision_exp_config())
    assert out["registry_has_vl"] is False


CHAT = r"""
import json, sys, warnings
warnings.simplefilter("ignore")
from vllm.tokenizers.deepseek_v4_encoding import encode_messages
messages = [{"role": "user", "content": [
    {"type": "text", "text": "What is in this picture?"},
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]
try:
    out = {"prompt": encode_messages(messages, thinking_mode="chat")}
except Exception as e:  # the release's own refusal, reported
    out = {"error": f"{type(e).__name__}: {e}"}
print("@@" + json.dumps(out))
"""


def chat_prompt(python) -> dict:
    r = subprocess.run([str(python), "-c", CHAT], capture_output=True, text=True, timeout=300, check=False)
    found = [line for line in r.stdout.splitlines() if line.startswith("@@")]
    assert found, f"the chat probe did not report:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return json.loads(found[0][2:])


def test_the_chat_template_the_line_renders_places_the_image(python_032):
    """`--tokenizer-mode deepseek_v4` (config_schema.SEED_EXTRA_ARGS, the chat template of DeepSeek V4
    checkpoints): vLLM 0.32.0's encoder puts the image placeholder where an image_url part is, which
    the VL model's processor expands to the image's tokens; 0.28.0's has no image part."""
    out = chat_prompt(python_032)
    assert out.get("prompt", "").count("<｜deepseek_image｜>") == 1, out
    assert "What is in this picture?" in out["prompt"]
    old = chat_prompt(sys.executable)
    assert "<｜deepseek_image｜>" not in old.get("prompt", ""), old
