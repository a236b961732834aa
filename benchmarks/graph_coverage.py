#!/usr/bin/env python3
"""Graph and warm-up coverage of a cluster file's serving settings, through vLLM's own code.

For a cluster file, builds the real VllmConfig of the head's vLLM command line on this
machine's CPU build of vLLM (in a subprocess, on a copy of vLLM with the Spark overlay
applied, the SM12x capability family simulated) and reports:

  (a) which decode shapes replay a CUDA graph, as vLLM's own CudaGraphManager dispatches
      them: target verify batches (q_len = k + 1) and DSpark draft batches (the
      speculator's own query length), for 1..max_num_seqs requests;
  (b) which token counts the b12x MoE experts plan before READY (vLLM's b12x warm-up and
      the graph capture's forwards) against those serving reaches (every batch size the
      scheduler can send, padded as dispatch pads it), with a b12x stand-in that records
      every plan call.

The goal for the defaults: every decode shape in a graph, no plan after READY.
Exit status: 0 the goal holds, 1 it does not, 2 the report could not be made.
Needs .ci/setup (vLLM's CPU build and the pinned b12x sources); takes several minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OVERLAY_TESTS = REPO / "tests" / "overlay"
CHECKS = OVERLAY_TESTS / "coverage_checks.py"


def _ranges(values: list[int]) -> str:
    """1,2,3,5,7,8 -> '1-3, 5, 7-8'."""
    out, run = [], []
    for v in sorted(values):
        if run and v == run[-1] + 1:
            run.append(v)
            continue
        if run:
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [v]
    if run:
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ", ".join(out) or "none"


def _site_packages() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise SystemExit("graph_coverage: vLLM is not installed here (run .ci/setup)")
    return Path(spec.origin).resolve().parents[1]


def stock_tree():
    """tests/overlay/stock_tree.py, loaded by path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("dspark_stock_tree", REPO / "tests" / "overlay" / "stock_tree.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def patched_copy(dest: Path, overlay_dir: Path) -> Path:
    """A copy of the installed vLLM tree with the overlay series applied."""
    sys.path.insert(0, str(REPO / "src"))
    from dspark.overlay import apply_series

    source = _site_packages()
    shutil.copytree(source / "vllm", dest / "vllm", ignore=shutil.ignore_patterns("__pycache__"))
    for dist in source.glob("vllm*.dist-info"):
        shutil.copytree(dist, dest / dist.name)
    stock_tree().make_stock(dest)  # the local series .ci/setup applies to the installed tree, reversed
    apply_series(dest, overlay_dir)
    return dest


def collect(cluster: Path, overlay_dir: Path = REPO / "overlay", site: Path | None = None,
            timeout: float = 3600) -> dict:
    """Run coverage_checks.py on a patched copy (or on ``site``) and return its result."""
    with tempfile.TemporaryDirectory(prefix="graph-coverage-") as tmp:
        tmp = Path(tmp)
        if site is None:
            site = patched_copy(tmp / "site", overlay_dir)
        sys.path.insert(0, str(OVERLAY_TESTS))
        import b12x_standin

        standin = b12x_standin.write_package(tmp / "standin")
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1",
                   PYTHONPATH=os.pathsep.join(map(str, (site, standin, OVERLAY_TESTS, REPO / "src"))))
        env.pop("PYTHONWARNINGS", None)
        r = subprocess.run([sys.executable, str(CHECKS), str(site), str(cluster)],
                           capture_output=True, text=True, env=env, timeout=timeout, check=False)
    for line in r.stdout.splitlines():
        if line.startswith("@@RESULTS@@"):
            return json.loads(line[len("@@RESULTS@@"):])
    return {"error": f"coverage_checks.py did not report (exit {r.returncode}):\n{r.stderr[-4000:]}"}


def summarize(result: dict) -> dict:
    """The headline figures of a coverage result."""
    graphs, b = result["graphs"], result["b12x"]
    reach = result["reachable"]
    late = {role: sorted(int(t) for t in b["late"][role]) for role in ("target", "draft")}
    counts = [("target", t) for t in reach["target"]] + [("draft", t) for t in reach["draft"]]
    before = [c for c in counts if c[1] not in late[c[0]]]
    return {
        "target_in_graph": sum(x["graph"] for x in graphs["target"]),
        "target_shapes": len(graphs["target"]),
        "draft_in_graph": sum(x["graph"] for x in graphs["draft"]),
        "draft_shapes": len(graphs["draft"]),
        "planned_before_ready": len(before),
        "reachable": len(counts),
        "plan_calls_after_ready": b["plan_calls_after_ready"],
        "late": late,
    }


def report(result: dict) -> str:
    s = result["settings"]
    g = result["graphs"]
    f = summarize(result)
    lines = [
        f"settings: max_num_seqs {s['max_num_seqs']}, max_num_batched_tokens "
        f"{s['max_num_batched_tokens']}, k {s['num_speculative_tokens']}, cudagraph mode "
        f"{s['cudagraph_mode']}, capture sizes {_ranges(s['capture_sizes'])}",
        f"attention graph support: target {s['attention_cg_support']['target']}, "
        f"draft {s['attention_cg_support']['draft']}",
        f"graphs captured: target {g['target_capture']}; draft {g['draft_capture']} "
        f"(draft dispatch q_len {g['draft_q_len']})",
        "",
        "reqs  target verify (tokens -> mode, padded)   draft (tokens -> mode, padded)",
    ]
    for i, t in enumerate(g["target"]):
        d = g["draft"][i] if i < len(g["draft"]) else None
        dcol = f"{d['tokens']:>4} -> {d['mode']:<9} {d['padded_tokens']:>4}" if d else "-"
        lines.append(f"{t['reqs']:>4}  {t['tokens']:>4} -> {t['mode']:<9} {t['padded_tokens']:>4}"
                     f"{'':17}{dcol}")
    reach = result["reachable"]
    b = result["b12x"]
    lines += [
        "",
        f"b12x token counts reachable while serving: target {len(reach['target'])} "
        f"({_ranges(reach['target'])}); draft {len(reach['draft'])} ({_ranges(reach['draft'])})",
        f"planned by the warm-up: {_ranges(b['warmup_plans'])}; by graph capture: "
        f"{_ranges(b['capture_plans'])}",
        f"planned after READY: target {_ranges(f['late']['target'])}; draft "
        f"{_ranges(f['late']['draft'])} ({f['plan_calls_after_ready']} plan calls)",
        "",
        f"target decode shapes in a graph: {f['target_in_graph']}/{f['target_shapes']}; "
        f"draft: {f['draft_in_graph']}/{f['draft_shapes']}; b12x token counts planned before "
        f"READY: {f['planned_before_ready']} of {f['reachable']} reachable",
    ]
    return "\n".join(lines)


def goal_met(result: dict) -> bool:
    f = summarize(result)
    return (f["target_in_graph"] == f["target_shapes"] and f["draft_in_graph"] == f["draft_shapes"]
            and f["plan_calls_after_ready"] == 0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="graph_coverage.py",
        description=__doc__.split("\n\n")[0].rstrip(".") + ". Prints which decode shapes replay a CUDA "
        "graph and which b12x token counts are planned before READY versus reachable while "
        "serving; exit 0 when every decode shape is in a graph and nothing is planned after "
        "READY, 1 when not, 2 when the report could not be made.",
    )
    ap.add_argument("config", type=Path, help="cluster file (for example the one 'dspark config "
                    "init' writes, or tests/fixtures/cluster-two-node.toml)")
    ap.add_argument("--overlay-dir", type=Path, default=REPO / "overlay",
                    help="patch series to apply to the copy of vLLM (default: overlay/)")
    ap.add_argument("--json", action="store_true", help="print the whole result as JSON")
    args = ap.parse_args(argv)
    if not args.config.is_file():
        print(f"graph_coverage: no such file: {args.config}", file=sys.stderr)
        return 2
    result = collect(args.config.resolve(), args.overlay_dir.resolve())
    if "error" in result:
        print(result["error"], file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**result, "summary": summarize(result)}, indent=1))
    else:
        print(report(result))
    return 0 if goal_met(result) else 1


if __name__ == "__main__":
    sys.exit(main())
