"""Serving a DeepSeek V4 checkpoint with a vision tower (DeepSeek-V4-Flash-Vision-Exp).

The cluster file's serving.limit_mm_per_prompt is rendered to vLLM's --limit-mm-per-prompt (and
parsed by vLLM's own argument parser into its multimodal config), refused when it names no
modality vLLM limits, and refused in extra_args (the key owns the flag). A node's checks
(`dspark check`, the supervisor's gate) refuse a Vision-Exp config.json on a runtime line whose
vLLM has no DeepSeek V4 vision model, naming the line that has one; tests/overlay/test_vision_line.py
proves each line's claim through that line's own vLLM.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from dspark.config import validate as C
from dspark.config.schema import Cluster, ConfigError
from dspark.config.toml import toml_value
from dspark.lines import runtime as R
from dspark.node.launch import render
from dspark.preflight import Host, run
from tests.config.test_config_sources import vllm  # noqa: F401,F811 (the fixture)
from tests.node.test_render import flags

TESTS = Path(__file__).parents[1]
FIXTURE = TESTS / "fixtures" / "cluster-two-node.toml"
FLASH_CONFIG = TESTS.parent / "src" / "dspark" / "data" / "deepseek-v4-flash" / "config.json"
# The vision fields of DeepSeek-V4-Flash-Vision-Exp's config.json, as public checkers of the released
# checkpoint read them (flat keys beside the text model's; the architecture stays DeepseekV4ForCausalLM).
VISION_FIELDS = {"vision_n_layers": 32, "vision_dim": 1024, "vision_n_heads": 16, "vision_inter_dim": 2816,
                 "vision_patch_size": 14, "vision_downsample_ratio": 3, "vision_max_n_token": 384,
                 "vision_min_pixels": 147456, "vision_max_wh_ratio": 8}


def vision_exp_config() -> dict:
    return {**json.loads(FLASH_CONFIG.read_text()), **VISION_FIELDS}


def cluster_with(tmp_path: Path, **serving) -> Cluster:
    text = FIXTURE.read_text()
    extra = "".join(f"{k} = {toml_value(v)}\n" for k, v in serving.items())
    path = tmp_path / "cluster.toml"
    path.write_text(text.replace('[serving]\n', '[serving]\n' + extra, 1))
    return C.load(path)


@pytest.mark.vllm
def test_limit_is_rendered_as_json_and_vllm_parses_it(tmp_path, vllm):  # noqa: F811
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cluster = cluster_with(tmp_path, limit_mm_per_prompt={"image": 4})
    f = flags(render(cluster, cluster.head).argv)
    assert f["--limit-mm-per-prompt"] == '{"image":4}'
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--limit-mm-per-prompt", f["--limit-mm-per-prompt"]])
    assert args.limit_mm_per_prompt == {"image": 4}
    # Unset: the flag is left out (vLLM's own limit).
    plain = C.load(FIXTURE)
    assert "--limit-mm-per-prompt" not in flags(render(plain, plain.head).argv)


@pytest.mark.parametrize("table, said", [
    ({"picture": 2}, "serving.limit_mm_per_prompt.picture: not a modality vLLM limits"),
    ({"image": -1}, "serving.limit_mm_per_prompt.image: must be a whole number in [0, 1024], got -1"),
    ({"image": "four"}, "serving.limit_mm_per_prompt: expected a table, got { image = \"four\" }"),
])
def test_a_bad_limit_is_refused_by_name(tmp_path, table, said):
    with pytest.raises(ConfigError) as e:
        cluster_with(tmp_path, limit_mm_per_prompt=table)
    assert said in str(e.value)


def test_the_flag_in_extra_args_points_at_the_key(tmp_path):
    with pytest.raises(ConfigError) as e:
        cluster_with(tmp_path, extra_args=["--limit-mm-per-prompt", '{"image": 2}'])
    assert "serving.limit_mm_per_prompt" in str(e.value)


def _model_line_checks(tmp_path: Path, line: str, config: dict) -> list:
    model = tmp_path / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(config))
    cluster = C.load(FIXTURE)
    cluster = replace(cluster, model=replace(cluster.model, path=str(model)),
                      serving=replace(cluster.serving, runtime_line=line, load_format="dummy"))
    report = run(cluster, cluster.head, Host(environ={}, addresses=lambda: {}, nvml=lambda: {}, peers=False,
                                             identity={"error": "not identified in this test"}))
    return [c for c in report.checks if c.name == "model.line"]


def test_a_line_without_the_vision_model_refuses_vision_exp_and_names_the_line_that_has_it(tmp_path):
    lines = R.load()
    assert lines.lines["v0.28.0"].deepseek_v4_vision is None
    assert lines.lines["v0.32.0"].deepseek_v4_vision is not None
    [check] = _model_line_checks(tmp_path, "v0.28.0", vision_exp_config())
    assert check.status == "fail"
    assert "runtime line v0.28.0 (vLLM 0.28.0) cannot serve this checkpoint" in check.seen
    assert "vision_n_layers 32" in check.seen
    assert "serving.runtime_line = 'v0.32.0'" in check.fix and "dspark switch v0.32.0" in check.fix


def test_the_line_with_the_vision_model_and_a_text_checkpoint_pass(tmp_path):
    assert _model_line_checks(tmp_path / "a", "v0.32.0", vision_exp_config()) == []
    assert _model_line_checks(tmp_path / "b", "v0.28.0", json.loads(FLASH_CONFIG.read_text())) == []
    # vision_n_layers 0 is the text model (vLLM's DeepseekV4Config default).
    assert _model_line_checks(tmp_path / "c", "v0.28.0", {**vision_exp_config(), "vision_n_layers": 0}) == []
