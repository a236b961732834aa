"""`dspark plan`'s context at max_num_seqs side by side with what vLLM 0.28.0's own scheduler runs.

For each setting of the grid (gpu_memory_utilization 0.70, 0.78, 0.835, 0.90 x max_num_seqs 4,
12, 16, 32; then, at the serving defaults read from dspark's config at run time, one change at
a time: max_model_len 131,072 and 1,048,576, max_num_batched_tokens 2,048, async scheduling
off, TP=4, no long-prefill threshold) the plan of the published DeepSeek V4 Flash checkpoint
gives its pool (KV cache per rank) and the longest context each of max_num_seqs concurrent
requests runs with. tests/overlay/scheduler_sim.py then drives vLLM's own Scheduler and
KVCacheManager on CPU (the overlay applied to a copy of the installed vLLM, SM12x simulated,
a real SpeculativeConfig for DSpark k=5, prefix caching on, fake model outputs, two batches
in flight with async scheduling) with that pool: max_num_seqs requests, each a prompt of the
length less 4 tokens, must all hold their KV at once (each decoded 4 tokens) with no
preemption, in two workloads: all sent together, and the last sent once the others decode
(a server's usual case; "late" in the table when only that one failed). The second is what
makes vLLM's limit monotone in length: sent together, whether the last request is admitted
with the others depends on where the prompts' last chunks end, so lengths above the safe one
often run anyway (at the defaults 12 x 261,120 ... 262,080 ran but for 261,430, 261,632 and
262,460), while a late request is refused at every length whose n - 1 decoding requests leave
less than its admission cap free.

vLLM's figure is searched on a grid bounded in runs (the sim's ``edge`` case): the plan's
figure P, P x 0.99 ... 0.95 and P x 0.90, 0.75, 0.50 below it (admission is not monotone in
length, so every shorter length tried must run too), then P x 1.01, 1.02, ... up to 1.05
until one fails, each step at three lengths a third of a prefill chunk apart (near the edge,
which lengths vLLM refuses depends on where a prompt's last chunk ends: at the defaults
12 x 261,430 and 12 x 262,460 were refused while 1% steps around them ran). Where all the
prompts fit one step's budget (the 0.70 rows), every length from P x 0.90 to P x 1.05 is
tried as well: there vLLM preempts in bands a few tokens wide (0.7 x 4: 688 failed; 0.7 x 16:
162-166, 178-182, 186-190 failed while the lengths between ran). vLLM's figure is the longest length tried with every shorter one running.
A setting passes when the plan is at most vLLM's figure and at least 95% of it. Exit 1 if
any does not.

    .venv/bin/python -m benchmarks.plan_vs_scheduler              # the grid, about 20 min on 2 cores
    .venv/bin/python -m benchmarks.plan_vs_scheduler --only "0.78 x 12"
"""  # noqa: E501 (the --help epilog, printed as written)

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIM = REPO / "tests" / "overlay" / "scheduler_sim.py"
OVERLAY_DIR = REPO / "overlay"
TOLERANCE = 0.05
BELOW = (0.99, 0.98, 0.97, 0.96, 0.95, 0.90, 0.75, 0.50)
STEP, UP = 0.01, 5      # P x 1.01 ... 1.05, stopping at the first failure
PHASES = 3              # each step above P tried at 3 lengths a third of a prefill chunk apart
DECODE = 1024           # tokens each simulated request may decode at least (it stops once all run)
SMALLEST = 2048         # tried when the plan says no length runs

UTILIZATIONS = (0.70, 0.78, 0.835, 0.90)
SEQS = (4, 12, 16, 32)

# (name, the PlanInputs fields it changes from the defaults)
SETTINGS: list[tuple[str, dict]] = [
    *((f"{u} x {n}", {"gpu_memory_utilization": u, "max_num_seqs": n})
      for u in UTILIZATIONS for n in SEQS),
    ("max_model_len 131,072", {"max_model_len": 131072}),
    ("max_model_len 1,048,576", {"max_model_len": 1048576}),
    ("max_num_batched_tokens 2,048", {"max_num_batched_tokens": 2048}),
    ("async scheduling off", {"async_scheduling": False}),
    ("TP=4", {"tensor_parallel_size": 4}),
    ("no long-prefill threshold", {"long_prefill_token_threshold": 0}),
]


def plans(only: list[str] | None = None):
    """(name, plan) per setting: the published checkpoint at the config defaults + change."""
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


def chunk(i) -> int:
    """The longest prefill chunk of one request per step."""
    t = i.long_prefill_token_threshold
    return t if 0 < t < i.max_num_batched_tokens else i.max_num_batched_tokens


def case(plan, below=BELOW, up: int = UP, prefix_caching: bool = True, phases: int = PHASES) -> dict:
    """The sim's search for vLLM's figure around the plan's context at max_num_seqs: each step
    above the plan at ``phases`` lengths spread over one prefill chunk."""
    i = plan.inputs
    at = plan.max_context_at_max_num_seqs
    offsets = [chunk(i) * k // phases for k in range(1, phases)]
    return {
        "kv_bytes": plan.kv_cache_bytes, "max_model_len": i.max_model_len,
        "max_num_seqs": i.max_num_seqs, "max_num_batched_tokens": i.max_num_batched_tokens,
        "async_scheduling": i.async_scheduling, "num_speculative_tokens": i.num_speculative_tokens,
        "long_prefill_token_threshold": i.long_prefill_token_threshold,
        "kv_cache_dtype": i.kv_cache_dtype, "enable_prefix_caching": prefix_caching,
        # Room to decode: the first requests decode while the later ones prefill, at worst
        # one after another (a chunk a step each), so they must not finish first.
        "n": i.max_num_seqs,
        "decode": max(DECODE, i.max_num_seqs * -(-max(at, SMALLEST) * 21 // 20 // chunk(i)) + 64),
        # A plan of 0 (no length runs): vLLM must not run SMALLEST either.
        "edge": ({"plan": at, "below": list(below), "step": STEP, "up": up, "offsets": offsets,
                  **({"dense": dense(at)} if at * i.max_num_seqs <= i.max_num_batched_tokens
                     else {})} if at
                 else {"plan": SMALLEST, "below": [], "step": STEP, "up": 0}),
    }


def dense(at: int) -> list[int]:
    """[lo, hi]: when all the prompts prefill in one step, every length from 10% below the
    plan up to 5% above it (until one fails): vLLM preempts in bands a few tokens wide that
    follow the block boundaries, which the fractions step over (0.7 x 16: 162-166, 178-182,
    186-190 ... failed while 10-token steps ran)."""
    return [at - at // 10, int(at * (1 + UP * STEP)) + 1]


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

    from dspark.lines.overlay import apply_series

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
    r = subprocess.run([sys.executable, "-m", "tests.overlay.scheduler_sim", str(site), json.dumps(all_cases)],
                       capture_output=True, text=True, env=env, timeout=timeout, check=False, cwd=REPO)
    for line in r.stdout.splitlines():
        if line.startswith("@@RESULTS@@"):
            return json.loads(line[len("@@RESULTS@@"):])
    raise RuntimeError(f"scheduler_sim.py did not report:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")


def compare(only: list[str] | None = None, site: Path | None = None, timeout: float = 3600,
            below=BELOW, up: int = UP, prefix_caching: bool = True, phases: int = PHASES) -> list[dict]:
    """One row per setting: the plan and what vLLM's scheduler ran."""
    chosen = plans(only)
    all_cases = [case(p, below, up, prefix_caching, phases) for _, p in chosen]
    with tempfile.TemporaryDirectory() as tmp:
        results = simulate(site or patched_site(Path(tmp) / "site"), all_cases, timeout)
    return [{"setting": name, "plan": plan, "vllm": res}
            for (name, plan), res in zip(chosen, results, strict=True)]


def verdict(row: dict) -> list[str]:
    """What is wrong with a row (empty: the plan is at most vLLM's figure and within 5%)."""
    plan, res = row["plan"], row["vllm"]
    at, n = plan.max_context_at_max_num_seqs, plan.inputs.max_num_seqs
    if res.get("error"):
        return [f"simulation error {res['error'][-400:]}"]
    if not at:
        return [] if not res["figure"] else [f"the plan says none run; vLLM ran {n} x {SMALLEST:,}"]
    bad = [int(k) for k, v in res["runs"].items() if not v["ok"] and int(k) <= at]
    wrong = []
    if bad:
        wrong.append(f"above vLLM: {n} x {min(bad):,} did not all run (the plan says {at:,})")
    if res["above"] and at < plan.inputs.max_model_len:
        wrong.append(f"more than 5% below vLLM: {n} x {int(at * (1 + UP * STEP)):,} ran")
    elif res["figure"] and at < (1 - TOLERANCE) * res["figure"]:
        wrong.append(f"more than 5% below vLLM's {res['figure']:,}")
    return wrong


def vllm_figure(row: dict) -> str:
    res, at = row["vllm"], row["plan"].max_context_at_max_num_seqs
    if not at:
        return f"< {SMALLEST:,}" if not res["figure"] else f">= {SMALLEST:,}"
    if res["above"] and at < row["plan"].inputs.max_model_len:
        return f">= {res['figure']:,}"
    return f"{res['figure']:,}"


def table(rows: list[dict]) -> str:
    head = ("| setting | KV per rank | pool blocks | plan: context at max_num_seqs "
            "| vLLM: longest with every shorter running | plan / vLLM | failed | verdict |")
    lines = [head, "|" + " --- |" * 8]
    for row in rows:
        p, res = row["plan"], row["vllm"]
        at, fig = p.max_context_at_max_num_seqs, res.get("figure") or 0
        failed = [f"{int(k):,}" + (" (late)" if v.get("together") else "")
                  for k, v in res.get("runs", {}).items() if not v["ok"]]
        wrong = verdict(row)
        lines.append(
            f"| {row['setting']} | {p.kv_cache_bytes / (1 << 30):.2f} GiB "
            f"| {res.get('num_blocks') or 0:,} | {p.inputs.max_num_seqs} x {at:,} "
            f"| {vllm_figure(row)} | {f'{at / fig:.3f}' if at and fig else '-'} "
            f"| {', '.join(failed) or '-'} "
            f"| {'ok' if not wrong else 'WRONG'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--only", action="append", choices=[n for n, _ in SETTINGS],
                    help="run only this setting (repeatable)")
    ap.add_argument("--site", type=Path, help="an already patched vLLM tree to use")
    ap.add_argument("--no-prefix-caching", action="store_true",
                    help="run vLLM with prefix caching off (about 3x faster; the prompts share "
                         "no prefix, so the blocks are the same)")
    args = ap.parse_args(argv)
    rows = compare(args.only, args.site, prefix_caching=not args.no_prefix_caching)
    print(table(rows))
    bad = [(r["setting"], w) for r in rows for w in verdict(r)]
    for name, w in bad:
        print(f"MISMATCH {name}: {w}")
    print(f"all {len(rows)} within 5% and never above vLLM" if not bad
          else f"{len(bad)} mismatch(es) in {len(rows)} settings")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
