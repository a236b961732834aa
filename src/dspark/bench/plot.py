"""PNG plots of a report. matplotlib is imported here, lazily, with the Agg backend (no
display needed), so the rest of the bench runs without it."""

from __future__ import annotations

from pathlib import Path

from .report import Report


def plot(report: Report, path: Path) -> Path | None:
    """Write the plot; None when there is nothing to plot yet."""
    if not report.summary:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    title = f"dspark bench {report.kind}: {report.label} (vLLM {report.server.get('runtime_version')})"
    if not report.complete:
        title += " INCOMPLETE"
    fig.suptitle(title)
    if report.kind == "prefill":
        xs = [s.length for s in report.summary]
        left.plot(xs, [s.client_input_tok_s for s in report.summary], "o-", label="client input tok/s")
        left.plot(xs, [s.server_prefill_tok_s for s in report.summary], "s--", label="server prefill tok/s")
        left.set_ylabel("tokens / s")
        right.plot(xs, [None if s.ttft_s is None else s.ttft_s * 1000 for s in report.summary], "o-")
        right.set_ylabel("TTFT median (ms)")
        for ax in (left, right):
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [f"{x // 1024}K" if x % 1024 == 0 else str(x) for x in xs])
            ax.set_xlabel("input tokens")
    else:
        xs = [s.concurrency for s in report.summary]
        left.plot(xs, [s.aggregate_tok_s for s in report.summary], "o-", label="aggregate tok/s")
        left.plot(xs, [s.decode_tok_s_median for s in report.summary], "s--", label="per-stream tok/s (median)")
        left.set_ylabel("output tokens / s")
        for q in ("p50", "p90", "p99"):
            vals = [getattr(s, f"itl_s_{q}") for s in report.summary]
            right.plot(xs, [None if v is None else v * 1000 for v in vals], "o-", label=f"ITL {q}")
        right.set_ylabel("inter-token latency (ms)")
        right.legend()
        for ax in (left, right):
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.set_xlabel("concurrent streams")
    left.legend()
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
