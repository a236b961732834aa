"""`dspark plan --published --model ... --nodes N`: DeepSeek-V4-Flash-Vision-Exp and
DeepSeek-V4.1-Flash described without their weights (issue 32, item 4). Each description
reproduces its published index exactly; Vision-Exp fits two nodes, V4.1 fits neither two nor
four (its Engram tables are in memory under vLLM 0.32.0) and the plan says it needs eight."""

from __future__ import annotations

import hashlib
import json
import math

import pytest

from dspark.plan import published
from dspark.plan.facts import GiB
from dspark.plan.published_v41 import checkpoint_config, engram_head_rows, engram_rows_per_rank
from dspark.plan.published_v41 import config as v41_config
from dspark.plan.published_vision import replicated_by_vllm
from dspark.plan.weights import split_weights
from tests.harness.dspark_cli import invoke_dspark

NO_CONFIG = {"DSPARK_CONFIG": None}  # unset for the call


def _sha256_lines(names) -> str:
    """mudler/vllm.cpp's digest of a list (scripts/check-deepseek-v4-vision-manifests.py)."""
    return hashlib.sha256(("\n".join(names) + "\n").encode()).hexdigest()


@pytest.fixture(scope="module")
def vision_exp():
    return published.published_facts(published.VISION_EXP)


@pytest.fixture(scope="module")
def v41():
    return published.published_facts(published.V41)


# ---------------------------------------------------------------- Vision-Exp: the description


def test_vision_exp_reproduces_its_published_index(vision_exp):
    # mudler/vllm.cpp tests/parity/goldens/deepseek_v4_vision/index_manifest.json (revision 86f746b)
    names = sorted(t.name for t in vision_exp.tensors)
    assert len(names) == 72_633 == published.CHECKPOINTS[published.VISION_EXP].tensor_count
    assert vision_exp.weight_bytes == 167_811_372_792
    assert _sha256_lines(names) == "2458f9e212c893b3160e852cce91e5f0829e22bd8089746505d5039204a053a0"
    group = {"vision": [], "mtp": [], "language": []}
    for name in names:
        kind = ("vision" if name.startswith(("vision.", "aligner.", "image_")) else
                "mtp" if name.startswith("mtp.") else "language")
        group[kind].append(name)
    assert [len(group[k]) for k in ("language", "mtp", "vision")] == [67_658, 4_708, 267]
    assert _sha256_lines(group["language"]) == "9c6bfc641f210d85478373d6d3fca102ca74f44439491f42da1af571466fb899"
    assert _sha256_lines(group["mtp"]) == "2c68e7a8f142281ed8fe03e8b4286ea3d1b9b2cd565e073e95be1df092ba15f3"
    assert _sha256_lines(group["vision"]) == "304b313fd7e9db1d483d508c632f5eaaa2e7e8e2a09be8ba55a948bcb5390bfd"


def test_vision_exp_tower_is_shard_ones_header(vision_exp):
    # shard1_header_manifest.json: the 267 vision tensors' name, dtype and shape, and their bytes
    tower = sorted((t for t in vision_exp.tensors if t.name.startswith(("vision.", "aligner.", "image_"))),
                   key=lambda t: t.name)
    records = [f"{t.name}\t{t.dtype}\t{','.join(map(str, t.shape))}" for t in tower]
    assert _sha256_lines(records) == "7a48e394c0c69371e030512c5c8569d184595ce58fcb98a46497e97103655570"
    assert sum(t.nbytes for t in tower) == 932_786_176
    embed = next(t for t in vision_exp.tensors if t.name == "embed.weight")
    # shard 1 holds the tower and embed.weight: 8-byte length + 28,328-byte header + payload
    assert 8 + 28_328 + embed.nbytes + sum(t.nbytes for t in tower) == 1_991_876_272


def test_vision_exp_is_v4_flash_plus_the_tower_and_the_vision_routing_biases(vision_exp):
    flash = {t.name: t for t in published.published_facts().tensors}
    extra = {t.name: t for t in vision_exp.tensors if t.name not in flash}
    biases = {n: t for n, t in extra.items() if ".ffn.gate." in n}
    # bias_vl on the 43 layers and the 3 draft stages, the routing bias on the 3 hash layers too
    assert sorted(n.rsplit(".", 1)[1] for n in biases) == ["bias"] * 3 + ["bias_vl"] * 46
    assert {(t.dtype, t.shape) for t in biases.values()} == {("F32", (256,))}
    assert all(flash[t.name] == t for t in vision_exp.tensors if t.name in flash)
    assert len(extra) - len(biases) == 267


def test_vision_exp_fields_are_the_published_ones_over_flashs_config():
    fields, flash, cfg = published.vision_exp_fields(), published.config(), published.vision_exp_config()
    assert cfg == {**flash, **fields} and fields["vision_n_layers"] == 32
    # what the fields share with V4-Flash's config agrees, but the draft stages' count, which
    # the text checkpoint gives as 1 and Vision-Exp as 3 (the plan reads neither)
    assert {k for k in fields if k in flash and flash[k] != fields[k]} == {"num_nextn_predict_layers"}


# ---------------------------------------------------------------- V4.1: the description


def test_v41_reproduces_its_published_index(v41):
    # the model receipt of revision df42c109; ISEEKYAN/Megatron-LM's key contract (96,085 keys,
    # 2,401 of them under mtp.)
    assert len(v41.tensors) == 96_085 == published.CHECKPOINTS[published.V41].tensor_count
    assert v41.weight_bytes == 510_286_023_000
    assert sum(t.name.startswith("mtp.") for t in v41.tensors) == 2_401
    assert len({t.name for t in v41.tensors}) == 96_085


def test_v41_engram_layers_are_the_receipts_two_last_shards(v41):
    # shards 47 and 48: 101,535,150,272 and 101,537,925,968 bytes, each one Engram layer's tensors
    for layer, shard in ((1, 101_535_150_272), (14, 101_537_925_968)):
        own = [t for t in v41.tensors if t.name.startswith(f"layers.{layer}.engram.")]
        assert len(own) == 6 and sum(t.nbytes for t in own) == shard
    table = next(t for t in v41.tensors if t.name == "layers.1.engram.embed.weight")
    assert (table.dtype, table.shape) == ("F8_E4M3", (384_006_168, 256))


def test_v41_engram_heads_tile_the_tables_and_split_by_heads():
    cfg = v41_config()
    heads = engram_head_rows(cfg)
    assert [len(h) for h in heads] == [24, 24]
    assert [sum(h) for h in heads] == cfg["engram_num_embeddings"] == [384_006_168, 384_016_682]
    for tp in (2, 4, 8):
        fullest = engram_rows_per_rank(cfg, tp)
        average = [math.ceil(n / tp) for n in cfg["engram_num_embeddings"]]
        # the fullest rank holds a few thousand rows more than the even split dspark's rule counts
        assert all(0 <= f - a < 10_000 for f, a in zip(fullest, average, strict=True))


def test_v41_config_is_flattened_as_vllm_reads_it():
    nested, flat = checkpoint_config(), v41_config()
    assert set(nested) >= {"text_config", "vision_config", "quantization_config"}
    assert flat["hidden_size"] == 5120 and flat["vision_dim"] == 1024 and flat["vision_n_layers"] == 32
    assert flat["vision_max_n_token"] == 1024 and flat["expert_dtype"] == "fp4"
    assert flat["model_type"] == "deepseek_v41" and "text_config" not in flat


def test_the_rank_split_differs_from_vllms_by_under_a_hundredth_of_a_gib(vision_exp, v41):
    # dspark's DeepSeek V4 rule counts the tower's small replicated tensors as split (published.py)
    for facts in (vision_exp, v41):
        whole = sum(t.nbytes for t in facts.tensors
                    if t.name.startswith(("vision.", "aligner.", "image_")) and replicated_by_vllm(t.name))
        # patch embedding, the 65 norms, 32 wo biases, aligner.w2's bias and the image vectors
        assert whole == 1_445_888 and whole / GiB < 0.01


# ---------------------------------------------------------------- the verdicts


def test_vision_exp_fits_two_nodes():
    plan = published.plan_published(model=published.VISION_EXP, nodes=2)
    assert plan.fits and plan.inputs.tensor_parallel_size == 2
    assert round(plan.weight_bytes / GiB, 2) == 156.29
    assert round(plan.weight_bytes_per_rank / GiB, 2) == 78.86
    assert plan.kv_cache_bytes > 0 and plan.kv_tokens > 0
    assert plan.inputs.kv_cache_dtype == "fp8_ds_mla"  # planned on v0.32.0, the line that serves it
    assert any("planned on the v0.32.0 line" in n for n in plan.notes)
    assert any("vision tower and aligner (0.87 GiB, 267 tensors)" in n for n in plan.notes)


@pytest.mark.parametrize("nodes, per_rank", [(2, 238.10), (4, 119.52)])
def test_v41_fits_neither_two_nor_four_nodes_and_says_it_needs_eight(nodes, per_rank):
    plan = published.plan_published(model=published.V41, nodes=nodes)
    assert not plan.fits
    assert round(plan.plan.weight_bytes / GiB, 2) == 475.24
    assert round(plan.plan.weight_bytes_per_rank / GiB, 2) == per_rank
    assert plan.problems[0].startswith(f"DeepSeek-V4.1-Flash: 475.24 GiB of weights, {per_rank:.2f} GiB a rank on "
                                       f"{nodes} nodes")
    assert "needs 8 nodes" in plan.problems[0] and "--nodes 8" in plan.problems[0]
    assert any("Engram tables (188.83 GiB with their scales)" in n for n in plan.notes)
    assert any("KV-cache layout is not modelled" in n for n in plan.notes)


def test_v41_fits_eight_nodes_with_its_kv_tokens_unsaid():
    plan = published.plan_published(model=published.V41, nodes=8)
    assert plan.fits and not plan.problems
    assert round(plan.plan.weight_bytes_per_rank / GiB, 2) == 60.24
    d = plan.to_dict()
    assert d["fits"] is True and d["kv_layout_modelled"] is False
    assert d["kv_tokens"] is None and d["kv_bytes_per_token"] is None and d["kv_caches"] is None
    assert d["kv_cache_bytes"] == plan.plan.kv_cache_bytes > 0
    text = plan.render_text()
    assert "KV tokens" not in text and "its tokens, not modelled" in text


def test_v41_weights_per_rank_are_dsparks_rule_over_its_tensors(v41):
    plan = published.plan_published(model=published.V41, nodes=4)
    split = split_weights(v41, plan.inputs.num_speculative_tokens > 0)
    assert plan.plan.weight_bytes_per_rank == split.per_rank(4, 1)


# ---------------------------------------------------------------- the command line


def test_cli_plans_each_published_model(tmp_path):
    r = invoke_dspark("plan", "--published", "--model", "deepseek-v4-flash-vision-exp", env=NO_CONFIG, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "published:deepseek-v4-flash-vision-exp" in r.stdout and "fits                      yes" in r.stdout
    for nodes in ("2", "4"):
        r = invoke_dspark("plan", "--published", "--model", "deepseek-v4.1-flash", "--nodes", nodes,
                          env=NO_CONFIG, cwd=tmp_path)
        assert r.returncode == 1, r.stderr
        assert f"TP={nodes} PP=1" in r.stdout and "fits                      NO" in r.stdout
        assert "problem: DeepSeek-V4.1-Flash: 475.24 GiB of weights" in r.stdout and "needs 8 nodes" in r.stdout
    r = invoke_dspark("plan", "--published", "--model", "deepseek-v4.1-flash", "--nodes", "8", "--json",
                      env=NO_CONFIG, cwd=tmp_path)
    assert r.returncode == 0 and json.loads(r.stdout)["tensor_parallel_size"] == 8


def test_cli_default_is_still_v4_flash(tmp_path):
    plain = invoke_dspark("plan", "--published", "--json", env=NO_CONFIG, cwd=tmp_path)
    named = invoke_dspark("plan", "--published", "--model", "deepseek-v4-flash", "--json", env=NO_CONFIG, cwd=tmp_path)
    assert plain.returncode == named.returncode == 0 and plain.stdout == named.stdout
    assert json.loads(plain.stdout)["model_dir"] == "published:deepseek-v4-flash"


def test_cli_refuses_a_bad_model_or_nodes_without_a_traceback(tmp_path):
    r = invoke_dspark("plan", "--published", "--model", "deepseek-v9", env=NO_CONFIG, cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "no published checkpoint 'deepseek-v9': one of " + ", ".join(published.CHECKPOINTS) in r.stderr
    for args in (("--model", "deepseek-v4.1-flash"), ("--nodes", "4")):
        r = invoke_dspark("plan", *args, env=NO_CONFIG, cwd=tmp_path)
        assert r.returncode == 2 and "--model and --nodes go with --published" in r.stderr
    r = invoke_dspark("plan", "--published", "--nodes", "0", env=NO_CONFIG, cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_cli_help_names_every_published_model():
    text = " ".join(invoke_dspark("plan", "--help").stdout.split())
    for name in published.CHECKPOINTS:
        assert name in text


def test_a_cluster_file_on_a_line_without_the_model_is_planned_on_one_with_it(tmp_path):
    cluster = tmp_path / "c.toml"
    cluster.write_text('[model]\npath = "/nowhere"\n[serving]\nruntime_line = "v0.28.0"\n'
                       '[[nodes]]\nname = "a"\nrank = 0\naddress = "10.0.0.1"\n'
                       '[[nodes]]\nname = "b"\nrank = 1\naddress = "10.0.0.2"\n')
    r = invoke_dspark("plan", "--published", "--model", "deepseek-v4-flash-vision-exp", "--config", str(cluster))
    assert r.returncode == 0, r.stderr
    assert "note: planned on the v0.32.0 line: the cluster file's v0.28.0 cannot serve" in r.stdout


def test_docs_show_what_the_v41_plan_prints(tmp_path):
    import re

    from tests.harness.docs_text import docs_text

    block = re.search(r"```\n\$ dspark plan --published --model deepseek-v4.1-flash --nodes 4\n(.*?)```",
                      docs_text(), re.S)
    assert block, "docs/: no '$ dspark plan --published --model deepseek-v4.1-flash --nodes 4' block"
    r = invoke_dspark("plan", "--published", "--model", "deepseek-v4.1-flash", "--nodes", "4", env=NO_CONFIG,
                      cwd=tmp_path)
    assert block.group(1).rstrip("\n") == r.stdout.rstrip("\n")
