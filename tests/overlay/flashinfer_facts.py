"""What FlashInfer's SM120 sparse-MLA path dispatches, read from its own sources.

The locked ``flashinfer-python`` (nix/runtime-lock.json) is unpacked, without
dependencies and hash-checked, under ``.venv/pinned/flashinfer-python-VERSION``
by ``.ci/setup``. Its kernels need an SM120/SM121 GPU, so nothing is imported:
the Python dispatch table is read with ``ast`` and the C++ prefill dispatcher
with patterns that must each match (a FlashInfer that moved them fails loudly
here instead of silently passing).

Facts (flashinfer-python 0.6.18, the locked release, as 0.6.16.post3 before it;
``mla/_sparse_mla_sm120.py``, ``data/csrc/sparse_mla_sm120{,_prefill,_decode_dsv4}.cu``;
0.6.18 adds main top-k 192 and 256 to decode and single-cache prefill and 8-head
prefill): a call of at most
``_DECODE_MAX_TOKENS`` query rows goes to the standalone DSv4 decode kernel,
which needs ``(heads, main top-k)`` in ``_DECODE_DSV4_DISPATCH`` and 64-token
main pages; the compressed ("extra") segment's width and page size are runtime
values there. Longer calls go to the prefill orchestrator: one cache takes main
top-k 128/(192/256)/512/1024/2048; two caches need main top-k 128 and extra pages of 64
or 2 tokens, the extra width again being a runtime value. The orchestrator
refuses <= 64 rows (they must go through the decode kernel).
"""

from __future__ import annotations

import ast
import inspect
import json
import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "nix" / "runtime-lock.json"

# PTX ISA: cp.async.bulk (the kernels' KV gather) needs 16-byte aligned global
# addresses and sizes that are multiples of 16.
BULK_COPY_ALIGNMENT = 16


def locked_version() -> str:
    lock = json.loads(LOCK.read_text())
    return next(p["version"] for p in lock["packages"] if p["name"] == "flashinfer-python")


def pinned_dir() -> Path:
    return REPO / ".venv" / "pinned" / f"flashinfer-python-{locked_version()}" / "flashinfer"


def _module_constants(path: Path, names: tuple[str, ...]) -> dict[str, object]:
    tree = ast.parse(path.read_text())
    found: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name) and target.id in names:
                value = node.value
                # frozenset({...}) -> the literal set inside
                if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "frozenset":
                    value = value.args[0]
                found[target.id] = ast.literal_eval(value)
    missing = set(names) - set(found)
    if missing:
        raise AssertionError(f"{path}: no {sorted(missing)}")
    return found


def _function_body(source: str, name: str) -> str:
    start = source.index(f"inline bool {name}(")
    end = source.find("\ninline bool ", start + 1)
    end = source.find("\n}  // namespace", start) if end < 0 else end
    return source[start:end]


def _ints(pattern: str, text: str, what: str) -> tuple[int, ...]:
    values = tuple(sorted({int(v) for v in re.findall(pattern, text)}))
    if not values:
        raise AssertionError(f"FlashInfer source: no match for {what} ({pattern!r})")
    return values


@dataclass(frozen=True)
class SparseMlaSm120:
    version: str
    decode_max_tokens: int
    decode_dispatch: frozenset[tuple[int, int]]  # (heads, main top-k)
    decode_page_tokens: int
    bytes_per_token: int
    prefill_single_topks: tuple[int, ...]
    prefill_heads: tuple[int, ...]
    prefill_dual_topks: tuple[int, ...]
    prefill_dual_extra_page_tokens: tuple[int, ...]
    io_stride: int  # bytes of NoPE+RoPE data per token; scales follow the data
    # The signature of flashinfer.decode.trtllm_batch_decode_sparse_mla_dsv4 (defined in
    # mla/_core.py), which vLLM's flashinfer_trtllm_batch_decode_sparse_mla_dsv4 forwards to.
    decode_signature: inspect.Signature

    def decode_widths(self, heads: int) -> tuple[int, ...]:
        return tuple(sorted(k for h, k in self.decode_dispatch if h == heads))

    def refusal(self, *, tokens: int, heads: int, topk: int, page_tokens: int,
                extra_topk: int | None, extra_page_tokens: int | None) -> str | None:
        """Why FlashInfer would refuse this call, or None when it dispatches."""
        where = (f"tokens={tokens} heads={heads} topk={topk} pages={page_tokens} "
                 f"extra_topk={extra_topk} extra_pages={extra_page_tokens}")
        if tokens <= self.decode_max_tokens:
            if page_tokens != self.decode_page_tokens:
                return f"decode kernel needs {self.decode_page_tokens}-token main pages: {where}"
            if (heads, topk) not in self.decode_dispatch:
                return f"decode kernel has no (heads, top-k) specialization: {where}"
            return None
        if heads not in self.prefill_heads:
            return f"prefill has no {heads}-head kernel: {where}"
        if extra_topk is None:
            if topk not in self.prefill_single_topks:
                return f"single-cache prefill top-k not in {self.prefill_single_topks}: {where}"
            return None
        if topk not in self.prefill_dual_topks:
            return f"dual-cache prefill top-k not in {self.prefill_dual_topks}: {where}"
        if extra_page_tokens not in self.prefill_dual_extra_page_tokens:
            return f"dual-cache prefill extra pages not in {self.prefill_dual_extra_page_tokens}: {where}"
        return None


def signature_from_source(path: Path, name: str) -> inspect.Signature:
    """The signature of function `name` in `path`, read with ast (the module needs a GPU to
    import). Defaults that are literals keep their value; any other default reads as None."""
    tree = ast.parse(path.read_text())
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
    if fn is None:
        raise AssertionError(f"{path}: no function {name}")
    a = fn.args
    params: list[inspect.Parameter] = []

    def default(node):
        try:
            return ast.literal_eval(node)
        except ValueError:
            return None

    positional = a.posonlyargs + a.args
    pos_defaults = [inspect.Parameter.empty] * (len(positional) - len(a.defaults)) + [default(d) for d in a.defaults]
    for i, (arg, d) in enumerate(zip(positional, pos_defaults, strict=True)):
        kind = (inspect.Parameter.POSITIONAL_ONLY if i < len(a.posonlyargs)
                else inspect.Parameter.POSITIONAL_OR_KEYWORD)
        params.append(inspect.Parameter(arg.arg, kind, default=d))
    if a.vararg:
        params.append(inspect.Parameter(a.vararg.arg, inspect.Parameter.VAR_POSITIONAL))
    for arg, d in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        params.append(inspect.Parameter(arg.arg, inspect.Parameter.KEYWORD_ONLY,
                                        default=inspect.Parameter.empty if d is None else default(d)))
    if a.kwarg:
        params.append(inspect.Parameter(a.kwarg.arg, inspect.Parameter.VAR_KEYWORD))
    return inspect.Signature(params)


def dsv4_io_stride(root: Path, bytes_per_token: int) -> int:
    """The bytes of a DSv4 token's data row in FlashInfer's SM120 pages (NoPE + bf16 RoPE; the
    scales follow the page's rows), checked against the token's bytes: read from the kernel and
    the KV-cache traits of the sources at ``root`` (the same in 0.6.18 and 0.7.0.post1)."""
    kernel = (root / "data" / "include" / "flashinfer" / "attention" / "sparse_mla_sm120"
              / "decode_dsv4_kernel.cuh").read_text()
    # data_base = block * stride + local * IO_STRIDE; scales at pbs * IO_STRIDE + local * 8.
    if "(size_t)section_pbs * IO_STRIDE" not in kernel:
        raise AssertionError("FlashInfer's DSv4 page layout (data, then scales) moved")
    traits = (root / "data" / "include" / "flashinfer" / "attention" / "sparse_mla_sm120"
              / "model" / "kv_cache_traits.cuh").read_text()
    dsv4 = traits[traits.index("struct KVCacheTraits<ModelType::DSV4>"):]
    d_nope, d_rope, scale_bytes = (_ints(rf"int {name} = (\d+);", dsv4, f"DSV4 {name}")[0]
                                   for name in ("D_NOPE", "D_ROPE", "SCALE_BYTES_PER_TOKEN"))
    if d_nope + 2 * d_rope + scale_bytes != bytes_per_token:
        raise AssertionError("FlashInfer's DSv4 token envelope changed")
    return d_nope + 2 * d_rope  # bf16 RoPE


def load(root: Path | None = None) -> SparseMlaSm120:
    root = pinned_dir() if root is None else root
    if not root.is_dir():
        raise FileNotFoundError(
            f"{root} is missing: run .ci/setup (it unpacks the locked flashinfer-python)"
        )
    consts = _module_constants(
        root / "mla" / "_sparse_mla_sm120.py",
        ("_DECODE_MAX_TOKENS", "_DECODE_DSV4_DISPATCH", "_DECODE_DSV4_PAGE_BLOCK_SIZE",
         "_BPT_DSV4"),
    )
    prefill = (root / "data" / "csrc" / "sparse_mla_sm120_prefill.cu").read_text()
    single = _function_body(prefill, "dispatch_dsv4_single")
    dual = _function_body(prefill, "dispatch_dsv4_dual")
    orchestrator = (root / "data" / "csrc" / "sparse_mla_sm120.cu").read_text()
    decode_max = int(consts["_DECODE_MAX_TOKENS"])
    if f"TVM_FFI_ICHECK_GT(num_tokens, {decode_max})" not in orchestrator:
        raise AssertionError("FlashInfer's orchestrator no longer refuses decode-sized calls")
    return SparseMlaSm120(
        version=locked_version() if root == pinned_dir() else str(root),
        decode_max_tokens=decode_max,
        decode_dispatch=frozenset(consts["_DECODE_DSV4_DISPATCH"]),
        decode_page_tokens=int(consts["_DECODE_DSV4_PAGE_BLOCK_SIZE"]),
        bytes_per_token=int(consts["_BPT_DSV4"]),
        prefill_single_topks=_ints(r"topk == (\d+)", single, "single-cache top-k"),
        prefill_heads=_ints(r"case (\d+):", single, "prefill head counts"),
        prefill_dual_topks=_ints(r"if \(topk != (\d+)\) return false;", dual, "dual top-k"),
        prefill_dual_extra_page_tokens=_ints(
            r"extra_page_block_size == (\d+)", dual, "dual extra page size"),
        io_stride=dsv4_io_stride(root, int(consts["_BPT_DSV4"])),
        decode_signature=signature_from_source(root / "mla" / "_core.py",
                                               "trtllm_batch_decode_sparse_mla_dsv4"),
    )
