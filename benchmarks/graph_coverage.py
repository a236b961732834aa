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


def patched_copy(dest: Path, overlay_dir: Path, source: Path | None = None) -> Path:
    """A copy of the installed vLLM tree (or of the site directory ``source``) with the overlay
    series (a directory or a series file) applied."""
    from dspark.lines.overlay import apply_series

    source = source or _site_packages()
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
        from tests.overlay import b12x_standin

        standin = b12x_standin.write_package(tmp / "standin")
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1",
                   PYTHONPATH=os.pathsep.join(map(str, (site, standin, REPO / "src"))))
        env.pop("PYTHONWARNINGS", None)
        r = subprocess.run([sys.executable, "-m", "tests.overlay.coverage_checks", str(site), str(cluster)],
                           capture_output=True, text=True, env=env, timeout=timeout, check=False, cwd=REPO)
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


# --------------------------------------------------------------------------- the S x k grid
GRID_SEQS = range(1, 65)
GRID_K = range(1, 8)
GRID_CHECKS = OVERLAY_TESTS / "graph_grid_checks.py"
GRID_MARKS = {"exact": ".", "padded": "p", "eager": "x"}


def grid_cases() -> list[dict]:
    """Each grid point twice: the former rule (multiples of k + 1 only) and dspark's list now
    (ServingConfig.capture_sizes, what render passes as --cudagraph-capture-sizes)."""
    from dspark.config.schema import ServingConfig

    out = []
    for s in GRID_SEQS:
        for k in GRID_K:
            now = ServingConfig(max_num_seqs=s, speculative_config={"method": "dspark", "num_speculative_tokens": k})
            for kind, sizes in (("before", list(range(k + 1, s * (k + 1) + 1, k + 1))),
                                ("now", now.capture_sizes)):
                out.append({"S": s, "k": k, "kind": kind, "sizes": sizes, "max": None,
                            "mnbt": now.max_num_batched_tokens})
    return out


def grid_lines() -> dict[str, tuple[Path, str]]:
    """line -> (its vLLM site directory, its Python) for each runtime line installed here: the
    default line in this environment, the others under dspark.local.cluster.lines_dir()."""
    from dspark.lines import runtime as runtime_lines
    from dspark.local.cluster import lines_dir

    lines = runtime_lines.load()
    out = {lines.default: (_site_packages(), sys.executable)}
    for line in lines.lines:
        found = sorted((lines_dir() / line).glob("lib/python3*/site-packages"))
        if line != lines.default and found and (found[0] / "vllm").is_dir():
            out[line] = (found[0], str(found[0].parents[2] / "bin" / "python"))
    return out


def collect_grid(line: str, timeout: float = 1800) -> dict:
    """Every grid case through vLLM's own managers (graph_grid_checks.py) on a copy of the line's
    vLLM with the line's series applied, in the line's Python."""
    from dspark.lines.overlay import line_series

    installed = grid_lines()
    if line not in installed:
        return {"error": f"runtime line {line} is not installed here (.ci/setup installs the lines)"}
    source, python = installed[line]
    todo = grid_cases()
    with tempfile.TemporaryDirectory(prefix="graph-grid-") as tmp:
        tmp = Path(tmp)
        site = patched_copy(tmp / "site", line_series(line), source=source)
        cases = tmp / "cases.json"
        cases.write_text(json.dumps(todo))
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1",
                   PYTHONPATH=str(site))
        env.pop("PYTHONWARNINGS", None)
        r = subprocess.run([python, "-m", "tests.overlay.graph_grid_checks", str(site), str(cases)],
                           capture_output=True, text=True, env=env, timeout=timeout, check=False, cwd=REPO)
    for out in r.stdout.splitlines():
        if out.startswith("@@RESULTS@@"):
            return {"line": line, "cases": todo, "results": json.loads(out[len("@@RESULTS@@"):])}
    return {"error": f"graph_grid_checks.py did not report (exit {r.returncode}):\n{r.stderr[-4000:]}"}


def grid_verdict(case: dict, got: dict, role: str) -> str:
    """'exact': every batch of 1..S replays a FULL graph of its own tokens; 'padded': every one
    replays FULL, some at a larger size; 'eager': some batch runs PIECEWISE or eagerly."""
    q = case["k"] + 1 if role == "target" else got["draft q_len"]
    rows = got[role]
    if any(mode != "FULL" for mode, _ in rows):
        return "eager"
    return "exact" if all(tokens == n * q for n, (_, tokens) in enumerate(rows, 1)) else "padded"


def grid_summary(result: dict) -> dict:
    """Per kind (before, now) and role: how many grid points are exact, padded, eager; and the
    graphs the managers would capture, summed over the grid."""
    out: dict = {}
    for case, got in zip(result["cases"], result["results"], strict=True):
        kind = out.setdefault(case["kind"], {"points": 0, "graphs": {"target": 0, "draft": 0}})
        kind["points"] += 1
        for role in ("target", "draft"):
            verdict = grid_verdict(case, got, role)
            kind.setdefault(role, {"exact": 0, "padded": 0, "eager": 0})[verdict] += 1
            kind["graphs"][role] += got["graphs"][role]
    return out


def grid_report(result: dict) -> str:
    by = {(c["kind"], c["S"], c["k"]): g for c, g in zip(result["cases"], result["results"], strict=True)}
    cases = {(c["kind"], c["S"], c["k"]): c for c in result["cases"]}
    lines = [f"line {result['line']}: DSpark draft batches of 1..S requests, S = {GRID_SEQS[0]}..{GRID_SEQS[-1]} "
             f"(columns) x k = {GRID_K[0]}..{GRID_K[-1]} (rows); '.' every batch in a FULL graph of its own "
             "tokens, 'p' every batch FULL, some padded, 'x' some batch PIECEWISE or eager"]
    for kind in ("before", "now"):
        lines.append(f"{kind}:")
        for k in GRID_K:
            marks = "".join(GRID_MARKS[grid_verdict(cases[kind, s, k], by[kind, s, k], "draft")] for s in GRID_SEQS)
            lines.append(f"  k={k} {marks}")
    summary = grid_summary(result)
    for kind in ("before", "now"):
        f = summary[kind]
        lines.append(
            f"{kind}: draft: {f['draft']['exact'] + f['draft']['padded']} of {f['points']} points every batch "
            f"FULL ({f['draft']['exact']} exact); target verify: {f['target']['exact'] + f['target']['padded']} "
            f"FULL ({f['target']['exact']} exact); graphs over the grid: target {f['graphs']['target']}, "
            f"draft {f['graphs']['draft']}")
    return "\n".join(lines)


def grid_goal_met(result: dict) -> bool:
    f = grid_summary(result)["now"]
    return f["draft"]["exact"] == f["target"]["exact"] == f["points"]


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
    ap.add_argument("config", type=Path, nargs="?", help="cluster file (for example the one 'dspark config "
                    "init' writes, or tests/fixtures/cluster-two-node.toml)")
    ap.add_argument("--grid", action="store_true",
                    help="instead of a cluster file: the S x k grid (max_num_seqs 1..64 x speculative tokens "
                    "1..7, DSpark) through vLLM's own managers on each installed runtime line, the former "
                    "capture sizes (multiples of k + 1) beside dspark's list now; exit 0 when now every "
                    "verify and draft batch replays a FULL graph of its own tokens at every point")
    ap.add_argument("--line", action="append", help="with --grid: this runtime line only (repeatable; "
                    "default: every line installed here)")
    ap.add_argument("--overlay-dir", type=Path, default=REPO / "overlay",
                    help="patch series to apply to the copy of vLLM (default: overlay/)")
    ap.add_argument("--json", action="store_true", help="print the whole result as JSON")
    args = ap.parse_args(argv)
    if args.grid:
        if args.config is not None:
            ap.error("give a cluster file or --grid, not both")
        return grid_main(args.line or list(grid_lines()), args.json)
    if args.config is None:
        ap.error("a cluster file (or --grid) is needed")
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


def grid_main(lines: list[str], as_json: bool) -> int:
    results = []
    for line in lines:
        result = collect_grid(line)
        if "error" in result:
            print(result["error"], file=sys.stderr)
            return 2
        results.append(result)
        if not as_json:
            print(grid_report(result), flush=True)
    if as_json:
        print(json.dumps([{"line": r["line"], "summary": grid_summary(r), "cases": r["cases"],
                           "results": r["results"]} for r in results]))
    return 0 if all(grid_goal_met(r) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
