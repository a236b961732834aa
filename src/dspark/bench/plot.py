"""PNG plots of a report. matplotlib is imported here, lazily, with the Agg backend (no
display needed), so the rest of the bench runs without it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from dspark.bench.report import Report

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def workload(report: Report) -> str:
    """The plot's second title line: what was sent, so a figure read alone says what it measured."""
    p = report.params
    if report.kind == "prefill":
        return (f"{p.get('trials')} trial(s) per input length, each 1 output token; medians; seed {p.get('seed')}")
    c = p.get("concurrency") or []
    rounds = p.get("rounds") or 1
    per_level = ", ".join(str(x * rounds) for x in c)
    return (f"input {p.get('input_len')} tok, output {p.get('output_len')} tok per request; "
            f"requests per level {per_level} ({rounds} round(s) x streams); seed {p.get('seed')}")


def _samples(report: Report) -> dict[int, tuple[int, int]]:
    """Per decode level: (requests, inter-token gaps) behind its figures."""
    out: dict[int, tuple[int, int]] = {}
    for r in report.trials:
        if getattr(r, "role", None) == "trial" and hasattr(r, "itl_s"):
            n, gaps = out.get(r.concurrency, (0, 0))
            out[r.concurrency] = (n + 1, gaps + len(r.itl_s))
    return out


def _label_points(ax: Axes, xs: Sequence[int], ys: Sequence[float | None], labels: Sequence[str]) -> None:
    for x, y, text in zip(xs, ys, labels, strict=True):
        if y is not None:
            ax.annotate(text, (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)


def plot(report: Report, path: Path) -> Path | None:
    """Write the plot; None when there is nothing to plot yet."""
    fig = figure(report)
    if fig is None:
        return None
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def figure(report: Report) -> Figure | None:
    """The report's matplotlib figure (None when there is nothing to plot yet)."""
    if not report.summary:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    title = f"dspark bench {report.kind}: {report.label} (vLLM {report.server.get('runtime_version')})"
    if not report.complete:
        title += " INCOMPLETE"
    fig.suptitle(title + "\n" + workload(report), fontsize=10)
    if report.kind == "prefill":
        xs = [s.length for s in report.summary]
        client = [s.client_input_tok_s for s in report.summary]
        server = [s.server_prefill_tok_s for s in report.summary]
        ttft = [None if s.ttft_s is None else s.ttft_s * 1000 for s in report.summary]
        clean = [s.trials - s.prefix_cache_hit_trials for s in report.summary]
        left.plot(xs, client, "o-", label="client input tok/s")
        left.plot(xs, server, "s--", label="server prefill tok/s")
        _label_points(left, xs, server, [f"n={s.server_valid_trials}" for s in report.summary])
        left.set_ylabel("tokens / s (median of n trials)")
        right.plot(xs, ttft, "o-")
        _label_points(right, xs, ttft, [f"n={n}" for n in clean])
        right.set_ylabel("TTFT median (ms) of n trials")
        for ax in (left, right):
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [f"{x // 1024}K" if x % 1024 == 0 else str(x) for x in xs])
            ax.set_xlabel("input tokens")
    else:
        xs = [s.concurrency for s in report.summary]
        samples = _samples(report)
        agg = [s.aggregate_tok_s for s in report.summary]
        left.plot(xs, agg, "o-", label="aggregate tok/s")
        left.plot(xs, [s.decode_tok_s_median for s in report.summary], "s--", label="per-stream tok/s (median)")
        _label_points(left, xs, agg, [f"n={samples.get(x, (s.requests, 0))[0]} req"
                                      for x, s in zip(xs, report.summary, strict=True)])
        left.set_ylabel("output tokens / s")
        for q in ("p50", "p90", "p99"):
            vals = [getattr(s, f"itl_s_{q}") for s in report.summary]
            right.plot(xs, [None if v is None else v * 1000 for v in vals], "o-", label=f"ITL {q}")
            if q == "p99":
                _label_points(right, xs, [None if v is None else v * 1000 for v in vals],
                              [f"n={samples.get(x, (0, 0))[1]} gaps" for x in xs])
        right.set_ylabel("inter-token latency (ms) over n gaps")
        right.legend()
        for ax in (left, right):
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.set_xlabel("concurrent streams")
    left.legend()
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    return fig
