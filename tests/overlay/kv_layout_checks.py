"""DeepSeek V4's KV layout and sparse indices through vLLM's own code, checked
against what FlashInfer's SM120 sparse-MLA path dispatches.

Run in a subprocess whose PYTHONPATH puts a (patched or stock) vLLM 0.28.0
tree first (or a runtime line's: 0.29.0, 0.32.0, in that line's Python):
``python kv_layout_checks.py SITE [DTYPE,...] [MAX_MODEL_LEN,...]``. It prints one JSON
object, case name -> "ok" or the failure's text. FlashInfer's facts are those of the
flashinfer-python the tree's runtime line pins (_load_flashinfer: 0.6.18 for 0.28.0,
0.7.0.post1 for 0.32.0), or of the sources $DSPARK_FLASHINFER_SRC names.

For each max_model_len (4,096, 131,072, 350,000, 1,048,576) it builds a real
VllmConfig from tests/fixtures/deepseek-v4-flash-config.json (TP=2's 32 query
heads per rank, the template's 12 sequences, 8,192 batched tokens, block 256,
the cache dtype under test), simulates the SM12x capability family, and then
runs vLLM's own code: the DeepSeek V4 cache layers of every target layer and
of DSpark's three draft layers produce their KV-cache specs; vLLM groups them,
unifies them and plans the packed per-block layout (get_kv_cache_configs); its
model runner creates the metadata builders (init_attn_backend) and allocates
and reshapes the caches (init_kv_cache). The SM120 attention class's own
_forward_decode / _forward_prefill are then called with index tensors of the
widths the builders allocated (only the Triton index builders, which cannot
run on a CPU, are replaced by row-preserving stand-ins), and the FlashInfer
entry point is replaced by a recorder that refuses every call the locked
FlashInfer would refuse (flashinfer_facts.py, read from its sources). The
SM120 class's own start-up check runs too, with DSpark's non-causal width.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent

from tests.overlay import flashinfer_facts  # noqa: E402

FIXTURE = HERE.parents[0] / "fixtures" / "deepseek-v4-flash-config.json"
MAX_MODEL_LENS = (4096, 131072, 350000, 1048576)
HEADS_PER_RANK = 32  # 64 heads at TP=2
MAX_NUM_SEQS = 12
MAX_BATCHED = 8192
BLOCK_SIZE = 256
NUM_SPEC = 5  # DSpark k=5 (the template)
NUM_BLOCKS = 6  # small on purpose: the layout, not the capacity, is checked
# A flashinfer package directory (unpacked sources) that replaces the one pinned for the tree's line.
FLASHINFER_SRC_ENV = "DSPARK_FLASHINFER_SRC"


# --------------------------------------------------------------------------
# The FlashInfer the checks hold the tree to: the one its runtime line pins
# --------------------------------------------------------------------------


def _load_flashinfer():
    """The SM120 dispatch of the FlashInfer pinned for the vLLM under test: the runtime line of
    src/dspark/data/runtime_lines.toml whose `vllm` is the tree's release names a lock, whose
    flashinfer-python is read from .venv/pinned/flashinfer-python-VERSION/flashinfer (where
    .ci/setup unpacks the default line's), or from the directory $DSPARK_FLASHINFER_SRC names.
    The default line (vLLM 0.28.0, FlashInfer 0.6.18) and a release no line names read
    flashinfer_facts' own pinned copy, as before."""
    import tomllib

    import vllm

    root = os.environ.get(FLASHINFER_SRC_ENV)
    if root is None:
        repo = HERE.parents[1]
        lines = tomllib.loads((repo / "src" / "dspark" / "data" / "runtime_lines.toml").read_text())
        release = vllm.__version__.split("+")[0]
        line = next((line for line in lines["lines"].values() if line["vllm"] == release), None)
        if line is None:
            return flashinfer_facts.load()
        lock = json.loads((repo / line["lock"]).read_text())
        version = next(p["version"] for p in lock["packages"] if p["name"] == "flashinfer-python")
        root = repo / ".venv" / "pinned" / f"flashinfer-python-{version}" / "flashinfer"
        if root == flashinfer_facts.pinned_dir():
            return flashinfer_facts.load()
        if not root.is_dir():
            raise FileNotFoundError(
                f"{root} is missing: unpack flashinfer-python {version} ({line['lock']}) there "
                f"or name its flashinfer/ directory in ${FLASHINFER_SRC_ENV}")
    root = Path(root)
    if (root / "mla" / "_sparse_mla_sm120_plan.py").is_file():
        return PlannedSm120(root)
    return flashinfer_facts.load(root)


class PlannedSm120:
    """FlashInfer 0.7's SM120 sparse-MLA dispatch (0.7.0.post1 is vLLM 0.32.0's line's pin), which
    flashinfer_facts.load (0.6.x: a (heads, top-k) table in mla/_sparse_mla_sm120.py) cannot read:
    0.7 moved the dispatch into mla/_sparse_mla_sm120_plan.py, "the single dispatch authority",
    whose envelopes are plain Python. Its constants, the decode envelope class and the envelope
    functions are run from the pinned source itself (nothing of FlashInfer is imported: the
    module needs a GPU); the C++ prefill dispatcher's extra-page sizes and the DSv4 page layout
    are read as flashinfer_facts reads them. The attributes are those of
    flashinfer_facts.SparseMlaSm120 that the checks use."""

    ENVELOPE = ("_DecodeDispatchEnvelope", "KernelVariant", "_prefill_topk_ok",
                "decode_splitk_eligible", "prefill_swapab_eligible", "prefill_sg_eligible",
                "prefill_mg_eligible", "prefill_mg_dual_eligible", "_check_swapab_eligible",
                "prefill_variant")

    def __init__(self, root: Path):
        import __future__

        import ast
        import enum
        import typing

        path = root / "mla" / "_sparse_mla_sm120_plan.py"
        tree = ast.parse(path.read_text())
        ns: dict = {"enum": enum, "Optional": typing.Optional}
        for node in tree.body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name in self.ENVELOPE:
                pass
            elif not (isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets)):
                continue
            code = compile(ast.Module([node], []), str(path), "exec",
                           flags=__future__.annotations.compiler_flag, dont_inherit=True)
            try:
                exec(code, ns)  # noqa: S102 - the pinned FlashInfer's own envelope code
            except NameError:  # an assignment from the module's imports (logger, the memo caches)
                continue
        missing = [n for n in (*self.ENVELOPE, "_DECODE_DSV4_DISPATCH", "_DECODE_MAX_TOKENS",
                               "_PAGE_BLOCK_SIZE", "_BPT_DSV4", "_MODEL_TYPE_DSV4",
                               "_PREFILL_IMPL_AUTO") if n not in ns]
        if missing:
            raise AssertionError(f"{path}: no {missing}")
        self.ns = ns
        self.version = str(root)
        self.decode_max_tokens = int(ns["_DECODE_MAX_TOKENS"])
        self.decode_dispatch = ns["_DECODE_DSV4_DISPATCH"]  # what vLLM probes (utils/flashinfer.py)
        self.decode_page_tokens = int(ns["_PAGE_BLOCK_SIZE"])
        self.bytes_per_token = int(ns["_BPT_DSV4"])
        prefill = (root / "data" / "csrc" / "sparse_mla_sm120_prefill.cu").read_text()
        dual = flashinfer_facts._function_body(prefill, "dispatch_dsv4_dual")
        self.prefill_dual_extra_page_tokens = flashinfer_facts._ints(
            r"extra_page_block_size == (\d+)", dual, "dual extra page size")
        self.io_stride = flashinfer_facts.dsv4_io_stride(root, self.bytes_per_token)
        self.decode_signature = flashinfer_facts.signature_from_source(
            root / "mla" / "_core.py", "trtllm_batch_decode_sparse_mla_dsv4")

    def refusal(self, *, tokens: int, heads: int, topk: int, page_tokens: int,
                extra_topk: int | None, extra_page_tokens: int | None) -> str | None:
        """Why FlashInfer would refuse this call, or None. Its planner (plan/_decide) takes the
        decode kernel for a decode-eligible call and the prefill variant otherwise; with a
        calibrated crossover a decode-eligible call that has a prefill variant may take the
        prefill too, which the C++ dispatcher then re-checks (dual-cache extra pages)."""
        ns = self.ns
        where = (f"tokens={tokens} heads={heads} topk={topk} pages={page_tokens} "
                 f"extra_topk={extra_topk} extra_pages={extra_page_tokens}")
        mt, has_extra = ns["_MODEL_TYPE_DSV4"], extra_topk is not None
        decode = ns["decode_splitk_eligible"](mt, heads, topk, page_tokens, has_extra, tokens)
        variant = ns["prefill_variant"](mt, heads, topk, page_tokens, has_extra,
                                        ns["_PREFILL_IMPL_AUTO"])
        if not decode and variant is None:
            return f"no SM120 decode or prefill kernel serves it: {where}"
        if (variant is not None and has_extra
                and extra_page_tokens not in self.prefill_dual_extra_page_tokens):
            return (f"dual-cache prefill extra pages not in {self.prefill_dual_extra_page_tokens}"
                    f"{' (a calibrated crossover may route it there)' if decode else ''}: {where}")
        return None


def _simulate_sm12x() -> None:
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    cls = type(current_platform)
    cls.is_device_capability_family = staticmethod(lambda family: family == 120)
    cls.get_device_capability = classmethod(lambda c, device_id=0: DeviceCapability(12, 1))


def _gb10_runs_v2_model_runner() -> bool:
    """vLLM 0.32.0 runs Model Runner V2 on GB10 (config/vllm.py VllmConfig.use_v2_model_runner:
    the default wherever Triton is; this CPU build falls back to V1 only for want of it), and
    its builders' decode threshold follows the runner (v1/attention/backend.py
    max_decode_query_len: 1 + k on V2, 1 + 2k on V1 with parallel drafting). vLLM 0.28.0 and
    0.29.0 have no such rule: their runs are left as they are."""
    from vllm.v1.attention import backend

    return hasattr(backend, "max_decode_query_len")


def _config(model_dir: str, cache_dtype: str, max_model_len: int):
    from vllm.config import (
        CacheConfig,
        ModelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )

    model = ModelConfig(model=model_dir, max_model_len=max_model_len,
                        skip_tokenizer_init=True, dtype="bfloat16")
    cache = CacheConfig(cache_dtype=cache_dtype, block_size=BLOCK_SIZE,
                        num_gpu_blocks_override=NUM_BLOCKS)
    sched = SchedulerConfig(max_num_batched_tokens=MAX_BATCHED, max_num_seqs=MAX_NUM_SEQS,
                            max_model_len=max_model_len, is_encoder_decoder=False)
    v2 = _gb10_runs_v2_model_runner()
    if v2:  # VllmConfig.__post_init__ refuses V2 without Triton (_validate_v2_model_runner)
        os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    vc = VllmConfig(model_config=model, cache_config=cache, scheduler_config=sched)
    if v2:  # then V2 as on GB10: use_v2_model_runner reads the variable at each call
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        assert vc.use_v2_model_runner, "Model Runner V2 is not in effect"
    # The CPU platform rewrites the block size for its own kernels; on the GB10
    # nodes --block-size 256 stands (the DSv4 backends take only 256).
    vc.cache_config.block_size = BLOCK_SIZE
    vc.scheduler_config.max_num_batched_tokens = MAX_BATCHED
    # DSpark k=5 as the template runs it: the SpeculativeConfig vLLM builds for
    # --speculative-config (the draft ships inside the target checkpoint).
    vc.speculative_config = SpeculativeConfig(
        method="dspark", num_speculative_tokens=NUM_SPEC, target_model_config=model,
        target_parallel_config=vc.parallel_config, draft_sample_method="probabilistic")
    return vc


def _resolve_kv_cache_layout(vc, specs) -> None:
    """vLLM 0.29.0 resolves one KV-cache layout in its engine core, from the layouts the
    worker's attention backends support, before it plans the caches (EngineCore's
    resolve_kv_cache_layout); vLLM 0.28.0 has no such step."""
    try:
        from vllm.v1.attention.backends.utils import (
            get_supported_kv_cache_layouts,
            resolve_kv_cache_layout,
        )
    except ImportError:
        return
    from vllm.v1.worker import worker_base

    backends = worker_base.get_current_attn_backends(vc)
    names = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
    resolve_kv_cache_layout(vc, [names], list(specs.values()))


class Layers:
    """The DeepSeek V4 cache layers of one rank, built by their own classes."""

    def __init__(self, vc):
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.models.deepseek_v4 import attention as attn_mod
        from vllm.models.deepseek_v4.compressor import CompressorStateCache
        from vllm.models.deepseek_v4.nvidia.flashinfer_sparse import (
            DeepseekV4FlashInferSM120Attention as A,
        )
        from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache

        hf = vc.model_config.hf_config
        self.vc = vc
        self.attn: dict[str, A] = {}
        ctx = vc.compilation_config.static_forward_context
        n = len(hf.compress_ratios)  # the target's layers, then DSpark's draft layers
        self.topk_indices_buffer = torch.full(
            (MAX_BATCHED, hf.index_topk), -1, dtype=torch.int32)
        with set_current_vllm_config(vc):
            for i in range(n):
                prefix = f"model.layers.{i}.attn"
                layer = object.__new__(A)
                torch.nn.Module.__init__(layer)
                layer.prefix = prefix
                layer.layer_id = i
                layer.compress_ratio = max(1, hf.compress_ratios[i])
                layer.head_dim = hf.head_dim
                layer.window_size = hf.sliding_window
                layer.n_local_heads = HEADS_PER_RANK
                layer.padded_heads = A.get_padded_num_q_heads(HEADS_PER_RANK)
                layer.scale = hf.head_dim ** -0.5
                layer.attn_sink = torch.zeros(layer.padded_heads, dtype=torch.float32)
                layer.eager_scratch_pool = None
                layer.topk_indices_buffer = self.topk_indices_buffer
                layer.kv_cache_dtype, layer.kv_cache_torch_dtype = (
                    attn_mod._resolve_dsv4_kv_cache_dtype(
                        A.use_fp8_ds_mla_layout, vc.cache_config.cache_dtype,
                        vc.cache_config))
                layer.kv_cache = torch.tensor([])
                layer.swa_cache_layer = DeepseekV4SWACache(
                    head_dim=hf.head_dim, window_size=hf.sliding_window,
                    dtype=layer.kv_cache_torch_dtype, prefix=f"{prefix}.swa_cache",
                    cache_config=vc.cache_config, backend_cls=A.swa_backend_cls)
                ctx[prefix] = layer
                self.attn[prefix] = layer
                ratio = layer.compress_ratio
                if ratio > 1:
                    coff = 1 + (ratio == 4)
                    CompressorStateCache(
                        state_dim=2 * coff * hf.head_dim, dtype=torch.float32,
                        compress_ratio=ratio, prefix=f"{prefix}.compressor.state_cache")
                if ratio == 4:
                    quant_block = 128
                    attn_mod.DeepseekV4IndexerCache(
                        head_dim=hf.index_head_dim + hf.index_head_dim // quant_block * 4,
                        dtype=torch.uint8, prefix=f"{prefix}.indexer.k_cache",
                        cache_config=vc.cache_config, compress_ratio=ratio)
                    CompressorStateCache(
                        state_dim=2 * 2 * hf.index_head_dim, dtype=torch.float32,
                        compress_ratio=ratio,
                        prefix=f"{prefix}.indexer.compressor.state_cache")

    def plan(self):
        """vLLM's own spec collection, grouping, packing, builders, allocation."""
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.v1.core.kv_cache_utils import (
            get_kv_cache_config_from_groups,
            get_kv_cache_groups,
        )
        from vllm.v1.worker.gpu import attn_utils

        vc = self.vc
        specs = attn_utils.get_kv_cache_spec(vc)
        _resolve_kv_cache_layout(vc, specs)
        # get_kv_cache_configs minus its admission check (the whole model's KV
        # at full length does not fit a test machine): the same grouping and
        # packed planning, clamped to NUM_BLOCKS blocks by the override.
        groups = get_kv_cache_groups(vc, specs)
        config = get_kv_cache_config_from_groups(vc, groups, 1 << 40)
        with set_current_vllm_config(vc):
            groups, _, kernel_block_sizes = attn_utils.init_attn_backend(
                config, vc, torch.device("cpu"))
            ctx = vc.compilation_config.static_forward_context
            params = list(inspect.signature(attn_utils.init_kv_cache).parameters)
            if params[0] == "forward_context":
                # 0.32.0 (v1/worker/gpu/attn_utils.py init_kv_cache, as GPUModelRunner.
                # initialize_kv_cache calls it): no runner list; the attention groups come
                # by keyword so their builders' kernel-block views are mapped.
                caches = attn_utils.init_kv_cache(
                    ctx, config, torch.device("cpu"), kernel_block_sizes, vc,
                    attn_groups=[g for gs in groups for g in gs])
            elif "attn_groups" in params:  # 0.28.0
                caches = attn_utils.init_kv_cache(
                    [], ctx, config, groups, torch.device("cpu"), vc.cache_config.cache_dtype,
                    kernel_block_sizes, vc)
            else:  # 0.29.0: the caches are shaped from their specs in the resolved layout
                caches = attn_utils.init_kv_cache([], ctx, config, torch.device("cpu"),
                                                  kernel_block_sizes, vc)
        self.specs, self.config, self.groups, self.caches = specs, config, groups, caches
        self.kernel_block_sizes = kernel_block_sizes
        self.builders = {
            name: group.get_metadata_builder(0)
            for gs in groups for group in gs for name in group.layer_names
        }
        return self


# --------------------------------------------------------------------------
# Checks of the layout
# --------------------------------------------------------------------------


def _page_placement(config) -> dict[str, tuple[int, int | None]]:
    """Each layer's page of block 0 (its byte offset in the allocation) and the tensor's block
    stride where vLLM states it: 0.28.0's KVCacheTensor is shared_by layers at one offset (the
    block stride is the cache's stride(0)); 0.29.0's holds its layers at offset + l *
    layer_stride, block b at + b * block_stride."""
    placed: dict[str, tuple[int, int | None]] = {}
    for t in config.kv_cache_tensors:
        if hasattr(t, "shared_by"):
            placed.update({n: (t.offset, None) for n in t.shared_by})
        else:
            placed.update({n: (t.offset + i * t.layer_stride, t.block_stride) for i, n in enumerate(t.layers)})
    return placed


def check_pages_and_strides(layers: Layers, fi) -> list[str]:
    """Every cache FlashInfer reads: the page geometry its kernels take."""
    problems = []
    offsets = {n: offset for n, (offset, _) in _page_placement(layers.config).items()}
    for prefix, layer in layers.attn.items():
        reads = {"swa": (layer.swa_cache_layer.kv_cache, 64)}
        if layer.compress_ratio > 1:
            reads["compressed"] = (layer.kv_cache, BLOCK_SIZE // layer.compress_ratio)
        for what, (cache, index_page_tokens) in reads.items():
            where = f"{prefix} {what} cache {tuple(cache.shape)} strides {cache.stride()}"
            paged = layer._as_sparse_cache(cache)
            if hasattr(layer, "_sparse_cache"):
                paged = layer._sparse_cache(cache)
            if paged.data_ptr() != cache.data_ptr():
                problems.append(f"{where}: the view handed to FlashInfer moved")
            if paged.dim() != 4 or paged.shape[2] != 1 or paged.shape[-1] != fi.bytes_per_token:
                problems.append(f"{where}: not NHD [pages, tokens, 1, {fi.bytes_per_token}]")
                continue
            pbs = paged.shape[1]
            # The index builders address slots as block * page_tokens + offset.
            if pbs != index_page_tokens:
                problems.append(f"{where}: {pbs}-token pages, indices use {index_page_tokens}")
            if paged.stride(-1) != 1 or paged.stride(1) != fi.bytes_per_token:
                problems.append(f"{where}: tokens are not packed {fi.bytes_per_token}-byte rows")
            if paged.stride(0) < pbs * fi.bytes_per_token:
                problems.append(f"{where}: block stride below one page")
            # Byte offset of this layer's page inside vLLM's packed block.
            owner = layer.swa_cache_layer.prefix if what == "swa" else prefix
            offset = offsets[owner]
            for name, value in (("block stride", paged.stride(0)), ("page offset", offset)):
                if value % flashinfer_facts.BULK_COPY_ALIGNMENT:
                    problems.append(
                        f"{where}: {name} {value} B is not a multiple of "
                        f"{flashinfer_facts.BULK_COPY_ALIGNMENT} (cp.async.bulk)")
    return problems


def check_group_pages_disjoint(layers: Layers) -> list[str]:
    """Within a KV-cache group, two layers' pages of one block never overlap (where vLLM
    states each tensor's block stride, 0.29.0: no two pages of any blocks)."""
    problems = []
    placed = _page_placement(layers.config)
    for group in layers.config.kv_cache_groups:
        spans = []
        for name in group.layer_names:
            offset, block_stride = placed[name]
            page = layers.specs[name].page_size_bytes
            for b in range(NUM_BLOCKS if block_stride is not None else 1):
                start = offset + b * (block_stride or 0)
                spans.append((start, start + page, f"{name} block {b}"))
        spans.sort()
        for (a0, a1, an), (b0, b1, bn) in zip(spans, spans[1:], strict=False):
            if b0 < a1:
                problems.append(f"{an} [{a0},{a1}) overlaps {bn} [{b0},{b1})")
    return problems


# --------------------------------------------------------------------------
# Sparse-index widths through the SM120 attention class
# --------------------------------------------------------------------------


class Recorder:
    """Stands in for flashinfer.decode.trtllm_batch_decode_sparse_mla_dsv4 on
    SM120: checks every argument as FlashInfer's SM120 path does and records
    what would have been dispatched."""

    def __init__(self, fi):
        self.fi = fi
        self.calls: list[dict] = []
        self.refusals: list[str] = []
        self.path: str | None = None  # the SM120 class's method that launched ("decode", "prefill")
        self.paths: list[str | None] = []

    def __call__(self, *args, **kwargs):
        # The call must bind to FlashInfer's own signature (read from its source).
        try:
            bound = self.fi.decode_signature.bind(*args, **kwargs)
        except TypeError as e:
            self.refusals.append(f"does not bind to trtllm_batch_decode_sparse_mla_dsv4: {e}")
            return kwargs.get("out")
        bound.apply_defaults()
        return self._check(**bound.arguments)

    def _check(self, *, query, swa_kv_cache, workspace_buffer, sparse_indices,
               compressed_kv_cache=None, out=None, bmm1_scale=1.0, sinks=None,
               kv_layout="HND", swa_topk_lens=None, extra_sparse_indices=None,
               extra_sparse_topk_lens=None, **unused):
        import torch

        def dense(idx, name):
            rows = idx.reshape(-1, idx.shape[-1])
            if idx.dtype != torch.int32 or idx.stride(-1) != 1 or (
                    rows.shape[0] > 1 and idx.stride(0) != idx.shape[-1]):
                self.refusals.append(f"{name} {tuple(idx.shape)} {idx.stride()} {idx.dtype}")

        assert query.dim() == 3 and query.dtype == torch.bfloat16, query.shape
        assert kv_layout == "NHD" and swa_topk_lens is not None
        tokens, heads = query.shape[0], query.shape[1]
        assert sparse_indices.shape[0] == tokens, (sparse_indices.shape, tokens)
        dense(sparse_indices, "sparse_indices")
        extra_topk = extra_pages = None
        if extra_sparse_indices is not None:
            assert extra_sparse_indices.shape[0] == tokens
            dense(extra_sparse_indices, "extra_sparse_indices")
            extra_topk = extra_sparse_indices.shape[-1]
            extra_pages = compressed_kv_cache.shape[1]
        call = dict(tokens=tokens, heads=heads, topk=sparse_indices.shape[-1],
                    page_tokens=swa_kv_cache.shape[1], extra_topk=extra_topk,
                    extra_page_tokens=extra_pages)
        self.calls.append(call)
        self.paths.append(self.path)
        why = self.fi.refusal(**call)
        if why:
            self.refusals.append(why)
        return out


def _swa_metadata(layers: Layers, layer, *, decodes: int, q_len: int,
                  prefill_lens: tuple[int, ...], causal: bool):
    """What DeepseekSparseSWAMetadataBuilder.build hands the layer: slices of
    the builder's own index buffers (their widths are what is checked)."""
    import torch

    builder = layers.builders[layer.swa_cache_layer.prefix]
    n_dec = decodes * q_len
    n_pre = sum(prefill_lens)
    buf = builder.decode_swa_indices
    if not causal:
        width = builder.noncausal_index_width
        buf = torch.full((builder._max_tokens, 1, width), -1, dtype=torch.int32)
    qsl = [0]
    for _ in range(decodes):
        qsl.append(qsl[-1] + q_len)
    for n in prefill_lens:
        qsl.append(qsl[-1] + n)
    # The builder's bound on decode rows per request: the batch's longest
    # query, clamped to its decode threshold.
    max_decode_q = min(max([q_len] * bool(decodes) + list(prefill_lens)),
                       builder.decode_threshold)
    return SimpleNamespace(
        num_decodes=decodes, num_prefills=len(prefill_lens),
        num_decode_tokens=n_dec, num_prefill_tokens=n_pre,
        max_decode_query_len=max_decode_q,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        decode_swa_indices=buf[:n_dec], decode_swa_lens=builder.decode_swa_lens[:n_dec],
        prefill_swa_indices=builder.prefill_swa_indices[:n_pre] if n_pre else None,
        prefill_swa_lens=builder.prefill_swa_lens[:n_pre] if n_pre else None,
        is_valid_token=builder.is_valid_token[: n_dec + n_pre],
        token_to_req_indices=builder.token_to_req_indices[: n_dec + n_pre],
        query_start_loc_cpu=torch.tensor(qsl, dtype=torch.int32),
        block_size=builder.block_size,
    )


def _mla_metadata(layers: Layers, layer, swa):
    """What DeepseekV4SparseMLAMetadataBuilder.build hands a compressed layer."""
    import torch

    if layer.compress_ratio <= 1:
        return None
    builder = layers.builders[layer.prefix]
    n_dec, n_pre = swa.num_decode_tokens, swa.num_prefill_tokens
    md = SimpleNamespace(block_size=builder.kv_cache_spec.block_size,
                         block_table=torch.zeros(swa.num_decodes + swa.num_prefills,
                                                 4, dtype=torch.int32), c128a_global_decode_topk_indices=None,
                         c128a_decode_topk_lens=None, c128a_prefill_topk_indices=None)
    if layer.compress_ratio == 128:
        if n_dec:
            md.c128a_global_decode_topk_indices = (
                builder.c128a_global_decode_buffer[:n_dec].view(n_dec, 1, -1))
            md.c128a_decode_topk_lens = builder.c128a_decode_lens_buffer[:n_dec]
        if n_pre:
            md.c128a_prefill_topk_indices = builder.c128a_prefill_buffer[:n_pre]
    return md


def _global_topk_stand_in(local, token_to_req, block_table, block_size, is_valid,
                          output_buffers=None):
    """compute_global_topk_indices_and_lens is a Triton kernel: same output
    shapes (one row of the input's width per token, int32) on CPU."""
    import torch

    return (torch.full(local.shape, -1, dtype=torch.int32),
            torch.zeros(local.shape[0], dtype=torch.int32))


SCENARIOS = (
    # name, decodes, q_len, prefill lengths, causal
    ("decode 1 seq, target verify (6 rows)", 1, 6, (), True),
    ("decode 2 seqs, target verify (12 rows)", 2, 6, (), True),
    ("decode 3 seqs, target verify (18 rows)", 3, 6, (), True),
    ("decode 5 seqs, target verify (30 rows)", 5, 6, (), True),
    ("decode 10 seqs, target verify (60 rows)", 10, 6, (), True),
    ("decode 12 seqs, target verify (72 rows)", 12, 6, (), True),
    # DSpark drafts sample from the anchor: k=5 query rows per request.
    ("decode 1 seq, DSpark draft (5 rows)", 1, 5, (), False),
    ("decode 2 seqs, DSpark draft (10 rows)", 2, 5, (), False),
    ("decode 5 seqs, DSpark draft (25 rows)", 5, 5, (), False),
    ("decode 12 seqs, DSpark draft (60 rows)", 12, 5, (), False),
    ("decode 13 seqs, DSpark draft (65 rows)", 13, 5, (), False),
    ("decode 1 seq, no speculation (1 row)", 1, 1, (), True),
    ("prefill 2 tokens", 0, 1, (2,), True),
    ("prefill 2 + 3 tokens (two requests, one chunk)", 0, 1, (2, 3), True),
    ("prefill 7 + 100 tokens (two requests, one chunk)", 0, 1, (7, 100), True),
    ("prefill 64 tokens", 0, 1, (64,), True),
    ("prefill 100 tokens", 0, 1, (100,), True),
    ("prefill 1,000 tokens beside one decode", 1, 6, (1000,), True),
)


def run_widths(layers: Layers, fi) -> tuple[list[str], list[dict]]:
    import torch
    from vllm.models.deepseek_v4.nvidia import flashinfer_sparse

    recorder = Recorder(fi)
    flashinfer_sparse.flashinfer_trtllm_batch_decode_sparse_mla_dsv4 = recorder
    flashinfer_sparse.compute_global_topk_indices_and_lens = _global_topk_stand_in
    A = flashinfer_sparse.DeepseekV4FlashInferSM120Attention
    A._get_workspace = staticmethod(lambda device: torch.empty(0, dtype=torch.uint8))
    errors = []
    rows: dict[str, set[int]] = {}
    hf = layers.vc.model_config.hf_config
    # One layer of each kind (SWA-only, C4A, C128A target layers; DSpark draft
    # layers): layers of a kind share their builders' index buffers.
    kinds = {}
    for layer in layers.attn.values():
        kinds.setdefault((layer.compress_ratio, layer.layer_id >= hf.num_hidden_layers), layer)
    for name, decodes, q_len, prefill_lens, causal in SCENARIOS:
        for (_, draft), layer in sorted(kinds.items()):
            if draft == causal:
                continue  # draft layers run the non-causal DSpark block only
            swa = _swa_metadata(layers, layer, decodes=decodes, q_len=q_len,
                                prefill_lens=prefill_lens, causal=causal)
            md = _mla_metadata(layers, layer, swa)
            tokens = swa.num_decode_tokens + swa.num_prefill_tokens
            q = torch.zeros(tokens, HEADS_PER_RANK, hf.head_dim, dtype=torch.bfloat16)
            out = torch.zeros(tokens, layer.padded_heads, hf.head_dim, dtype=torch.bfloat16)
            before = len(recorder.calls)
            try:
                layer._forward_sparse_impl(
                    q=q, output=out, flashmla_metadata=md, swa_metadata=swa,
                    self_kv_cache=layer.kv_cache if layer.compress_ratio > 1 else None,
                    swa_kv_cache=layer.swa_cache_layer.kv_cache,
                    swa_only=layer.compress_ratio <= 1)
            except Exception as e:  # noqa: BLE001 - reported as the case's result
                errors.append(f"{name}, ratio {layer.compress_ratio}: "
                              f"{type(e).__name__}: {e}")
            else:
                if len(recorder.calls) == before:
                    errors.append(f"{name}, ratio {layer.compress_ratio}: no FlashInfer call")
                rows.setdefault(name, set()).update(
                    c["tokens"] for c in recorder.calls[before:])
            for why in recorder.refusals:
                errors.append(f"{name}, ratio {layer.compress_ratio}: {why}")
            recorder.refusals.clear()
    return sorted(set(errors)), recorder.calls, {k: sorted(v) for k, v in rows.items()}


# --------------------------------------------------------------------------
# Short prompts through the builders' own decode/prefill split
# --------------------------------------------------------------------------

SHORT_PROMPTS = tuple(range(1, 13))
LONG_PROMPT = 1000
DECODE_CONTEXT = 300  # tokens a running request holds before this step
MIXES = ("alone", "+ 2 decodes", f"+ {LONG_PROMPT}-token prompt",
         f"+ 2 decodes + {LONG_PROMPT}-token prompt")
SPEC_CONFIGS = ("DSpark k=5", "no speculation")


class _Launched(Exception):
    """Stops a builder's build() right after its split (the rest needs CUDA)."""


def _no_launch(*args, **kwargs):
    return None


class _NoGrid:
    """A Triton kernel on CPU: launching it writes nothing (the index values are not
    checked here, only what vLLM's Python decides and the shapes it hands FlashInfer)."""

    def __getitem__(self, grid):
        return _no_launch


def _stand_in_metadata_kernels() -> None:
    """The builders' Triton launches (no Triton on this CPU build) replaced by no-ops; every
    line of the builders' Python, their splits included, runs as it is."""
    from vllm.models.deepseek_v4 import sparse_mla
    from vllm.v1.attention.backends.mla import compressor_utils, sparse_swa

    for module, names in ((sparse_swa, ("_compute_swa_indices_and_lens_kernel",
                                        "_compute_dspark_noncausal_swa_indices_kernel")),
                          (sparse_mla, ("_build_c128a_topk_metadata_kernel",)),
                          (compressor_utils, ("_compressed_slot_mapping_kernel",))):
        for name in names:
            if hasattr(module, name):
                setattr(module, name, _NoGrid())
    sparse_swa._COMPUTE_PREFILL_METADATA_KERNEL = _no_launch
    # vLLM 0.32.0 launches every one of these through a module-level kernel object (jit_warmup's
    # kernel_launcher): sparse_swa.py, sparse_mla.py and compressor_utils.py call the objects.
    for module, names in ((sparse_swa, ("_COMPUTE_SWA_INDICES_AND_LENS_KERNEL",
                                        "_COMPUTE_DSPARK_NONCAUSAL_SWA_INDICES_KERNEL")),
                          (sparse_mla, ("_BUILD_C128A_TOPK_METADATA_KERNEL",)),
                          (compressor_utils, ("_COMPRESSED_SLOT_MAPPING_KERNEL",))):
        for name in names:
            if hasattr(module, name):
                setattr(module, name, _no_launch)
    try:  # vLLM 0.32.0: CommonAttentionMetadata.token_to_req_indices (v1/attention/backend.py)
        # maps tokens to requests with a Triton kernel (v1/attention/ops/metadata.py).
        from vllm.v1.attention.ops import metadata as metadata_ops
    except ImportError:
        pass
    else:
        metadata_ops._token_request_mapping_kernel = _NoGrid()
    # vLLM 0.29.0's C128A builder sizes its window with triton.next_power_of_2, a host-side
    # helper the CPU build's Triton placeholder lacks: vLLM's own, the same rounding.
    if not hasattr(sparse_mla.triton, "next_power_of_2"):
        from vllm.utils.math_utils import next_power_of_2

        sparse_mla.triton.next_power_of_2 = next_power_of_2


def _batch(prompt: int, mix: str, spec: bool) -> list[tuple[int, int, bool]]:
    """One step's requests as (query tokens, seq_len after the step, prefilling), in the
    model runner's own batch order (vLLM's sort_batch_req_ids: verify/decode first)."""
    from vllm.v1.worker.gpu.model_runner import sort_batch_req_ids

    q_dec = 1 + NUM_SPEC if spec else 1
    reqs: dict[str, tuple[int, int, bool]] = {}
    drafts: dict[str, list[int]] = {}
    if "decodes" in mix:
        for i in range(2):
            reqs[f"decode {i}"] = (q_dec, DECODE_CONTEXT + q_dec, False)
            if spec:
                drafts[f"decode {i}"] = [0] * NUM_SPEC
    reqs["prompt"] = (prompt, prompt, True)
    if str(LONG_PROMPT) in mix:
        reqs["long prompt"] = (LONG_PROMPT, LONG_PROMPT, True)
    order = sort_batch_req_ids({r: v[0] for r, v in reqs.items()}, drafts, q_dec)
    return [reqs[r] for r in order]


def _common(reqs, *, causal=True, prefilling=True, pad_reqs=0, pad_tokens=0):
    """The CommonAttentionMetadata the model runner hands every builder for ``reqs``;
    ``prefilling=False`` leaves is_prefilling None (as DSpark's draft step builds it),
    ``pad_reqs``/``pad_tokens`` pad a FULL-graph batch (is_prefilling stays unpadded)."""
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata

    q = [r[0] for r in reqs] + [0] * pad_reqs
    seq = [r[1] for r in reqs] + [0] * pad_reqs
    qsl = [0]
    for n in q:
        qsl.append(qsl[-1] + n)
    tokens = qsl[-1] + pad_tokens
    positions = [p for n, s in zip(q, seq, strict=True) for p in range(s - n, s)] + [0] * pad_tokens
    qsl_t = torch.tensor(qsl, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl_t, query_start_loc_cpu=qsl_t.clone(),
        seq_lens=torch.tensor(seq, dtype=torch.int32), num_reqs=len(q),
        num_actual_tokens=tokens, max_query_len=max(q), max_seq_len=max(seq),
        block_table_tensor=torch.zeros(len(q), -(-max(seq) // BLOCK_SIZE), dtype=torch.int32),
        slot_mapping=torch.arange(tokens, dtype=torch.int64) % (NUM_BLOCKS * BLOCK_SIZE),
        causal=causal, positions=torch.tensor(positions, dtype=torch.int64),
        is_prefilling=(torch.tensor([r[2] for r in reqs], dtype=torch.bool)
                       if prefilling else None),
        seq_lens_cpu_upper_bound=torch.tensor(seq, dtype=torch.int32))


def _builders_without_speculation(layers: Layers) -> dict:
    """The same groups' builders as vLLM creates them with no speculative config."""
    import copy

    import torch

    vc = layers.vc
    saved, vc.speculative_config = vc.speculative_config, None
    builders = {}
    try:
        for gid, gs in enumerate(layers.groups):
            kernel = layers.kernel_block_sizes[gid] if gid < len(layers.kernel_block_sizes) else None
            for group in gs:
                fresh = copy.copy(group)
                fresh.create_metadata_builders(vllm_config=vc, device=torch.device("cpu"),
                                               kernel_block_size=kernel, num_metadata_builders=1)
                builders.update({name: fresh.get_metadata_builder(0) for name in group.layer_names})
    finally:
        vc.speculative_config = saved
    return builders


def _indexer_split(builders: dict, cm):
    """The split the sparse indexer's own build() makes (its own arguments), if it has one."""
    import importlib

    indexer = next((b for b in builders.values() if "Indexer" in type(b).__name__), None)
    if indexer is None:
        return None
    module = importlib.import_module(type(indexer).__module__)
    real, seen = module.split_decodes_and_prefills, []

    def spy(*args, **kwargs):
        seen.append(list(real(*args, **kwargs)))
        raise _Launched

    module.split_decodes_and_prefills = spy
    try:
        indexer.build(0, cm)
    except _Launched:
        pass
    finally:
        module.split_decodes_and_prefills = real
    return seen[0] if seen else None


def _step(layers: Layers, builders: dict, recorder: Recorder, layer, cm):
    """One layer's attention for one step: its builders' own build(), then the SM120 class's
    own _forward_sparse_impl; returns the launches as [path, rows] and the splits."""
    import torch

    hf = layers.vc.model_config.hf_config
    swa = builders[layer.swa_cache_layer.prefix].build(0, cm)
    md = builders[layer.prefix].build(0, cm) if layer.compress_ratio > 1 else None
    splits = {"swa": [swa.num_decodes, swa.num_prefills, swa.num_decode_tokens,
                      swa.num_prefill_tokens]}
    if md is not None and layer.compress_ratio == 128:
        dec, pre = md.c128a_global_decode_topk_indices, md.c128a_prefill_topk_indices
        splits["c128a"] = [0 if dec is None else dec.shape[0], 0 if pre is None else pre.shape[0]]
    tokens = cm.num_actual_tokens
    q = torch.zeros(tokens, HEADS_PER_RANK, hf.head_dim, dtype=torch.bfloat16)
    out = torch.zeros(tokens, layer.padded_heads, hf.head_dim, dtype=torch.bfloat16)
    before = len(recorder.calls)

    def tagged(method, path):
        def run(*args, **kwargs):
            recorder.path = path
            try:
                return method(*args, **kwargs)
            finally:
                recorder.path = None
        return run

    layer._forward_decode = tagged(layer._forward_decode, "decode")
    layer._forward_prefill = tagged(layer._forward_prefill, "prefill")
    try:
        layer._forward_sparse_impl(
            q=q, output=out, flashmla_metadata=md, swa_metadata=swa,
            self_kv_cache=layer.kv_cache if layer.compress_ratio > 1 else None,
            swa_kv_cache=layer.swa_cache_layer.kv_cache, swa_only=layer.compress_ratio <= 1)
    finally:
        del layer._forward_decode, layer._forward_prefill
    launches = [[path, call["tokens"]] for path, call in
                zip(recorder.paths[before:], recorder.calls[before:], strict=True)]
    return launches, splits


def run_short_prompts(layers: Layers, fi) -> dict[str, str]:
    """Prompts of 1 to 12 tokens alone and beside two decodes and a long prompt, with DSpark
    (vLLM's SpeculativeConfig: parallel drafting) and without speculation: each builder's own
    split and what the SM120 class launches FlashInfer with, for every target layer kind
    (SWA-only, C4A, C128A), which must agree. Then two steps whose split the overlay must not
    change: DSpark's draft step (is_prefilling None) and a FULL-graph batch padded with empty
    requests (is_prefilling unpadded)."""
    import torch
    from vllm.models.deepseek_v4.nvidia import flashinfer_sparse
    from vllm.v1.attention.backends.utils import split_decodes_and_prefills

    _stand_in_metadata_kernels()
    recorder = Recorder(fi)
    flashinfer_sparse.flashinfer_trtllm_batch_decode_sparse_mla_dsv4 = recorder
    flashinfer_sparse.compute_global_topk_indices_and_lens = _global_topk_stand_in
    A = flashinfer_sparse.DeepseekV4FlashInferSM120Attention
    A._get_workspace = staticmethod(lambda device: torch.empty(0, dtype=torch.uint8))
    hf = layers.vc.model_config.hf_config
    target = {}
    draft = None
    for layer in layers.attn.values():
        if layer.layer_id < hf.num_hidden_layers:
            target.setdefault(layer.compress_ratio, layer)
        elif draft is None:
            draft = layer
    errors: list[str] = []
    rows: dict = {}
    splits: dict = {}
    thresholds: dict = {}
    for config in SPEC_CONFIGS:
        spec = config != "no speculation"
        builders = layers.builders if spec else _builders_without_speculation(layers)
        thresholds[config] = builders[target[1].swa_cache_layer.prefix].decode_threshold
        for prompt in SHORT_PROMPTS:
            for mix in MIXES:
                where = f"{config}, prompt {prompt} {mix}"
                cm = _common(_batch(prompt, mix, spec))
                seen = {}
                split = {"indexer": _indexer_split(builders, cm)}
                for ratio, layer in sorted(target.items()):
                    try:
                        launches, layer_split = _step(layers, builders, recorder, layer, cm)
                    except Exception as e:  # noqa: BLE001 - reported as the case's result
                        errors.append(f"{where}, ratio {ratio}: {type(e).__name__}: {e}")
                        continue
                    seen[ratio] = launches
                    split.update(layer_split)
                    for why in recorder.refusals:
                        errors.append(f"{where}, ratio {ratio}: {why}")
                    recorder.refusals.clear()
                if len({json.dumps(v) for v in seen.values()}) > 1:
                    errors.append(f"{where}: the layer kinds launch differently: {seen}")
                if seen:
                    rows.setdefault(config, {}).setdefault(str(prompt), {})[mix] = next(iter(seen.values()))
                splits.setdefault(config, {}).setdefault(str(prompt), {})[mix] = split
    # Steps whose split must stay vLLM's own: the draft block (no is_prefilling) and a
    # FULL-graph verify batch of 2 requests padded to 4 (is_prefilling holds 2).
    guards = {}
    for name, layer, cm in (
            ("DSpark draft, 2 requests x 5 rows", draft,
             _common([(NUM_SPEC, DECODE_CONTEXT + NUM_SPEC, False)] * 2, causal=False,
                     prefilling=False)),
            ("target verify, 2 requests padded to 4", target[128],
             _common([(1 + NUM_SPEC, DECODE_CONTEXT + 1 + NUM_SPEC, False)] * 2,
                     pad_reqs=2, pad_tokens=2 * (1 + NUM_SPEC)))):
        builder = layers.builders[layer.swa_cache_layer.prefix]
        try:
            launches, split = _step(layers, layers.builders, recorder, layer, cm)
        except Exception as e:  # noqa: BLE001 - reported as the case's result
            errors.append(f"{name}: {type(e).__name__}: {e}")
            continue
        stock = list(split_decodes_and_prefills(cm, decode_threshold=builder.decode_threshold))
        guards[name] = {"launches": launches, "split": split, "vllm's split": stock}
        for why in recorder.refusals:
            errors.append(f"{name}: {why}")
        recorder.refusals.clear()
    return {
        "short prompts: rows": json.dumps(rows),
        "short prompts: splits": json.dumps(splits),
        "short prompts: decode thresholds": json.dumps(thresholds),
        "short prompts: guards": json.dumps(guards),
        "short prompts": "\n".join(sorted(set(errors))) or "ok",
    }


def check_init(layers: Layers, fi) -> list[str]:
    """The SM120 class's own start-up check, with DSpark's non-causal SWA
    width, against FlashInfer's table (the parent class's weight set-up is
    skipped: it needs the checkpoint's quantized linear layers)."""
    import torch
    import vllm.utils.flashinfer as fu
    from vllm.models.deepseek_v4 import attention as attn_mod
    from vllm.models.deepseek_v4.nvidia import flashinfer_sparse

    fu.has_flashinfer_sparse_mla_sm120_config = (
        lambda h, k: (int(h), int(k)) in fi.decode_dispatch)
    flashinfer_sparse.compute_fp8_einsum_recipe = lambda: (None, False)
    hf = layers.vc.model_config.hf_config

    def parent_init(self, vllm_config, *args, **kwargs):
        torch.nn.Module.__init__(self)
        self.window_size = hf.sliding_window
        self.padded_heads = HEADS_PER_RANK
        self.kv_cache_torch_dtype = torch.uint8

    saved = attn_mod.DeepseekV4Attention.__init__
    attn_mod.DeepseekV4Attention.__init__ = parent_init
    vc = layers.vc
    vc.attention_config.use_non_causal = True
    try:
        flashinfer_sparse.DeepseekV4FlashInferSM120Attention(vc)
    except Exception as e:  # noqa: BLE001 - the refusal is the result
        return [f"start-up with DSpark k={NUM_SPEC}: {type(e).__name__}: {e}"]
    finally:
        attn_mod.DeepseekV4Attention.__init__ = saved
        vc.attention_config.use_non_causal = False
    return []


def main() -> None:
    # sys.argv[1], the tree's site-packages, names the run: the tree is imported through PYTHONPATH.
    cache_dtypes = (sys.argv[2] if len(sys.argv) > 2 else "nvfp4_ds_mla").split(",")
    lengths = tuple(int(n) for n in sys.argv[3].split(",")) if len(sys.argv) > 3 else MAX_MODEL_LENS
    fi = _load_flashinfer()
    _simulate_sm12x()
    results: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "config.json").write_text(FIXTURE.read_text())
        for cache_dtype, max_len in ((d, n) for d in cache_dtypes for n in lengths):
            key = f"{cache_dtype} max_model_len={max_len}"
            try:
                layers = Layers(_config(tmp, cache_dtype, max_len)).plan()
            except Exception:
                results[f"{key}: layout"] = traceback.format_exc()
                continue
            hf = layers.vc.model_config.hf_config
            results[f"{key}: layers"] = json.dumps({
                "attention": len(layers.attn),
                "swa caches": sum(1 for spec in layers.specs if spec.endswith(".swa_cache")),
                "draft": sum(1 for a in layers.attn.values()
                             if a.layer_id >= hf.num_hidden_layers),
                "use_eagle": layers.vc.speculative_config.use_eagle(),
            })
            for check in (check_pages_and_strides, check_group_pages_disjoint):
                try:
                    problems = (check(layers, fi) if check is check_pages_and_strides
                                else check(layers))
                except Exception:
                    problems = [traceback.format_exc()]
                results[f"{key}: {check.__name__[6:]}"] = "\n".join(problems) or "ok"
            try:
                problems, calls, rows = run_widths(layers, fi)
            except Exception:
                problems, calls, rows = [traceback.format_exc()], [], {}
            results[f"{key}: rows seen"] = json.dumps(rows)
            results[f"{key}: index widths"] = "\n".join(problems) or "ok"
            widths = sorted({(c["tokens"] <= fi.decode_max_tokens, c["topk"], c["extra_topk"])
                             for c in calls}, key=str)
            results[f"{key}: widths seen"] = json.dumps(widths)
            try:
                problems = check_init(layers, fi)
            except Exception:
                problems = [traceback.format_exc()]
            results[f"{key}: start-up check"] = "\n".join(problems) or "ok"
            if "short prompts" not in results:  # once a run: the split does not depend on them
                started = time.monotonic()
                try:
                    results.update(run_short_prompts(layers, fi))
                    results["short prompts: run on"] = key
                    results["short prompts: seconds"] = f"{time.monotonic() - started:.1f}"
                except Exception:
                    results["short prompts"] = traceback.format_exc()
    print("@@RESULTS@@" + json.dumps(results))


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    main()
