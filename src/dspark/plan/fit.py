"""The fit: the plan's inputs, the budget each rank gives, and whether weights, reserve and
the KV cache fit in it (with how many KV tokens)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dspark.plan.facts import DSV4_RUNTIME_OVERHEAD_BYTES, GiB, ModelFacts, load_model_facts
from dspark.plan.inputs import PlanInputs
from dspark.plan.kv_layout import KVLayout, kv_layout
from dspark.plan.weights import WeightSplit, split_weights

# --------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    architecture: str
    fits: bool
    weight_bytes: int               # every tensor in the checkpoint
    checkpoint_file_bytes: int      # the shards on disk, headers included
    loaded_weight_bytes: int        # what vLLM loads (drafter only with speculation)
    weight_bytes_per_rank: int
    replicated_bytes: int           # held whole by every rank
    runtime_overhead_bytes: int
    memory_per_rank_bytes: int      # what the node gives vLLM
    kv_cache_bytes: int             # per rank, for the KV cache
    kv_bytes_per_token: float       # per rank, block padding included
    kv_block_size: int
    kv_num_blocks: int
    kv_tokens: int                  # vLLM's "KV cache size: N tokens" (per rank)
    max_concurrency: float          # requests of max_model_len at once
    max_context_at_max_num_seqs: int
    full_length_requests: int       # requests of max_model_len that run at once
    admission_reserve_blocks: int   # admission cap beyond what the request then holds
    admission_reserve_bytes: int
    in_flight_tokens: int           # vLLM's max_in_flight_tokens
    max_model_len_that_fits: int    # one request
    kv_caches: tuple[tuple[str, int, int], ...]
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        i = self.inputs
        return {
            "fits": self.fits,
            "model_dir": str(i.model_dir),
            "architecture": self.architecture,
            "tensor_parallel_size": i.tensor_parallel_size,
            "pipeline_parallel_size": i.pipeline_parallel_size,
            "max_model_len": i.max_model_len,
            "max_num_seqs": i.max_num_seqs,
            "kv_cache_dtype": i.kv_cache_dtype,
            "weight_bytes": self.weight_bytes,
            "checkpoint_file_bytes": self.checkpoint_file_bytes,
            "loaded_weight_bytes": self.loaded_weight_bytes,
            "weight_bytes_per_rank": self.weight_bytes_per_rank,
            "replicated_bytes": self.replicated_bytes,
            "runtime_overhead_bytes": self.runtime_overhead_bytes,
            "memory_per_rank_bytes": self.memory_per_rank_bytes,
            "kv_cache_bytes": self.kv_cache_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_block_size": self.kv_block_size,
            "kv_num_blocks": self.kv_num_blocks,
            "kv_tokens": self.kv_tokens,
            "max_concurrency": round(self.max_concurrency, 4),
            "max_context_at_max_num_seqs": self.max_context_at_max_num_seqs,
            "full_length_requests": self.full_length_requests,
            "admission_reserve_blocks": self.admission_reserve_blocks,
            "admission_reserve_bytes": self.admission_reserve_bytes,
            "max_in_flight_tokens": self.in_flight_tokens,
            "max_model_len_that_fits": self.max_model_len_that_fits,
            "kv_caches": [
                {"cache": n, "layers": c, "page_bytes": p} for n, c, p in self.kv_caches
            ],
            "problems": list(self.problems),
            "notes": list(self.notes),
        }

    def render_text(self) -> str:
        i = self.inputs

        def gib(n: float) -> str:
            return f"{n / GiB:,.2f} GiB"

        rows = [
            ("model", f"{i.model_dir} ({self.architecture})"),
            ("parallelism", f"TP={i.tensor_parallel_size} PP={i.pipeline_parallel_size}"),
            ("checkpoint weights", gib(self.weight_bytes)),
            ("loaded weights", gib(self.loaded_weight_bytes)),
            ("weights per rank", f"{gib(self.weight_bytes_per_rank)}"
                                 f" ({gib(self.replicated_bytes)} replicated)"),
            ("runtime reserve per rank", gib(self.runtime_overhead_bytes)),
            ("memory per rank", gib(self.memory_per_rank_bytes)),
            ("KV cache per rank", gib(self.kv_cache_bytes)),
            ("KV bytes per token", f"{self.kv_bytes_per_token:,.1f}"
                                   f" ({i.kv_cache_dtype}, block {self.kv_block_size})"),
            ("KV tokens per rank", f"{self.kv_tokens:,}"),
            ("max_model_len", f"{i.max_model_len:,}"
                              f" (one request fits up to {self.max_model_len_that_fits:,})"),
            (f"context at {i.max_num_seqs} seqs", f"{self.max_context_at_max_num_seqs:,}"),
            ("full-length requests", f"{self.full_length_requests} at once"
                                     f" (of {i.max_model_len:,} tokens)"),
            ("admission reserve", f"{self.admission_reserve_blocks:,} blocks"
                                  f" ({gib(self.admission_reserve_bytes)}), set by"
                                  f" max_in_flight_tokens {self.in_flight_tokens:,}"
                                  f" = max_num_batched_tokens {i.max_num_batched_tokens:,}"
                                  f" x {self.in_flight_tokens // i.max_num_batched_tokens}"
                                  " batches in flight"),
            ("fits", "yes" if self.fits else "NO"),
        ]
        width = max(len(k) for k, _ in rows)
        lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
        lines += [f"problem: {p}" for p in self.problems]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines) + "\n"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Scheduling:
    """What vLLM 0.28.0's scheduler does with a pool, for requests of one length.

    The rules (vllm/v1/core/kv_cache_manager.py ``allocate_slots``, v1/core/sched/scheduler.py):
    - admission reserves nothing: a waiting request is admitted when its capped need
      (``full_sequence_must_fit``: the prompt's blocks, each sliding-window group capped at
      ``SlidingWindowSpec.max_admission_blocks_per_request``, window - 1 +
      ``max_in_flight_tokens``) is no more than the blocks free now; then only its first
      chunk's blocks (and the k lookahead slots) are allocated. A refused request waits at
      the head of the queue and is tried again every step;
    - every step ``remove_skipped_blocks`` frees the sliding-window blocks behind the window
      (on processed tokens, those still in flight kept), so a decoding request holds its
      full-attention blocks and a few window blocks per group;
    - ``max_in_flight_tokens`` = ``max_num_batched_tokens`` x the batches in flight (2 with
      async scheduling, VllmConfig.max_concurrent_batches), so the cap of the small-block
      compressor-state groups is thousands of blocks: the admission reserve, paid by the one
      request being admitted, not by every request;
    - a step's ``max_num_batched_tokens`` go to the running requests first, each prefill
      chunk at most ``long_prefill_token_threshold`` (0: the whole budget); waiting requests
      are admitted with what is left.

    When a request is admitted depends on where the prompts' last chunks end (their length
    mod the chunk): in the step where the first requests' last chunks are still in flight,
    the budget they leave admits the next ones only if the gate passes with those chunks'
    window blocks held; then the early ones' own first chunks hold window blocks while the
    later ones are gated. So for requests sent together vLLM's own limit is not monotone in
    length (at the serving defaults 12 x 261,430 strands the last request while 12 x 261,440
    runs); a request that arrives while the other n - 1 decode meets the gate at every length
    (12 x 251,500 runs, 12 x 253,630 does not). The plan
    assumes no order: a refused request waits at the head of the queue, and once every other
    request has prefilled and settled to decoding, the free blocks only shrink, so all n run
    whatever the order when the pool holds n - 1 requests decoding plus one admission cap,
    and n - m decoding plus the m that prefill at once (budget / chunk, each at its peak: the
    step after its last chunk, holding the prompt, one decode step and the lookahead slots in
    every group, window groups included, since nothing has settled yet). The pool is the blocks
    less one: BlockPool keeps one as its null block. With short prompts that all prefill in one
    step vLLM preempts the last one admitted in bands a few tokens wide wherever that peak
    passes the pool (0.7 x 16, 1,144 blocks: 16 x 161 runs, 162 does not). Requests that all fit
    the first step's budget are admitted in that step in order, each gated with the earlier ones
    holding their first chunk. Every term grows with the length (window groups taken
    at their most), so ``longest`` is the largest length below which every length runs.
    """

    layout: KVLayout
    num_blocks: int
    budget: int          # max_num_batched_tokens
    chunk: int           # the longest prefill chunk of one request per step
    batches: int         # batches in flight
    spec: int            # speculative tokens (lookahead slots)

    def held(self, tokens: int, in_flight: int) -> int:
        """Blocks a request of ``tokens`` holds with ``in_flight`` of them not yet settled, each
        window group at its most for any length up to ``tokens`` (so it grows with it)."""
        total = 0
        for g in self.layout.groups:
            blocks = _cdiv(tokens + self.spec, g.block_size)
            if g.window:
                blocks = min(blocks, _cdiv(g.window - 1 + in_flight + self.spec, g.block_size) + 1)
            total += blocks
        return total

    def admission_cap(self, tokens: int) -> int:
        return self.layout.blocks_per_request(tokens)

    def reserve(self, tokens: int) -> int:
        """The admission cap beyond what the admitted request ends up holding."""
        return max(0, self.admission_cap(tokens) - self.decoding(tokens))

    def decoding(self, tokens: int) -> int:
        # Scheduled ahead of what is settled: 1 + k tokens a step for each batch in flight.
        ahead = self.batches * (1 + self.spec)
        return self.held(tokens + ahead, ahead)

    def runs(self, n: int, tokens: int) -> bool:
        """n requests of ``tokens`` sent together all run at once, in any admission order."""
        if n < 1:
            return True
        cap = self.admission_cap(tokens)
        first = min(self.chunk, tokens)
        prefill_at_once = min(n, _cdiv(self.budget, first))  # short prompts: many a step
        # The first requests keep decoding, a token a step at least, while the later ones
        # prefill one group after another.
        later = (_cdiv(n, prefill_at_once) - 1) * _cdiv(tokens, first)
        decoding = self.decoding(tokens + later)
        # A request just prefilled: its prompt (at most tokens - 1: it generates one token at
        # least) is one of the batches in flight, the others each schedule a decode step
        # (1 + k tokens) beyond it, and nothing has settled, so no window block behind it is
        # freed yet (held() adds the k lookahead slots). 0.7 x 32 (1,144 blocks): a 69-token
        # prompt holds 35 blocks at its peak and 32 x 73 runs, a 70-token one 37 and 32 x 74
        # is preempted.
        ahead = self.batches * (1 + self.spec)
        beyond = (self.batches - 1) * (1 + self.spec)
        prefilling = self.held(tokens - 1 + beyond, self.batches * first + ahead)
        # BlockPool takes one block of the pool as its null block (v1/core/block_pool.py):
        # 0.7 x 4 (1,144 blocks) preempts four requests of 286 blocks each.
        free = self.num_blocks - 1
        if n * decoding > free:
            return False
        if (n - prefill_at_once) * decoding + prefill_at_once * prefilling > free:
            return False
        # The last request may arrive once the other n - 1 decode (a server's usual case): it is
        # admitted only when its cap fits beside them, whatever the first step could admit.
        return (n - 1) * decoding + cap <= free

    def longest(self, n: int, limit: int) -> int:
        """Largest L <= limit such that n requests of every length up to L run at once.
        From one chunk up every term of ``runs`` grows with the length, so a bisection finds
        the edge; below a chunk more prompts fit a step's budget as they get shorter, so
        those lengths are each tried."""
        lo, hi = 0, limit
        while lo < hi:  # binary search: log2(limit) rounds
            mid = (lo + hi + 1) // 2
            if self.runs(n, mid):
                lo = mid
            else:
                hi = mid - 1
        for tokens in range(1, min(lo, self.chunk) + 1):  # at most one chunk of lengths
            if not self.runs(n, tokens):
                return tokens - 1
        return lo

    def most(self, tokens: int, limit: int) -> int:
        """Most requests of ``tokens`` that run at once (at most ``limit``)."""
        k = 0
        while k < limit and self.runs(k + 1, tokens):  # bounded by limit
            k += 1
        return k


def scheduling(layout: KVLayout, num_blocks: int, inputs: PlanInputs) -> Scheduling:
    budget = inputs.max_num_batched_tokens
    threshold = inputs.long_prefill_token_threshold or 0
    chunk = threshold if 0 < threshold < budget else budget
    batches = 2 if inputs.async_scheduling and inputs.pipeline_parallel_size == 1 else (
        inputs.pipeline_parallel_size)
    return Scheduling(layout, num_blocks, budget, chunk, batches, inputs.num_speculative_tokens)


def make_plan(inputs: PlanInputs) -> Plan:
    facts = load_model_facts(inputs.model_dir)
    return plan_from_facts(facts, inputs)


def plan_from_facts(facts: ModelFacts, inputs: PlanInputs) -> Plan:
    tp, pp = inputs.tensor_parallel_size, inputs.pipeline_parallel_size
    cfg = facts.config
    notes: list[str] = []
    problems: list[str] = []

    with_draft = inputs.num_speculative_tokens > 0
    weights = split_weights(facts, with_draft)
    per_rank = weights.per_rank(tp, pp)
    if not facts.tensors:
        notes.append(
            f"no *.safetensors shards in {facts.model_dir}: weights not counted "
            "(a config-only model served with --load-format dummy?)"
        )
    if weights.draft_bytes and not with_draft:
        notes.append(
            f"{weights.draft_bytes / GiB:.2f} GiB of draft (MTP) weights are not "
            "loaded without speculative decoding"
        )

    overhead = inputs.runtime_overhead_bytes
    if overhead is None:
        if facts.is_deepseek_v4:
            overhead = DSV4_RUNTIME_OVERHEAD_BYTES
        else:
            overhead = 0
            notes.append(
                "activation / CUDA-graph reserve not estimated for this model: "
                "size the KV cache yourself with serving.kv_cache_memory_bytes in the cluster file"
            )

    layout = kv_layout(facts, inputs)
    budget = int(inputs.gpu_memory_utilization * inputs.usable_memory_bytes)
    if inputs.kv_cache_memory_bytes is not None:
        kv_bytes = inputs.kv_cache_memory_bytes
        memory_per_rank = per_rank + overhead + kv_bytes
        if memory_per_rank > inputs.usable_memory_bytes:
            room = inputs.usable_memory_bytes - per_rank - overhead
            problems.append(
                f"weights ({per_rank / GiB:.2f} GiB) + reserve ({overhead / GiB:.2f} GiB) "
                f"+ kv_cache_memory_bytes ({kv_bytes / GiB:.2f} GiB) exceed the "
                f"{inputs.usable_memory_bytes / GiB:.2f} GiB of one rank: "
                + (f"lower kv_cache_memory_bytes to {max(room, 0)}" if room > 0
                   else _raise_tp_hint(weights, inputs, overhead))
            )
    else:
        memory_per_rank = budget
        kv_bytes = max(0, budget - per_rank - overhead)
        if per_rank + overhead >= budget:
            problems.append(
                f"weights ({per_rank / GiB:.2f} GiB per rank) + reserve "
                f"({overhead / GiB:.2f} GiB) do not fit in gpu_memory_utilization "
                f"{inputs.gpu_memory_utilization} x {inputs.usable_memory_bytes / GiB:.2f} GiB"
                f" = {budget / GiB:.2f} GiB: " + _raise_tp_hint(weights, inputs, overhead)
            )

    num_blocks = kv_bytes // layout.block_stride
    per_request = layout.blocks_per_request(inputs.max_model_len)
    concurrency = num_blocks / per_request
    kv_tokens = int(concurrency * inputs.max_model_len)
    limit = int(cfg.get("max_position_embeddings") or inputs.max_model_len)
    limit = max(limit, inputs.max_model_len)
    one_request = _largest_context_bytes(layout, kv_bytes, limit)
    sched, at_seqs, full_len, reserve = _concurrency(facts, inputs, num_blocks)

    if not problems and layout.bytes_needed_for_one_request(inputs.max_model_len) > kv_bytes:
        problems.append(
            f"the KV cache ({kv_bytes / GiB:.2f} GiB per rank) cannot hold one request of "
            f"max_model_len {inputs.max_model_len:,}: lower max_model_len to "
            f"{one_request:,}, or give the KV cache more memory (gpu_memory_utilization, "
            "kv_cache_memory_bytes, a larger tensor_parallel_size)"
        )
    if not problems and at_seqs < inputs.max_model_len:
        notes.append(_concurrency_note(facts, inputs, num_blocks, sched, at_seqs, full_len, reserve))

    return Plan(
        inputs=inputs,
        architecture=facts.architecture,
        fits=not problems,
        weight_bytes=facts.weight_bytes,
        checkpoint_file_bytes=facts.shard_file_bytes,
        loaded_weight_bytes=weights.loaded_bytes,
        weight_bytes_per_rank=per_rank,
        replicated_bytes=weights.replicated_bytes,
        runtime_overhead_bytes=overhead,
        memory_per_rank_bytes=memory_per_rank,
        kv_cache_bytes=kv_bytes,
        kv_bytes_per_token=layout.bytes_per_token,
        kv_block_size=layout.block_size,
        kv_num_blocks=num_blocks,
        kv_tokens=kv_tokens,
        max_concurrency=concurrency,
        max_context_at_max_num_seqs=at_seqs,
        full_length_requests=full_len,
        admission_reserve_blocks=reserve,
        admission_reserve_bytes=reserve * layout.block_stride,
        in_flight_tokens=sched.budget * sched.batches,
        max_model_len_that_fits=one_request,
        kv_caches=layout.detail,
        problems=problems,
        notes=notes,
    )


def _concurrency(facts: ModelFacts, inputs: PlanInputs, num_blocks: int) -> tuple[Scheduling, int, int, int]:
    """(scheduling, context at max_num_seqs, full-length requests, admission reserve)."""
    sched = scheduling(kv_layout(facts, inputs), num_blocks, inputs)
    mml = inputs.max_model_len
    return (sched, sched.longest(inputs.max_num_seqs, mml),
            sched.most(mml, inputs.max_num_seqs), sched.reserve(mml))


def _concurrency_note(facts: ModelFacts, inputs: PlanInputs, num_blocks: int, sched: Scheduling,
                      at_seqs: int, full_len: int, reserve: int) -> str:
    """What runs, and which settings buy more (each figure from the same rules)."""
    from dataclasses import replace

    n, mml, budget = inputs.max_num_seqs, inputs.max_model_len, inputs.max_num_batched_tokens
    text = (f"{n} concurrent requests run with up to {at_seqs:,} tokens each and "
            f"{full_len} request(s) of the full {mml:,} tokens run at once "
            f"in whatever order vLLM admits them, and so does every shorter length "
            f"(vLLM admits a request when its capped need fits the free blocks and "
            f"reserves nothing; the admission reserve of {reserve:,} blocks is paid "
            f"once, by the request being admitted)")
    levers = []
    alternatives = []
    if budget >= 2048:
        alternatives.append((f"max_num_batched_tokens {budget:,} -> {budget // 2:,}",
                             replace(inputs, max_num_batched_tokens=budget // 2)))
    if inputs.async_scheduling:
        alternatives.append(("async_scheduling off (no overlap of scheduling and execution)",
                             replace(inputs, async_scheduling=False)))
    for what, alt in alternatives:
        _, at2, full2, reserve2 = _concurrency(facts, alt, num_blocks)
        if at2 > at_seqs * 1.01 or full2 > full_len:
            levers.append(f"{what} takes the reserve to {reserve2:,} blocks: {n} x {at2:,} tokens, "
                          f"{full2} full-length")
    if levers:
        text += "; " + "; ".join(levers)
    return text + ("; more KV memory (gpu_memory_utilization, kv_cache_memory_bytes, "
                   "tensor_parallel_size) raises both")


def _largest_context_bytes(layout: KVLayout, kv_bytes: int, limit: int) -> int:
    """Largest max_model_len that passes vLLM's start-up check for one request."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if layout.bytes_needed_for_one_request(mid) <= kv_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _raise_tp_hint(weights: WeightSplit, inputs: PlanInputs, overhead: int) -> str:
    """Say which larger tensor_parallel_size (or utilization) would hold the weights."""
    budget = (
        inputs.usable_memory_bytes
        if inputs.kv_cache_memory_bytes is not None
        else int(inputs.gpu_memory_utilization * inputs.usable_memory_bytes)
    )
    hints = []
    tp = inputs.tensor_parallel_size * 2
    while tp <= 64:
        if weights.per_rank(tp, inputs.pipeline_parallel_size) + overhead < budget:
            hints.append(f"raise tensor_parallel_size to {tp}")
            break
        tp *= 2
    need = weights.per_rank(inputs.tensor_parallel_size, inputs.pipeline_parallel_size)
    need += overhead
    if inputs.kv_cache_memory_bytes is None and need < inputs.usable_memory_bytes:
        hints.append(
            f"raise gpu_memory_utilization above {need / inputs.usable_memory_bytes:.2f}"
        )
    return " or ".join(hints) if hints else "this model does not fit these nodes"
