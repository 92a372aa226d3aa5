"""The human side of eval-gate: a short markdown report and one plot.

The plot puts every gated metric on one axis as candidate/baseline (accuracy recovery, perplexity
ratio) with its interval and threshold, so a reviewer sees at a glance which metric sits where
relative to its bar, and how sure the gate is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLORS = {"pass": "#2e7d32", "fail": "#c62828", "inconclusive": "#ef6c00"}


def _rule(m: dict[str, Any]) -> str:
    op = ">=" if m["higher_is_better"] else "<="
    return f"{m['statistic']} {op} {m['threshold']:g}"


def write_plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gated = [m for m in report["metrics"] if m["gated"]]
    fig, ax = plt.subplots(figsize=(7.5, 0.55 * len(gated) + 1.6), dpi=110)
    for y, m in enumerate(reversed(gated)):
        color = COLORS[m["verdict"]]
        lo, hi = m["low"], m["high"]
        ax.plot([lo, hi], [y, y], color=color, lw=3, solid_capstyle="butt")
        ax.plot([m["point"]], [y], "o", color=color)
        ax.plot([m["threshold"]] * 2, [y - 0.35, y + 0.35], color="black", lw=1.5)
        side = 1 if m["higher_is_better"] else -1
        ax.annotate("", xy=(m["threshold"] + side * 0.01, y + 0.3), xytext=(m["threshold"], y + 0.3),
                    arrowprops={"arrowstyle": "->", "lw": 0.8})
    ax.set_yticks(range(len(gated)))
    ax.set_yticklabels([f"{m['name']}\n({_rule(m)})" for m in reversed(gated)], fontsize=7)
    ax.axvline(1.0, color="grey", lw=0.6, ls=":")
    ax.set_xlabel("candidate / baseline (point and %d%% paired bootstrap interval; bar = threshold, "
                  "arrow = allowed side)" % round(100 * report["gate"]["confidence"]), fontsize=7)
    ax.set_title(f"eval-gate: {report['verdict'].upper()}  ({report['gate']['name']}, tier {report['gate']['tier']})",
                 color=COLORS[report["verdict"]], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None, "Creation Time": None})
    plt.close(fig)


def write_markdown(report: dict[str, Any], path: Path, plot_name: str) -> None:
    g, c, b = report["gate"], report["candidate"], report["baseline"]
    lines = [
        f"# eval-gate: **{report['verdict'].upper()}** (exit code {report['exit_code']})",
        "",
        f"- candidate: `{c['spec']}` (sha256 {c['sha256'][:16]})",
        f"- baseline: `{b['spec']}` (sha256 {b['sha256'][:16]})",
        f"- gate: `{g['name']}` ({g['file']}, sha256 {g['sha256'][:16]}), tier `{g['tier']}`, seed {g['seed']}, "
        f"{round(100 * g['confidence'])}% paired bootstrap with {g['resamples']} resamples",
        f"- prompt: BOS {report['prompt']['add_bos']} (prepended: {c['prompt']['bos_prepended']}), "
        f"chat template {'on' if report['prompt']['chat_template'] else 'off'}, "
        f"{report['prompt']['num_fewshot']}-shot",
        f"- rule: {g['rule']}",
        "",
        "| metric | n | baseline | candidate | statistic | interval | threshold | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in report["metrics"]:
        if m["gated"]:
            verdict = m["verdict"]
            if verdict == "inconclusive":
                verdict += f" (~{m['samples_needed']} docs to decide)" if m["samples_needed"] else " (on the threshold)"
            lines.append(f"| {m['name']} | {m['n']} | {m['baseline']:.4f} | {m['candidate']:.4f} | "
                         f"{m['statistic']} {m['point']:.4f} | [{m['low']:.4f}, {m['high']:.4f}] | "
                         f"{_rule(m)} | **{verdict}** |")
        elif "candidate" in m:
            lines.append(f"| {m['name']} | {m['n']} | {m['baseline']:.4f} | {m['candidate']:.4f} | | | "
                         f"(reported only) | |")
    lines += ["", f"![gated metrics]({plot_name})", ""]
    if report["failing"]:
        lines.append(f"Failing: {', '.join(report['failing'])}.")
    if report["inconclusive"]:
        lines.append("Inconclusive: " + ", ".join(
            f"{x['name']} (about {x['samples_needed']} documents would decide it)" if x["samples_needed"]
            else f"{x['name']} (point estimate on the threshold)" for x in report["inconclusive"]) + ".")
    v = report["versions"]
    lines += ["", f"lm-eval {v.get('lm-eval')}, torch {v.get('torch')}, transformers {v.get('transformers')}, "
              f"lmfoundry {v.get('lmfoundry')}. Full numbers: eval-gate.json.", ""]
    path.write_text("\n".join(lines))
