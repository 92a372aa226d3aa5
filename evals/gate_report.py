"""The human side of eval-gate: a short markdown report and one plot.

The plot puts every gated statistic on one axis as a multiple of its threshold (accuracy recovery,
perplexity ratio, KL divergence, same-top rate, ...: all meet their bar at 1), with its interval,
so a reviewer sees at a glance which statistic sits where relative to its bar, and how sure the
gate is. The markdown adds llama.cpp's KL-divergence table and the generative check's answers.
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
        scale = m["threshold"]
        ax.plot([m["low"] / scale, m["high"] / scale], [y, y], color=color, lw=3, solid_capstyle="butt")
        ax.plot([m["point"] / scale], [y], "o", color=color)
        side = 1 if m["higher_is_better"] else -1
        ax.annotate("", xy=(1 + side * 0.05, y + 0.3), xytext=(1, y + 0.3), arrowprops={"arrowstyle": "->", "lw": 0.8})
    ax.set_yticks(range(len(gated)))
    ax.set_yticklabels([f"{m['name']}\n({_rule(m)})" for m in reversed(gated)], fontsize=7)
    ax.axvline(1.0, color="black", lw=1.2)
    ax.set_xlabel("statistic / its threshold (point and %d%% paired bootstrap interval; line = threshold, "
                  "arrow = allowed side)" % round(100 * report["gate"]["confidence"]), fontsize=7)
    ax.set_title(f"eval-gate: {report['verdict'].upper()}  ({report['gate']['name']}, tier {report['gate']['tier']})",
                 color=COLORS[report["verdict"]], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None, "Creation Time": None})
    plt.close(fig)


def _divergence_table(d: dict[str, Any] | None) -> list[str]:
    """llama.cpp `--kl-divergence` style: the per-token distribution of KL and Δp."""
    if not d:
        return []
    return ["## Next-token distributions (candidate against baseline, per token)", "",
            f"{d['tokens']} tokens. KL divergence over the baseline's top-k tokens plus one rest bucket "
            f"(a lower bound of the full-vocabulary KL; the baseline's mean mass outside its top-k: "
            f"{d['mean_rest_mass']:.2e}).", "",
            "| statistic | value |", "|---|---|",
            f"| mean KLD | {d['mean_kld']:.6f} |", f"| median KLD | {d['median_kld']:.6f} |",
            f"| p99 KLD | {d['p99_kld']:.6f} |", f"| max KLD | {d['max_kld']:.6f} |",
            f"| same top token | {100 * d['same_top']:.2f} % |", f"| RMS Δp | {100 * d['rms_delta_p']:.3f} % |",
            f"| mean Δp | {100 * d['mean_delta_p']:.3f} % |", ""]


def _generation_table(answers: list[dict[str, Any]] | None) -> list[str]:
    if not answers:
        return []
    lines = ["## Greedy answers (candidate against baseline)", "",
             "| prompt | kind | same tokens | baseline tokens | identical | valid (baseline / candidate) |",
             "|---|---|---|---|---|---|"]
    for a in answers:
        valid = "" if a["baseline_valid"] is None else f"{a['baseline_valid']} / {a['candidate_valid']}"
        lines.append(f"| {a['id']} | {a['kind']} | {a['same_until']} | {a['tokens']} | {a['identical']} | {valid} |")
    return lines + [""]


def _execution_line(e: dict[str, Any]) -> str:
    """How both models ran (what `serve` runs them with)."""
    mode = ", deterministic (batch-invariant)" if e.get("deterministic") else ""
    return f"- execution: {e['path']} in {e['dtype']}{mode}, as `serve` runs the candidate"


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
        *([_execution_line(c["execution"])] if c.get("execution") else []),
        f"- rule: {g['rule']}",
        *([f"- LoRA adapter `{report['lora']['name']}` ({report['lora']['path']}, sha256 "
           f"{report['lora']['sha256'][:16]}) on both models"] if report.get("lora") else []),
        "",
        "| metric | n | baseline | candidate | statistic | interval | threshold | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in report["metrics"]:
        if m["gated"]:
            verdict = m["verdict"]
            if verdict == "inconclusive":
                verdict += f" (~{m['samples_needed']} units to decide)" if m["samples_needed"] else " (on the threshold)"
            lines.append(f"| {m['name']} | {m['n']} | {m['baseline']:.4f} | {m['candidate']:.4f} | "
                         f"{m['statistic']} {m['point']:.4f} | [{m['low']:.4f}, {m['high']:.4f}] | "
                         f"{_rule(m)} | **{verdict}** |")
        elif "point" in m:
            lines.append(f"| {m['name']} | {m['n']} | {m['baseline']:.4f} | {m['candidate']:.4f} | "
                         f"{m['statistic']} {m['point']:.4f} | [{m['low']:.4f}, {m['high']:.4f}] | "
                         "(reported only) | |")
        elif "candidate" in m:
            lines.append(f"| {m['name']} | {m['n']} | {m['baseline']:.4f} | {m['candidate']:.4f} | | | "
                         f"(reported only) | |")
    lines += ["", f"![gated metrics]({plot_name})", ""]
    lines += _divergence_table(report.get("divergence")) + _generation_table(report.get("generation"))
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
