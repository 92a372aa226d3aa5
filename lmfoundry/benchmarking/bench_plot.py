"""The plot of `lmfoundry bench` results: throughput and latency against concurrency, one line per
server (also drawn by benchmarks/serve_peers.py for several servers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(results: list[dict[str, Any]], path: Path, labels: list[str] | None = None) -> None:
    """Throughput and latency against concurrency, one line per result set (server)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tp, ax_lat) = plt.subplots(1, 2, figsize=(11, 4.2))
    ticks: set[int] = set()
    for k, res in enumerate(results):
        name = (labels[k] if labels else None) or res.get("model", "")
        xs = [lv["concurrency"] for lv in res["levels"]]
        ticks.update(xs)
        color = f"C{k}"  # one colour per server; line style tells the metric
        ax_tp.plot(xs, [lv["output_tokens_per_s"] for lv in res["levels"]], marker="o", color=color, label=name)
        for key, style, stat in (("ttft_s", "-", "p95"), ("e2e_s", "--", "p95"), ("itl_s", ":", "p50")):
            ys = [lv[key][stat] for lv in res["levels"]]
            ax_lat.plot(xs, [y if y is not None else float("nan") for y in ys], style, marker="o", color=color,
                        label=f"{name} {key[:-2].upper()} {stat}")
    ax_tp.set(xlabel="concurrency", ylabel="output tokens / s", title="Throughput", xscale="log")
    ax_lat.set(xlabel="concurrency", ylabel="seconds", title="Latency", xscale="log", yscale="log")
    for ax in (ax_tp, ax_lat):
        ax.set_xticks(sorted(ticks), [str(t) for t in sorted(ticks)])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
