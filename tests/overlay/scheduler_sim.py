"""How many requests of what length vLLM 0.28.0's own scheduler keeps running, on CPU.

Run in a subprocess whose PYTHONPATH puts a patched vLLM 0.28.0 tree first
(tests/overlay/conftest.py's ``run_checks``)::

    python scheduler_sim.py SITE CASES_JSON

CASES_JSON is a list of cases; each names a pool size in bytes (the planner's
"KV cache per rank", whose block count vLLM's own get_kv_cache_config_from_groups
computes here), the serving settings (max_model_len, max_num_seqs,
max_num_batched_tokens, async_scheduling, num_speculative_tokens,
long_prefill_token_threshold, enable_prefix_caching, on unless said) and a workload: ``n``
requests of ``length`` tokens, sent together (each a prompt of ``length - SETTLE`` distinct
tokens that may generate ``decode`` more), or with ``stagger`` the last one sent once the other
n - 1 have prefilled and settled to decoding (a server's usual case: one request ends, the next
arrives while the rest run). A case is ``ok`` when all n requests have
prefilled their whole prompt and decoded SETTLE tokens at the same time (all n hold at
least ``length`` tokens of KV at once) with no preemption; it fails at the first
preemption, when a request finishes before that, or (``stuck``) when a request is still
refused once every running request decodes and their in-flight blocks have settled (from
then on the free blocks only shrink). A case with ``edge`` searches vLLM's longest length
around a planned figure (edge_case), each length with both workloads; ``debug`` adds the blocks each request holds per
KV-cache group at the end. It prints ``@@RESULTS@@`` and one JSON list.

What runs is vLLM's own code: a real VllmConfig from
tests/fixtures/deepseek-v4-flash-config.json with the SM12x capability family
simulated and a real SpeculativeConfig for DSpark (its lookahead slots and the
scheduler's draft placeholders are vLLM's own); the DeepSeek V4 cache layers of every
layer (kv_layout_checks.Layers, the overlay's SM120 attention class) give their KV-cache
specs; vLLM groups and packs them (get_kv_cache_groups,
get_kv_cache_config_from_groups) for the pool; its Scheduler (AsyncScheduler
with async scheduling), built with the block sizes EngineCore gives it, and KVCacheManager
admit, chunk, allocate, free sliding-window blocks, cache full blocks and preempt. Only the
model is fake: every batch "samples" one token per request whose prefill is done (all draft
tokens rejected), and two batches are in flight the way EngineCore.step_with_batch_queue
keeps them (a batch's output reaches the scheduler after the next batch is scheduled).
Prompts are distinct (each request hashed by vLLM's own block hasher), so there are no
prefix hits.

Bounded in time: the pool has its real block count and the prompts their real lengths,
but a run stops once every request has decoded SETTLE tokens while all n run (or is
stuck), so a case takes about n * length / max_num_batched_tokens scheduler steps (each
bounded by max_steps), and an ``edge`` search a fixed number of cases at most.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections import deque
from pathlib import Path

HERE = Path(__file__).resolve().parent

FIXTURE = HERE.parents[0] / "fixtures" / "deepseek-v4-flash-config.json"
BLOCK_SIZE = 256
_MODELS: dict = {}
SETTLE = 4  # tokens every request decodes while all n are running


def _config(case: dict, model_dir: Path):
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig

    mml = int(case["max_model_len"])
    model = _MODELS.get(mml)
    if model is None:  # building one takes a minute on a small box: one per length
        model = _MODELS[mml] = ModelConfig(model=str(model_dir), max_model_len=mml,
                                           skip_tokenizer_init=True, dtype="bfloat16")
    caching = bool(case.get("enable_prefix_caching", True))
    cache = CacheConfig(cache_dtype=case.get("kv_cache_dtype", "nvfp4_ds_mla"),
                        block_size=BLOCK_SIZE, enable_prefix_caching=caching)
    sched = SchedulerConfig(max_num_batched_tokens=int(case["max_num_batched_tokens"]),
                            max_num_seqs=int(case["max_num_seqs"]), max_model_len=mml,
                            is_encoder_decoder=False)
    vc = VllmConfig(model_config=model, cache_config=cache, scheduler_config=sched)
    # The CPU platform rewrites these for its own kernels; on the GB10 nodes the
    # served settings stand.
    vc.cache_config.block_size = BLOCK_SIZE
    vc.cache_config.enable_prefix_caching = caching
    vc.scheduler_config.max_num_batched_tokens = int(case["max_num_batched_tokens"])
    vc.scheduler_config.max_num_seqs = int(case["max_num_seqs"])
    vc.scheduler_config.async_scheduling = bool(case["async_scheduling"])
    vc.scheduler_config.enable_chunked_prefill = True
    vc.scheduler_config.long_prefill_token_threshold = int(case.get("long_prefill_token_threshold") or 0)
    k = int(case.get("num_speculative_tokens", 0))
    # DSpark as the template runs it: the SpeculativeConfig vLLM builds for
    # --speculative-config (the draft ships inside the target checkpoint), so the
    # scheduler's lookahead slots and draft padding are vLLM's own.
    vc.speculative_config = SpeculativeConfig(
        method="dspark", num_speculative_tokens=k, target_model_config=model,
        target_parallel_config=vc.parallel_config, draft_sample_method="probabilistic",
    ) if k else None
    return vc


def _model_dir(tmp: Path) -> Path:
    d = tmp / "dsv4"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(FIXTURE.read_text())
    return d


def _kv_cache_config(vc, kv_bytes: int):
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )
    from vllm.v1.worker.gpu import attn_utils

    from tests.overlay.kv_layout_checks import Layers  # the DeepSeek V4 cache layers, built by their classes

    Layers(vc)
    specs = attn_utils.get_kv_cache_spec(vc)
    groups = get_kv_cache_groups(vc, specs)
    # What EngineCore._initialize_kv_caches hands the scheduler.
    return generate_scheduler_kv_cache_config(
        [get_kv_cache_config_from_groups(vc, groups, int(kv_bytes))])


def run_case(case: dict, model_dir: Path) -> dict:
    from vllm.config import set_current_vllm_config
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import (
        get_request_block_hasher,
        init_none_hash,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    vc = _config(case, model_dir)
    with set_current_vllm_config(vc):
        kv_config = _kv_cache_config(vc, case["kv_bytes"])
        vc.cache_config.num_gpu_blocks = kv_config.num_blocks
        # What EngineCore.__init__ gives the scheduler and each request.
        block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_config, vc)
        hasher = None
        if vc.cache_config.enable_prefix_caching:
            init_none_hash(get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo))
            hasher = get_request_block_hasher(
                hash_block_size, get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo))
        n, length = int(case["n"]), int(case["length"])
        prompt = max(1, length - SETTLE)
        decode = max(SETTLE, int(case.get("decode", 1024)))
        # The first requests decode while the last ones prefill, so they may pass
        # max_model_len by up to ``decode`` tokens: the scheduler's length bound is raised by
        # that much (the admission caps, min(window + in-flight tokens, max_model_len), are
        # the same for any max_model_len above 131,072), or a request of max_model_len
        # would stop before the last one is admitted.
        mml = vc.model_config.max_model_len
        vc.model_config.max_model_len = max(mml, prompt + decode)
        try:
            cls = AsyncScheduler if case["async_scheduling"] else Scheduler
            sched = cls(vc, kv_config, StructuredOutputManager(vc), block_size=block_size,
                        hash_block_size=hash_block_size, log_stats=False)
        finally:
            vc.model_config.max_model_len = mml
    # Each request's prompt is ``length - SETTLE`` tokens and it may generate ``decode``
    # more, so the first admitted keep decoding while the last prefill; the run stops once
    # every request has prefilled its whole prompt and decoded ``SETTLE`` tokens at the same
    # time (all n hold at least ``length`` tokens of KV at once), or at the first preemption.
    def request(i: int):
        # (i * 7919 + j) % 120000 + 1 for j in range(prompt), built from one rotated cycle
        # (a list per token took about 7% of the simulation's time): no two requests
        # share a first block, so prefix caching finds no hits.
        start = (i * 7919) % 120000
        cycle = list(range(start + 1, 120001)) + list(range(1, start + 1))
        tokens = (cycle * (prompt // 120000 + 1))[:prompt]
        sp = SamplingParams(max_tokens=decode, ignore_eos=True, min_tokens=decode)
        return Request(f"r{i}", tokens, sp, None, block_hasher=hasher)

    # ``stagger``: the last request arrives once the other n - 1 have prefilled and settled
    # to decoding (what a server sees when one request ends and the next comes while the rest
    # run); otherwise all n arrive together.
    stagger = bool(case.get("stagger")) and n > 1
    reqs = {}
    for i in range(n - 1 if stagger else n):
        reqs[f"r{i}"] = r = request(i)
        sched.add_request(r)
    late = request(n - 1) if stagger else None
    batch_queue: deque = deque()
    depth = vc.max_concurrent_batches
    steps = 0
    # Every loop is bounded: prefill takes n * prompt / chunk-budget steps, decode a few.
    max_steps = int(case.get("max_steps") or
                    4 * (n * length // int(case["max_num_batched_tokens"]) + n * 16) + 200)
    max_running = 0
    all_at_once = stuck = False
    idle = 0  # steps in a row with requests waiting, none prefilling and none admitted
    quiet = 0  # steps in a row with every running request decoding (the stagger's wait)
    while (sched.has_requests() or batch_queue) and steps < max_steps:
        steps += 1
        if late is not None:
            quiet = quiet + 1 if all(r.num_computed_tokens >= r.num_prompt_tokens
                                     for r in sched.running) and not sched.waiting else 0
            if quiet > vc.max_concurrent_batches + 2:  # the n - 1 in-flight blocks settled
                reqs[late.request_id] = late
                sched.add_request(late)
                late = None
        if sched.has_requests():
            waiting = len(sched.waiting)
            out = sched.schedule()
            # Once every running request decodes, the free blocks only shrink (each decode
            # grows) until one finishes: a request still refused once the last prefill's
            # in-flight blocks have settled (depth + 2 steps) is never admitted while all
            # the others run, and the case has failed.
            settled = all(r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running)
            idle = idle + 1 if waiting and len(sched.waiting) == waiting and settled else 0
            if idle > vc.max_concurrent_batches + 2:
                stuck = True
                break
            done = {rid: not sched.requests[rid].is_prefill_chunk
                    for rid in out.num_scheduled_tokens}
            batch_queue.appendleft((out, done))
            max_running = max(max_running, len(sched.running))
            if len(batch_queue) < depth and sched.has_requests():
                continue
        if not batch_queue:
            break
        out, done = batch_queue.pop()
        ids = list(out.num_scheduled_tokens)
        result = ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[7] if done[r] else [] for r in ids],
            logprobs=None, prompt_logprobs_dict={}, pooler_output=[])
        sched.update_from_output(out, result)
        if any(r.num_preemptions for r in reqs.values()):
            break
        if any(r.is_finished() for r in reqs.values()):
            break  # one finished before all n held their KV at once
        if late is None and all(r.num_output_tokens >= SETTLE for r in reqs.values()):
            all_at_once = True
            break
    preempted = [r.request_id for r in reqs.values() if r.num_preemptions]
    held = {}
    if case.get("debug"):
        mgrs = sched.kv_cache_manager.coordinator.single_type_managers
        held = {rid: [r.num_computed_tokens, r.status.name,
                      [len(m.req_to_blocks.get(rid, ())) - sum(1 for b in m.req_to_blocks.get(rid, ())
                                                               if b.is_null) for m in mgrs]]
                for rid, r in reqs.items()}
        held["free"] = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    pool = sched.kv_cache_manager.block_pool.num_gpu_blocks
    return {"num_blocks": kv_config.num_blocks, "pool_blocks": pool,
            "preemptions": len(preempted), "max_running": max_running, "steps": steps,
            "all_at_once": all_at_once, "stuck": stuck, **({"held": held} if held else {}),
            "ok": all_at_once and not preempted}


def edge_case(case: dict, model_dir: Path) -> dict:
    """``edge``: vLLM's longest context for ``n`` requests around a planned figure P, on a
    grid bounded in runs. {"plan": P, "below": [fractions < 1], "step": s, "up": u, "dense":
    [lo, hi] (optional)}: runs P
    and P x each fraction in ``below`` (every shorter length must run too: admission is not
    monotone in length), then P x (1 + s), P x (1 + 2s), ... up to u steps (and at most
    max_model_len) until one fails, each step also at the lengths ``offsets`` (tokens, optional)
    beyond it. ``figure`` is the largest length tried that ran with
    every shorter length tried also running; ``above`` is True when even P x (1 + u s)
    ran (vLLM's figure is at least that)."""
    spec = case["edge"]
    plan, mml = int(spec["plan"]), int(case["max_model_len"])
    runs: dict[int, dict] = {}

    def ok(length: int) -> bool:
        """n requests of ``length`` all resident at once, sent together and (``stagger``, on
        unless the spec says no) with the last arriving once the others decode."""
        if length not in runs:
            res = run_case({**case, "length": length}, model_dir)
            if res["ok"] and spec.get("stagger", True):
                late = run_case({**case, "length": length, "stagger": True}, model_dir)
                res = {**late, "together": True, "ok": late["ok"]} if not late["ok"] else res
            runs[length] = res
        return runs[length]["ok"]

    for length in sorted({plan, *(max(SETTLE + 1, int(plan * f)) for f in spec["below"])},
                         reverse=True):
        ok(length)
    # ``dense`` [lo, hi]: every length from lo to the plan, then from the plan up to hi until
    # one fails. Short prompts all prefill in one step, and which lengths vLLM then preempts
    # follows the block boundaries (bands a few tokens wide, every few tens of tokens), which
    # the fractions above step over.
    if spec.get("dense"):
        lo, hi = (int(x) for x in spec["dense"])
        for length in range(max(SETTLE + 1, lo), plan):  # bounded: plan - lo lengths
            ok(length)
        for length in range(plan + 1, min(hi, mml) + 1):  # bounded: hi - plan lengths
            if not ok(length):
                break
    # A dense failure above the plan is vLLM's edge: the steps further up are not needed.
    above = all(v["ok"] for k, v in runs.items() if k > plan)
    offsets = [int(o) for o in spec.get("offsets", ())]
    for i in range(1, int(spec["up"]) + 1 if above else 1):  # bounded by up (x the offsets)
        base = min(mml, int(plan * (1 + i * float(spec["step"]))))
        if base <= plan:
            above = False
            break
        # Each step also tries lengths a fraction of a prefill chunk further (``offsets``, in
        # tokens): which lengths vLLM refuses near its edge depends on where the last chunk ends.
        if not all(ok(length) for length in sorted({base, *(min(mml, base + o) for o in offsets)})):
            above = False
            break
    figure = 0
    for length in sorted(runs):
        if not runs[length]["ok"]:
            break
        figure = length
    first = next(iter(runs.values()))
    return {"figure": figure, "above": above, "plan": plan,
            "num_blocks": first.get("num_blocks"),
            "error": next((v["error"] for v in runs.values() if v.get("error")), None),
            "runs": {str(k): {f: v.get(f) for f in ("ok", "preemptions", "max_running", "steps",
                                                       "stuck", "together")}
                     for k, v in sorted(runs.items())}}


def main() -> None:
    import tempfile

    from tests.overlay.kv_layout_checks import _simulate_sm12x

    cases = json.loads(sys.argv[2])
    _simulate_sm12x()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _model_dir(Path(tmp))
        for case in cases:
            try:
                results.append(edge_case(case, model_dir) if "edge" in case
                               else run_case(case, model_dir))
            except Exception:  # noqa: BLE001 - reported to the caller
                results.append({"ok": False, "error": traceback.format_exc()[-3000:]})
    print("@@RESULTS@@" + json.dumps(results))


if __name__ == "__main__":
    main()
