"""The serving settings against the runtime lines the nodes may run: the line exists and honours
the settings (`runtime_line_problems`), and a user's CUDA-graph capture sizes leave no decode batch
without a FULL graph (`graph_coverage_problems`).
"""

from __future__ import annotations

import dataclasses

from dspark.config.schema import ServingConfig
from dspark.config.toml import toml_key


def runtime_line_problems(s: ServingConfig) -> list[str]:
    """The runtime line exists and honours the settings (dspark.lines.runtime says how each line
    names them, and why it refuses one)."""
    from dspark.lines import runtime as runtime_lines

    lines = runtime_lines.load()
    p: list[str] = []
    for line, command in s.line_commands.items():
        where = f"serving.line_commands.{toml_key(line)}"
        if line not in lines.lines:
            p.append(runtime_lines.unknown_line_message(line, lines).replace("serving.runtime_line", where))
        elif not command or not command[0]:
            p.append(f"{where}: must name that line's vLLM CLI, e.g. [\"/opt/dspark/lines/{line}/bin/vllm\"]")
        elif line == s.runtime_line and command != s.vllm_command:
            p.append(f"{where}: differs from serving.vllm_command, which is the command of the file's own line "
                     f"({line}); make them the same or drop this entry")
    if s.runtime_line not in lines.lines:
        return p + [runtime_lines.unknown_line_message(s.runtime_line, lines)]
    return p + runtime_lines.refusals(s.runtime_line, {k: getattr(s, k) for k in runtime_lines.SETTINGS}, lines)


def graph_coverage_problems(s: ServingConfig) -> list[str]:
    """A user's capture sizes (or largest size) leave no decode batch without a FULL CUDA graph:
    every target verify batch and every DSpark draft batch of 1..max_num_seqs requests, as
    vLLM's model runner v2 dispatches them on each line the nodes may run (dspark.engine.graph_dispatch,
    proven against vLLM's own managers in tests/overlay/test_graph_grid.py). dspark's own list
    covers every batch; without graphs (--enforce-eager) there is nothing to cover."""
    from dspark.engine import graph_dispatch as G
    from dspark.lines import runtime as runtime_lines

    given = s.cudagraph_capture_sizes
    if given is None and s.max_cudagraph_capture_size is None or "--enforce-eager" in s.extra_args:
        return []
    whole = [x for x in (given or []) + [s.max_cudagraph_capture_size or 1, s.max_num_seqs,
                                           s.max_num_batched_tokens]
             if not isinstance(x, int) or isinstance(x, bool) or x < 1]
    k = s.speculative_config.get("num_speculative_tokens", 0) if s.speculative_config else 0
    if given == [] or whole or not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= 64 \
            or (given and s.max_cudagraph_capture_size not in (None, max(given))):
        return []  # reported on their own
    draft_q = G.draft_query_len(s.speculative_config)
    known = runtime_lines.load().lines
    releases = sorted({known[line].vllm for line in {s.runtime_line, *s.line_commands} if line in known})

    def sizes_of(serving: ServingConfig) -> list[int]:
        """What vLLM captures from the flags render writes (--cudagraph-capture-sizes, else
        --max-cudagraph-capture-size)."""
        rendered = serving.capture_sizes
        return G.vllm_sizes(rendered, None if rendered is not None else serving.cudagraph_capture_size,
                            max_num_seqs=serving.max_num_seqs, max_num_batched_tokens=serving.max_num_batched_tokens)

    def gaps_of(sizes: list[int]) -> dict[tuple[str, int], tuple[G.Batch, str]]:
        gaps: dict[tuple[str, int], tuple[G.Batch, str]] = {}
        for release in releases:
            for role, rows in G.uncovered(sizes, s.max_num_seqs, k, draft_q, release).items():
                for b in rows:
                    gaps.setdefault((role, b.reqs), (b, release))
        return gaps

    sizes = sizes_of(s)
    gaps = gaps_of(sizes)
    if not gaps:
        return []
    names = {"target": "verify", "draft": "DSpark draft"}
    said = "; ".join(
        f"{names[role]} batches of {G.ranges([n for r, n in gaps if r == role])} requests "
        f"({', '.join(sorted({f'{b.mode} on {v}' for (r, _), (b, v) in gaps.items() if r == role}))})"
        for role in ("target", "draft") if any(r == role for r, _ in gaps))
    where = "cudagraph_capture_sizes" if given is not None else "max_cudagraph_capture_size"
    if given is not None:
        add = G.sizes_to_add(sizes, s.max_num_seqs, k, draft_q, releases)
        fix = f"add {', '.join(map(str, add))} to it, or remove it for dspark's list"
    else:
        # The smallest largest size that covers every batch (vLLM's own list, which dspark leaves
        # without speculative decoding, steps by 8 up to 256, then by 16).
        top = s.max_num_seqs * (k + 1)
        enough = next((m for m in range(top, top + 17)
                       if not gaps_of(sizes_of(dataclasses.replace(s, max_cudagraph_capture_size=m)))), None)
        if enough is None:  # no largest size does (vLLM drops FULL graphs above max_num_seqs' tokens)
            whole_list = sorted(set(sizes) | set(G.sizes_to_add(sizes, s.max_num_seqs, k, draft_q, releases)))
            fix = f"set cudagraph_capture_sizes = [{', '.join(map(str, whole_list))}] instead"
        else:
            fix = f"raise it to {enough}" + (", or remove it for dspark's list" if k and enough == top else "")
    return [f"serving.{where}: leaves {said} without a FULL CUDA graph (vLLM's model runner v2 replays "
            f"one only at a captured size of at least a batch's tokens, rounded to whole requests); {fix}"]
