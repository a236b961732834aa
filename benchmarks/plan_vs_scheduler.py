"""`dspark plan`'s concurrency figures side by side with what vLLM 0.28.0's own scheduler runs.

For each setting (the serving defaults, read from dspark's config at run time, and one
change at a time: max_num_seqs 4 and 16, max_model_len 131,072 and 1,048,576,
max_num_batched_tokens 2,048, async scheduling off, TP=4, no long-prefill threshold) the
plan of the published DeepSeek V4 Flash checkpoint gives its pool (KV cache per rank), the
longest context each of max_num_seqs concurrent requests runs with, and how many requests
of the full max_model_len run at once. tests/overlay/scheduler_sim.py then drives vLLM's
own Scheduler and KVCacheManager on CPU (the overlay applied to a copy of the installed
vLLM, SM12x simulated, fake model outputs, two batches in flight with async scheduling, no
prefix hits) with that pool and those workloads: each figure must run without preemption
at 95% of itself and must not at 105% (the context) or one request more (the count).
With --rounds N the simulation also bisects that bracket N times, to show where its own
limit lies.

    .venv/bin/python benchmarks/plan_vs_scheduler.py              # the table, about 10 min on 2 cores
    .venv/bin/python benchmarks/plan_vs_scheduler.py --only defaults --rounds 0
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIM = REPO / "tests" / "overlay" / "scheduler_sim.py"
OVERLAY_DIR = REPO / "overlay"
DECODE = 1024    # tokens of room each simulated request leaves for decoding (it decodes a few)
TOLERANCE = 0.05

# (name, the PlanInputs fields it changes from the defaults)
SETTINGS: list[tuple[str, dict]] = [
    ("defaults", {}),
    ("max_num_seqs 4", {"max_num_seqs": 4}),
    ("max_num_seqs 16", {"max_num_seqs": 16}),
    ("max_model_len 131,072", {"max_model_len": 131072}),
    ("max_model_len 1,048,576", {"max_model_len": 1048576}),
    ("max_num_batched_tokens 2,048", {"max_num_batched_tokens": 2048}),
    ("async scheduling off", {"async_scheduling": False}),
    ("TP=4", {"tensor_parallel_size": 4}),
    ("no long-prefill threshold", {"long_prefill_token_threshold": 0}),
]


def plans(only: list[str] | None = None):
    """(name, plan) per setting: the published checkpoint at the config defaults + change."""
    try:
        import dspark  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(REPO / "src"))
    from dspark.plan.fit import plan_from_facts
    from dspark.plan.published import plan_published, published_facts

    base = plan_published().inputs
    facts = published_facts()
    out = []
    for name, change in SETTINGS:
        if only and name not in only:
            continue
        out.append((name, plan_from_facts(facts, replace(base, **change))))
    return out


def cases(plan, rounds: int) -> list[dict]:
    """The two simulated workloads that bracket the plan's two figures."""
    i = plan.inputs
    # Room to decode: the earliest requests keep decoding while the last wave prefills
    # (about n x length / max_num_batched_tokens steps, one token a step), so they must not
    # finish first; the prompts are that much shorter than the length (at most 1/10).
    def room(n: int, length: int) -> int:
        steps = math.ceil(1.25 * n * length / i.max_num_batched_tokens)
        return max(DECODE, min(steps + 64, length // 10))

    common = {
        "kv_bytes": plan.kv_cache_bytes, "max_model_len": i.max_model_len,
        "max_num_seqs": i.max_num_seqs, "max_num_batched_tokens": i.max_num_batched_tokens,
        "async_scheduling": i.async_scheduling, "num_speculative_tokens": i.num_speculative_tokens,
        "long_prefill_token_threshold": getattr(i, "long_prefill_token_threshold", 0),
        "kv_cache_dtype": i.kv_cache_dtype,
    }
    at = plan.max_context_at_max_num_seqs
    full = full_length(plan)
    lo = max(DECODE + 1, math.floor(at * (1 - TOLERANCE)))
    hi = min(i.max_model_len, math.ceil(at * (1 + TOLERANCE)))
    return [
        {**common, "n": i.max_num_seqs, "decode": room(i.max_num_seqs, hi),
         "bisect": {"key": "length", "lo": lo, "hi": hi, "rounds": rounds}},
        {**common, "length": i.max_model_len,
         "decode": room(min(full + 1, i.max_num_seqs), i.max_model_len),
         "bisect": {"key": "n", "lo": max(full, 1), "hi": min(full + 1, i.max_num_seqs),
                    "rounds": 0}},
    ]


def full_length(plan) -> int:
    """The plan's count of full-max_model_len requests at once (a plan from before the
    scheduler model has only max_concurrency, whose whole part it printed)."""
    n = getattr(plan, "full_length_requests", None)
    return int(plan.max_concurrency) if n is None else n


def overlay_conftest():
    """tests/overlay/conftest.py, loaded by path (tests/conftest.py is another 'conftest')."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "dspark_overlay_conftest", REPO / "tests" / "overlay" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def patched_site(dest: Path) -> Path:
    """A copy of the installed vLLM with the overlay applied (tests/overlay/conftest.py's way)."""
    import importlib.util

    from dspark.overlay import apply_series

    copy_vllm_tree = overlay_conftest().copy_vllm_tree

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise SystemExit("vLLM is not installed in this environment")
    copy_vllm_tree(Path(spec.origin).resolve().parents[1], dest)
    apply_series(dest, OVERLAY_DIR)
    return dest


def simulate(site: Path, all_cases: list[dict], timeout: float) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(site), PYTHONDONTWRITEBYTECODE="1",
               VLLM_ALLOW_LONG_MAX_MODEL_LEN="1")
    env.pop("PYTHONWARNINGS", None)
    r = subprocess.run([sys.executable, str(SIM), str(site), json.dumps(all_cases)],
                       capture_output=True, text=True, env=env, timeout=timeout, check=False)
    for line in r.stdout.splitlines():
        if line.startswith("@@RESULTS@@"):
            return json.loads(line[len("@@RESULTS@@"):])
    raise RuntimeError(f"scheduler_sim.py did not report:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")


def compare(only: list[str] | None = None, rounds: int = 0, site: Path | None = None,
            timeout: float = 1800) -> list[dict]:
    """One row per setting: the plan's figures and what the simulation ran."""
    chosen = plans(only)
    all_cases = [c for _, p in chosen for c in cases(p, rounds)]
    with tempfile.TemporaryDirectory() as tmp:
        results = simulate(site or patched_site(Path(tmp) / "site"), all_cases, timeout)
    rows = []
    for k, (name, plan) in enumerate(chosen):
        ctx, full = results[2 * k], results[2 * k + 1]
        rows.append({"setting": name, "plan": plan, "context": ctx, "full": full})
    return rows


def verdict(row: dict) -> list[str]:
    """What is wrong with a row (empty: the plan is within 5% of the simulation)."""
    plan, ctx, full = row["plan"], row["context"], row["full"]
    i = plan.inputs
    wrong = []
    for what, res in (("context", ctx), ("full-length", full)):
        if res.get("error"):
            wrong.append(f"{what}: simulation error {res['error'][-400:]}")
    at = plan.max_context_at_max_num_seqs
    if not ctx.get("lo_ok"):
        wrong.append(f"{i.max_num_seqs} x {ctx['runs']} : 95% of the plan's {at:,} did not run")
    if ctx.get("hi_ok") and at * (1 + TOLERANCE) < i.max_model_len:
        wrong.append(f"{i.max_num_seqs} requests ran at 105% of the plan's {at:,}")
    n = full_length(plan)
    if n >= 1 and not full.get("lo_ok"):
        wrong.append(f"{n} full-length requests did not run: {full['runs']}")
    if n < i.max_num_seqs and full["runs"].get(str(n + 1), {}).get("ok"):
        wrong.append(f"{n + 1} full-length requests ran, the plan says {n}")
    if n == 0 and full["runs"].get("1", {}).get("ok"):
        wrong.append("1 full-length request ran, the plan says 0")
    return wrong


def table(rows: list[dict]) -> str:
    head = ("| setting | pool blocks | plan: context at max_num_seqs | vLLM sim: ran / failed "
            "| plan: full-length at once | vLLM sim: ran / failed | admission reserve |")
    lines = [head, "|" + " --- |" * 7]
    for row in rows:
        p, ctx, full = row["plan"], row["context"], row["full"]
        n = full_length(p)
        f_ran = max((int(k) for k, v in full["runs"].items() if v.get("ok")), default=0)
        f_bad = min((int(k) for k, v in full["runs"].items() if not v.get("ok")), default=None)
        lines.append(
            f"| {row['setting']} | {ctx.get('num_blocks') or 0:,} "
            f"| {p.inputs.max_num_seqs} x {p.max_context_at_max_num_seqs:,} "
            f"| {_n(ctx.get('ran'))} / {_n(ctx.get('failed'))} "
            f"| {n} of {p.inputs.max_model_len:,} | {f_ran} / {_n(f_bad)} "
            f"| {getattr(p, 'admission_reserve_blocks', 0):,} blocks"
            f" ({getattr(p, 'admission_reserve_bytes', 0) / (1 << 30):.2f} GiB) |")
    return "\n".join(lines)


def _n(v) -> str:
    return "-" if v is None else f"{v:,}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--only", action="append", choices=[n for n, _ in SETTINGS],
                    help="run only this setting (repeatable)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="bisections of the 95%%-105%% bracket of the context (default 2)")
    ap.add_argument("--site", type=Path, help="an already patched vLLM tree to use")
    args = ap.parse_args(argv)
    rows = compare(args.only, max(0, args.rounds), args.site)
    print(table(rows))
    bad = [(r["setting"], w) for r in rows for w in verdict(r)]
    for name, w in bad:
        print(f"MISMATCH {name}: {w}")
    print("all within 5%" if not bad else f"{len(bad)} mismatch(es)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
