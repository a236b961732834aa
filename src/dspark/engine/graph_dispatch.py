"""Which decode batches replay a CUDA graph: a pure model of vLLM's model runner v2 dispatch.

vLLM's ``CudaGraphManager`` (v1/worker/gpu/cudagraph_utils.py, the runner DSpark forces)
captures, for each capture size s, a FULL uniform-decode graph of ``round_up(s, q)`` tokens
(q: the batch's tokens per request), dropped above ``max_num_seqs * q`` and above the largest
capture size, and, where the mode has one, a mixed graph (PIECEWISE for the target's
FULL_AND_PIECEWISE) of s tokens. A uniform batch of n requests (n * q tokens) replays:

- vLLM 0.28.0: the graphs at the smallest captured token count >= n * q of either kind, the
  FULL one first; when that count has only a PIECEWISE graph the batch runs PIECEWISE;
- vLLM 0.29.0 and 0.32.0: the FULL graph at the smallest FULL count >= n * q, else the
  PIECEWISE one (0.32.0: ``CudaGraphManager._init_candidates`` gives each token count the FULL
  descriptors of the smallest FULL count above it, then the PIECEWISE ones, and ``dispatch``
  takes the first compatible one).

The target verifies k + 1 tokens per request (FULL_AND_PIECEWISE); DSpark's draft runs
``num_speculative_tokens`` query tokens per request (``DSparkSpeculator``: sample_from_anchor,
the checkpoint's default) in FULL_DECODE_ONLY graphs (``DFlashSpeculator.init_cudagraph_manager``,
on 0.32.0 through its ``DFlashCudaGraphManager``, which keeps the base class's dispatch).
tests/overlay/test_graph_grid.py proves this model against both lines' own managers.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

FULL, PIECEWISE, NONE = "FULL", "PIECEWISE", "NONE"
# vLLM releases whose dispatch takes the smallest captured count of either kind (0.28.0), the
# others pick FULL first at the smallest FULL count (0.29.0's and 0.32.0's per-mode candidate
# ranges: v1/worker/gpu/cudagraph_utils.py CudaGraphManager._init_candidates).
SMALLEST_COUNT_FIRST = frozenset({"0.28.0"})
# vLLM's largest default capture size off SM100 (VllmConfig._set_cudagraph_sizes).
DEFAULT_MAX_GRAPH_SIZE = 512


@dataclass(frozen=True)
class Batch:
    """How a uniform batch of ``reqs`` requests runs: its mode and the tokens it replays."""

    reqs: int
    tokens: int
    mode: str
    padded: int

    @property
    def exact(self) -> bool:
        return self.mode == FULL and self.padded == self.tokens


def draft_query_len(speculative_config: dict | None) -> int | None:
    """Tokens per request of the draft's graphs, or None when the method has no parallel draft
    modelled here (DSpark only: num_speculative_tokens query tokens a request)."""
    spec = speculative_config or {}
    k = spec.get("num_speculative_tokens") or 0
    return int(k) if spec.get("method") == "dspark" and k else None


def covering_sizes(max_num_seqs: int, k: int, largest: int, draft_q: int | None) -> list[int]:
    """Capture sizes under which every target verify batch (n x (k + 1) tokens) and every draft
    batch (n x draft_q tokens) of 1..max_num_seqs requests, up to ``largest`` tokens, finds a
    FULL graph of exactly its tokens: every multiple of k + 1, and n x draft_q for each n whose
    draft interval ((n-1) x q, n x q] holds none of them (vLLM rounds a size up to a multiple
    of q for the draft)."""
    step = k + 1
    sizes = set(range(step, largest + 1, step)) or {largest}
    if draft_q:
        ordered = sorted(sizes)
        for n in range(1, max_num_seqs + 1):
            lo, hi = (n - 1) * draft_q, n * draft_q
            if hi <= largest and not any(lo < s <= hi for s in ordered):
                sizes.add(hi)
    return sorted(sizes)


def vllm_sizes(sizes: list[int] | None, largest: int | None, *, max_num_seqs: int,
               max_num_batched_tokens: int) -> list[int]:
    """The sizes vLLM captures from --cudagraph-capture-sizes / --max-cudagraph-capture-size
    (VllmConfig._set_cudagraph_sizes): an explicit list deduplicated, sorted, without sizes above
    max_num_batched_tokens; without one, vLLM's own list (1, 2, 4, then every 8) up to the
    largest size, modelled for one token a request only (0.29.0 adds decode sizes above that).
    With no largest size either (dspark always gives one) the default largest is vLLM's for one
    token a request; not modelled: vLLM's own for k + 1 tokens (2 x max_num_seqs x (k + 1)), and
    0.32.0's uniform decode sizes appended to its default list (whole requests' tokens; with one
    token a request, max_num_seqs: VllmConfig._set_cudagraph_sizes)."""
    if sizes is not None:
        return sorted({s for s in sizes if s <= max_num_batched_tokens})
    top = min(largest if largest is not None else min(max_num_seqs * 2, DEFAULT_MAX_GRAPH_SIZE),
              max_num_batched_tokens)
    out = {s for s in (1, 2, 4) if s <= top} | set(range(8, min(top + 1, 256), 8))
    out |= set(range(256, top + 1, 16)) if top >= 256 else set()
    if max_num_batched_tokens <= top:
        out.add(max_num_batched_tokens)
    return sorted(out)


def full_graphs(sizes: list[int], max_num_seqs: int, q: int) -> list[int]:
    """Token counts of the uniform-decode FULL graphs a manager of q tokens a request captures."""
    if not sizes:
        return []
    limit = min(max_num_seqs * q, max(sizes))
    return sorted({r for s in sizes if (r := -(-s // q) * q) <= limit})


def dispatch(sizes: list[int], max_num_seqs: int, q: int, *, mixed: bool, vllm: str) -> list[Batch]:
    """How each uniform batch of 1..max_num_seqs requests, q tokens each, runs under ``sizes``
    (as vLLM captures them) on vLLM release ``vllm``; ``mixed``: the manager also captures
    PIECEWISE graphs (the target), not only FULL decode ones (the draft)."""
    full = full_graphs(sizes, max_num_seqs, q)
    piecewise = sorted(sizes) if mixed else []
    smallest_first = vllm in SMALLEST_COUNT_FIRST
    out = []
    for n in range(1, max_num_seqs + 1):
        x = n * q
        i, j = bisect_left(full, x), bisect_left(piecewise, x)
        f = full[i] if i < len(full) else None
        p = piecewise[j] if j < len(piecewise) else None
        if smallest_first and f is not None and p is not None and p < f:
            f = None
        if f is not None:
            out.append(Batch(n, x, FULL, f))
        elif p is not None:
            out.append(Batch(n, x, PIECEWISE, p))
        else:
            out.append(Batch(n, x, NONE, x))
    return out


def coverage(sizes: list[int], max_num_seqs: int, k: int, draft_q: int | None,
             vllm: str) -> dict[str, list[Batch]]:
    """Target verify batches and (with a DSpark draft) draft batches of 1..max_num_seqs."""
    out = {"target": dispatch(sizes, max_num_seqs, k + 1, mixed=True, vllm=vllm)}
    if draft_q:
        out["draft"] = dispatch(sizes, max_num_seqs, draft_q, mixed=False, vllm=vllm)
    return out


def uncovered(sizes: list[int], max_num_seqs: int, k: int, draft_q: int | None,
              vllm: str) -> dict[str, list[Batch]]:
    """The batches of ``coverage`` that replay no FULL graph (run PIECEWISE or eager)."""
    return {role: [b for b in rows if b.mode != FULL]
            for role, rows in coverage(sizes, max_num_seqs, k, draft_q, vllm).items()}


def sizes_to_add(sizes: list[int], max_num_seqs: int, k: int, draft_q: int | None,
                 releases: list[str]) -> list[int]:
    """The fewest exact token counts to add to ``sizes`` (as vLLM captures them) so that every
    batch replays a FULL graph on every release: each uncovered batch's own tokens, repeated
    (on 0.28.0 an added size can take a smaller batch's padded FULL graph from it)."""
    added: set[int] = set()
    while True:
        now = sorted(set(sizes) | added)
        more = {b.tokens for v in releases for rows in uncovered(now, max_num_seqs, k, draft_q, v).values()
                for b in rows}
        if not more - added:
            return sorted(added)
        added |= more


def ranges(values: list[int]) -> str:
    """1,2,3,5,7,8 -> '1-3, 5, 7-8'."""
    out: list[str] = []
    run: list[int] = []
    for v in sorted(values) + [None]:  # type: ignore[list-item]
        if run and v is not None and v == run[-1] + 1:
            run.append(v)
            continue
        if run:
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [v] if v is not None else []
    return ", ".join(out) or "none"
