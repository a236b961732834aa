"""Fidelity of `dspark bench decode`: its aggregate output throughput against the one vLLM's
own client (`vllm bench serve`) measures on the same server and the same workload, run back
to back. Target: dspark / vLLM between 0.95 and 1.05 at every concurrency.

Same workload, exactly: both clients send token-id prompts (the server's tokenizer never
decides a prompt's length). `vllm bench serve` does that with its `timed_trace` dataset, which
needs a tokenizer client-side: a word-level tokenizer (token i <-> word "t{i}") is built
offline with `tokenizers` into a temporary directory and passed with --tokenizer. vLLM's own
dataset code (run here with the same PYTHONHASHSEED as the benchmark process) yields the
token ids `vllm bench serve` will send; dspark sends those very ids, with the same
concurrency, output length (ignore_eos), temperature and request count. Each repeat uses
fresh prompts; with input length <= the KV block size no prefix-cache hit is possible, and
the server's own counters (prompt tokens, generation tokens, prefix-cache hits) are printed
for every run to show the two clients gave the server identical work.

    .venv/bin/python -m benchmarks.bench_fidelity                 # starts its own local pair
    .venv/bin/python -m benchmarks.bench_fidelity --url http://127.0.0.1:8000 --model dspark-local
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dspark.bench import decode, prompts  # noqa: E402
from dspark.bench.client import Target, describe, scrape  # noqa: E402
from dspark.engine import facts as F  # noqa: E402
from dspark.engine.metrics import window  # noqa: E402
from tests.harness.pair import start_pair  # noqa: E402  (`dspark local up` on free loopback ports)

HASH_SEED = "0"        # PYTHONHASHSEED of both the prompt derivation and `vllm bench serve`
CHUNK = 16             # timed_trace: tokens per hash id
TARGET = (0.95, 1.05)
BIN = Path(sys.executable).parent


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------- vLLM's client's input
def build_tokenizer(path: Path, vocab_size: int) -> Path:
    """Word-level tokenizer: "t{i}" <-> id i, no special tokens (every id is sampleable)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20}))
    # vLLM's tokenizer loader also reads the model config; a stub keeps it quiet.
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": vocab_size}))
    return path


def write_trace(path: Path, n: int, input_len: int, output_len: int, first_hash: int) -> None:
    per = -(-input_len // CHUNK)
    with open(path, "w") as f:
        for i in range(n):
            hashes = list(range(first_hash + i * per, first_hash + (i + 1) * per))
            f.write(json.dumps({"timestamp": 0, "input_length": input_len, "output_length": output_len,
                                "hash_ids": hashes}) + "\n")


def vllm_argv(url: str, model: str, tokenizer: Path, trace: Path, n: int, concurrency: int,
              result_dir: Path, result_name: str) -> list[str]:
    return ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", model,
            "--tokenizer", str(tokenizer), "--dataset-name", "timed_trace", "--dataset-path", str(trace),
            "--timed-trace-chunk-hash-size", str(CHUNK), "--no-self-timed", "--num-prompts", str(n),
            "--max-concurrency", str(concurrency), "--request-rate", "inf", "--ignore-eos",
            "--temperature", "0", "--num-warmups", "0", "--ready-check-timeout-sec", "0", "--disable-tqdm",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", result_name]


DERIVE = r"""
import json, sys
from vllm.benchmarks.serve import add_cli_args
from vllm.benchmarks.datasets import get_samples
from vllm.tokenizers import get_tokenizer
from vllm.utils.argparse_utils import FlexibleArgumentParser
jobs = json.load(open(sys.argv[1]))
tok = None
out = []
for argv in jobs:
    p = FlexibleArgumentParser()
    add_cli_args(p)
    args = p.parse_args(argv)
    tok = tok or get_tokenizer(args.tokenizer)
    out.append([list(r.prompt) for r in get_samples(args, tok)])
json.dump(out, open(sys.argv[2], "w"))
"""


def derive_prompts(jobs: list[list[str]], workdir: Path) -> list[list[list[int]]]:
    """The token ids `vllm bench serve` sends for each argv, computed by vLLM's own dataset
    code under the same hash seed."""
    jobs_file, out_file = workdir / "jobs.json", workdir / "prompts.json"
    jobs_file.write_text(json.dumps(jobs))
    env = {**os.environ, "PYTHONHASHSEED": HASH_SEED}
    r = subprocess.run([sys.executable, "-c", DERIVE, str(jobs_file), str(out_file)], env=env,
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"deriving vLLM's prompts failed:\n{r.stderr[-3000:]}")
    return json.loads(out_file.read_text())


# ------------------------------------------------------------------------------ the runs
def server_work(target: Target, model: str, fn):
    before = scrape(target, model)
    result = fn()
    after = scrape(target, model)
    w = window(before, after)
    # vLLM's own end-to-end latency (arrival to finish, server clock) summed over the run's
    # requests: it tells a slower server apart from a client that measures more than the server.
    e2e = [x.hist_sum(F.E2E) for x in (before, after)]
    return result, {"prompt_tokens": w.prompt_tokens, "generation_tokens": w.generation_tokens,
                    "requests": w.requests_finished, "prefix_cache_hits": w.prefix_cache_hits,
                    "e2e_sum_s": None if None in e2e else e2e[1] - e2e[0]}


def run_vllm(argv: list[str], result_file: Path) -> dict:
    env = {**os.environ, "PYTHONHASHSEED": HASH_SEED}
    r = subprocess.run([str(BIN / "vllm"), "bench", "serve", *argv], env=env, capture_output=True, text=True,
                       timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"vllm bench serve failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    res = json.loads(result_file.read_text())
    return {"tok_s": res["output_throughput"], "output_tokens": res["total_output_tokens"],
            "duration_s": res["duration"], "completed": res["completed"]}


def run_dspark(target: Target, c: int, ids: list[list[int]], output_len: int, input_len: int) -> dict:
    level = [prompts.Prompt(key=f"vllm-timed-trace/{i}", token_ids=tuple(p), sha256=prompts.fingerprint(p))
             for i, p in enumerate(ids)]
    spec = decode.DecodeSpec(concurrency=(c,), output_len=output_len, input_len=input_len,
                             rounds=len(ids) // c, warmup=False, temperature=0.0, label="fidelity")
    rep = decode.run(target, spec, level_prompts={c: level})
    if rep.error:
        raise SystemExit(f"dspark bench decode failed: {rep.error}")
    s = rep.summary[0]
    return {"tok_s": s.aggregate_tok_s, "output_tokens": s.output_tokens, "duration_s": s.duration_s,
            "completed": s.requests}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="Server to measure (default: start a local pair)")
    ap.add_argument("--model", help="Served model name (default: the server's only model)")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--input-len", type=int, default=128, help="Keep <= the KV block size: no prefix-cache hits")
    ap.add_argument("--rounds", type=int, default=1, help="Requests per level = concurrency x rounds")
    ap.add_argument("--repeats", type=int, default=4,
                    help="Back-to-back pairs of runs per level; the order alternates, so an even number lets "
                         "each client go first equally often")
    ap.add_argument("--vocab-size", type=int, default=4096, help="Token ids vLLM's client draws from: [0, N)")
    ap.add_argument("--json", type=Path, help="Also write every figure here")
    ap.add_argument("--workdir", type=Path, help="Keep traces, tokenizer and vLLM's result files here")
    a = ap.parse_args()
    if a.repeats < 2 or a.repeats % 2:
        ap.error(f"--repeats must be even and at least 2 (each client first equally often), got {a.repeats}")
    levels = [int(x) for x in a.concurrency.split(",")]

    with tempfile.TemporaryDirectory(prefix="dspark-fidelity-") as tmp:
        work = Path(tmp) if a.workdir is None else a.workdir
        work.mkdir(parents=True, exist_ok=True)
        pair = None
        url = a.url
        if url is None:
            log("starting a local pair (dspark local up) ...")
            pair = start_pair(work / "pair", timeout=900)
            url = pair.api_url
        try:
            target = Target(url.rstrip("/"), a.model)
            info = describe(target)
            model = info.model
            log(f"server {url}: model {model}, vLLM {info.runtime_version}")
            tokenizer = build_tokenizer(work / "tokenizer", a.vocab_size)
            jobs, keys = [], []
            for c in levels:
                for r in range(a.repeats):
                    n = c * a.rounds
                    trace = work / f"trace-c{c}-r{r}.jsonl"
                    write_trace(trace, n, a.input_len, a.output_len, first_hash=(c * 100 + r) * 1_000_000)
                    jobs.append(vllm_argv(url, model, tokenizer, trace, n, c, work, f"vllm-c{c}-r{r}.json"))
                    keys.append((c, r))
            log("deriving the token ids vllm bench serve will send ...")
            derived = dict(zip(keys, derive_prompts(jobs, work), strict=True))
            for (c, r), ps in derived.items():
                assert len(ps) == c * a.rounds and all(len(p) == a.input_len for p in ps), (c, r)
            # Untimed warm-up on both paths (first requests pay one-off costs).
            decode.run(target, decode.DecodeSpec(concurrency=(1,), output_len=16, input_len=a.input_len,
                                                 seed=int(time.time()), label="warmup"))

            rows = []
            for c in levels:
                runs = {"dspark": [], "vllm": []}
                for r in range(a.repeats):
                    order = ("vllm", "dspark") if r % 2 == 0 else ("dspark", "vllm")
                    for tool in order:
                        log(f"c={c} repeat {r}: {tool} ...")
                        if tool == "vllm":
                            res, srv = server_work(target, model, lambda c=c, r=r: run_vllm(
                                jobs[keys.index((c, r))], work / f"vllm-c{c}-r{r}.json"))
                        else:
                            res, srv = server_work(target, model, lambda c=c, r=r: run_dspark(
                                target, c, derived[(c, r)], a.output_len, a.input_len))
                        res["server"] = srv
                        res["prompt_set_sha256"] = prompts.set_fingerprint(
                            [prompts.fingerprint(p) for p in derived[(c, r)]])
                        runs[tool].append(res)
                d = statistics.median(x["tok_s"] for x in runs["dspark"])
                v = statistics.median(x["tok_s"] for x in runs["vllm"])
                # Each repeat's two runs ran back to back under the same background load: their
                # ratio is the fair one on a shared machine; the median over repeats is the figure.
                paired = [x["tok_s"] / y["tok_s"] for x, y in zip(runs["dspark"], runs["vllm"], strict=True)]
                rows.append({"concurrency": c, "dspark": runs["dspark"], "vllm": runs["vllm"],
                             "dspark_tok_s": d, "vllm_tok_s": v, "ratio_of_medians": d / v,
                             "paired_ratios": paired, "ratio": statistics.median(paired)})
        finally:
            if pair is not None:
                pair.stop(timeout=90)

    print(f"# dspark bench decode vs vllm bench serve: aggregate output tok/s "
          f"(input {a.input_len}, output {a.output_len} ignore_eos, temperature 0, "
          f"{a.rounds} round(s), {a.repeats} repeat(s), server {info.url}, vLLM {info.runtime_version})")
    print()
    print("| concurrency | dspark tok/s: median (runs) | vllm bench serve tok/s: median (runs) "
          "| ratio per repeat | ratio (median of repeats) | ratio of medians | in 0.95..1.05 |")
    print("|---:|---|---|---|---:|---:|:---:|")
    ok = True
    for row in rows:
        inside = TARGET[0] <= row["ratio"] <= TARGET[1]
        ok &= inside
        ds = ", ".join(f"{x['tok_s']:.1f}" for x in row["dspark"])
        vs = ", ".join(f"{x['tok_s']:.1f}" for x in row["vllm"])
        pr = ", ".join(f"{x:.3f}" for x in row["paired_ratios"])
        print(f"| {row['concurrency']} | {row['dspark_tok_s']:.1f} ({ds}) | {row['vllm_tok_s']:.1f} ({vs}) | {pr} | "
              f"{row['ratio']:.3f} | {row['ratio_of_medians']:.3f} | {'yes' if inside else 'NO'} |")
    print()
    print("Server-side work per run (prompt tokens / generation tokens / finished requests / prefix-cache hits"
          " / vLLM's summed end-to-end request latency vs the client's run duration x concurrency):")
    for row in rows:
        for tool in ("dspark", "vllm"):
            srv = "; ".join(f"{x['server']['prompt_tokens']:.0f} / {x['server']['generation_tokens']:.0f} / "
                            f"{x['server']['requests']:.0f} / {x['server']['prefix_cache_hits']:.0f} / "
                            + (f"{x['server']['e2e_sum_s']:.2f} s vs {x['duration_s'] * row['concurrency']:.2f} s"
                               if x['server'].get('e2e_sum_s') is not None else "n/a")
                            for x in row[tool])
            print(f"- c={row['concurrency']} {tool}: {srv}")
    print("(the supervisor's liveness probe adds 1 prompt and 1 generation token whenever it finds the engine idle)")
    if a.json:
        a.json.write_text(json.dumps({"rows": rows, "args": {k: str(v) for k, v in vars(a).items()}}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
