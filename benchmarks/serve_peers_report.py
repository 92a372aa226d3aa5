"""benchmarks/serve_peers.py's summary and report: the per-level numbers of every round, reduced.

Means over rounds with the per-round values kept beside them (`summarize`), ours against vLLM under
issue #24's targets (`targets`), the Markdown report (`write_markdown`) and the `lmfoundry bench`-
shaped means the plot is drawn from (`mean_result`). Pure functions of the recorded runs, kept
apart from the code that starts servers and drives the load.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

# issue #24's targets for ours against vLLM
TARGET_TOK_S = 1.2  # ours / vLLM output tok/s, at every concurrency
TARGET_CORES = 0.9  # cores used by ours, as a fraction of --threads (1.8 of 2)


# ---- summary and report -----------------------------------------------------------------------
def _mean(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.mean(vals) if vals and len(vals) == len(xs) else None


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[int, dict[str, Any]]]:
    """peer -> concurrency -> the per-round values and their means, for the report's metrics."""
    table: dict[str, dict[int, dict[str, Any]]] = {}
    for r in runs:
        for lv in r["levels"]:
            row = table.setdefault(r["peer"], {}).setdefault(lv["concurrency"], {
                "tok_s": [], "ttft_p50": [], "tbt_p50": [], "itl_p50": [], "tok_per_chunk": [], "cpu_s": [],
                "cores": [], "errors": 0, "short": 0})
            row["tok_s"].append(lv["output_tokens_per_s"])
            row["ttft_p50"].append(lv["ttft_s"]["p50"])
            row["tbt_p50"].append(lv["tpot_s"]["p50"])
            row["itl_p50"].append(lv["itl_s"]["p50"])
            row["tok_per_chunk"].append(lv["output_tokens"] / lv["chunks"] if lv["chunks"] else None)
            row["cpu_s"].append(lv["cpu_seconds"])
            row["cores"].append(lv["cores_used"])
            row["errors"] += lv["errors"]
            row["short"] += max(lv["expected_tokens"] - lv["output_tokens"], 0) if not lv["errors"] else 0
    for rows in table.values():
        for row in rows.values():
            row["mean"] = {k: _mean(row[k]) for k in ("tok_s", "ttft_p50", "tbt_p50", "itl_p50", "tok_per_chunk",
                                                      "cpu_s", "cores")}
    return table


def targets(table: dict[str, dict[int, dict[str, Any]]], levels: list[int], threads: int,
            ours: str = "ours", ref: str = "vllm") -> list[dict[str, Any]]:
    """Issue #24's targets, per level: each with ours, vLLM's, the ratio and met/missed."""
    rows: list[dict[str, Any]] = []
    a, b = table.get(ours, {}), table.get(ref, {})
    for c in levels:
        if c not in a:
            continue
        m, v = a[c]["mean"], b.get(c, {}).get("mean", {})

        def ratio(key: str, m: dict = m, v: dict = v) -> float | None:
            x, y = m.get(key), v.get(key)
            return x / y if x is not None and y else None

        for metric, key, goal, want in (("output tok/s", "tok_s", f">= {TARGET_TOK_S}x vLLM", lambda r: r >= TARGET_TOK_S),
                                        ("TBT p50", "tbt_p50", "<= vLLM", lambda r: r <= 1.0),
                                        ("TTFT p50", "ttft_p50", "<= vLLM", lambda r: r <= 1.0)):
            r = ratio(key)
            rows.append({"concurrency": c, "metric": metric, "ours": m.get(key), "vllm": v.get(key), "ratio": r,
                         "target": goal, "met": None if r is None else bool(want(r))})
        cores, goal = m.get("cores"), TARGET_CORES * threads
        rows.append({"concurrency": c, "metric": "cores used", "ours": cores, "vllm": v.get("cores"),
                     "ratio": cores / threads if cores is not None else None, "target": f">= {goal:g} of {threads}",
                     "met": None if cores is None else cores >= goal})
    return rows


def _fmt(v: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def _cell(row: dict[str, Any], key: str, scale: float = 1.0, digits: int = 1) -> str:
    """Mean over rounds, then the per-round values in parentheses (when there is more than one)."""
    vals = row[key]
    text = _fmt(row["mean"][key], scale, digits)
    if len(vals) > 1:
        text += " (" + ", ".join(_fmt(x, scale, digits) for x in vals) + ")"
    return text


def write_markdown(path: Path, meta: dict[str, Any], runs: list[dict[str, Any]],
                   table: dict[str, dict[int, dict[str, Any]]], goals: list[dict[str, Any]],
                   failed: dict[str, str]) -> None:
    load = (f"streamed /v1/completions, greedy, {meta['max_tokens']} output tokens each (ignore_eos); "
            f"{meta['shared_fraction']:.0%} of the prompts share a {meta['system_tokens']}-token system prompt "
            f"(then a ~{meta['question_tokens']}-token question), the rest are distinct prompts of about "
            f"{meta['distinct_tokens']} tokens; requests per level: {meta['requests']}; {meta['warmup']} warm-up "
            f"requests of the same mix after each start.")
    lines = [f"# Serving peers: {meta['model']}, each server given the whole machine ({meta['date']})", "",
             f"Machine: {meta['machine']}; {meta['threads']} threads per server; {meta['rounds']} interleaved "
             f"round(s) ({' '.join(meta['peers'])} per round; each peer started, warmed up, run through every "
             f"level and stopped); load average before/after {meta['loadavg_before']} / {meta['loadavg_after']}; "
             f"run took {meta['wall_s'] / 60:.0f} min.", "", f"Load: {load}", "",
             f"Command: `{meta['command']}`", "", "## Servers", ""]
    for peer in meta["peers"]:
        r = next((x for x in runs if x["peer"] == peer), None)
        if r is not None:
            env = " ".join(f"{k}={v}" for k, v in r["env"].items() if k != "TOKENIZERS_PARALLELISM")
            cmd = " ".join([Path(r["command"][0]).name, *r["command"][1:]])  # the venv's path is in the JSON
            lines.append(f"- **{peer}** ({meta['weights'][peer]}): `{env} {cmd}`")
    lines += ["", "Start-up (s, per round; a server's first start may include compilation) and resident memory "
                  "of the server's process tree after the load:", "", "| peer | start-up s | warm-up s | RSS MiB |",
              "|---|---|---|---|"]
    for peer in meta["peers"]:
        rs = [x for x in runs if x["peer"] == peer]
        if rs:
            lines.append(f"| {peer} | {', '.join(_fmt(x.get('startup_s'), 1, 0) for x in rs)} | "
                         f"{', '.join(_fmt(x.get('warmup_s'), 1, 0) for x in rs)} | "
                         f"{max((x.get('rss_bytes') or 0) for x in rs) / 2**20:.0f} |")
    lines += ["", "## Results", "",
              "Means over rounds, per-round values in parentheses. TBT: time per output token after the first "
              "(last chunk - first chunk) / (tokens - 1), p50 over requests; ITL: the gaps between streamed "
              "chunks, p50 over gaps, which also depends on how many tokens a server puts in a chunk "
              "(tok/chunk). Cores used: the server's CPU seconds (whole process tree) / wall seconds of the level.",
              "", "| peer | c | output tok/s | TTFT p50 ms | TBT p50 ms | ITL p50 ms | tok/chunk | server CPU s "
              "| cores used |", "|---|---:|---|---|---|---|---|---|---|"]
    for peer, rows in table.items():
        for c in meta["levels"]:
            if c not in rows:
                continue
            row = rows[c]
            flag = f" ({row['errors']} errors)" if row["errors"] else ""
            flag += f" ({row['short']} tokens short)" if row["short"] else ""
            lines.append(f"| {peer} | {c} | {_cell(row, 'tok_s')}{flag} | {_cell(row, 'ttft_p50', 1000, 0)} | "
                         f"{_cell(row, 'tbt_p50', 1000, 1)} | {_cell(row, 'itl_p50', 1000, 1)} | "
                         f"{_fmt(row['mean']['tok_per_chunk'], 1, 2)} | {_cell(row, 'cpu_s')} | "
                         f"{_cell(row, 'cores', 1, 2)} |")
    if goals:
        lines += ["", "## ours / vLLM against the targets (issue #24)", "",
                  "| c | metric | ours | vLLM | ratio | target | |", "|---:|---|---:|---:|---:|---|---|"]
        for g in goals:
            ms = g["metric"] in ("TBT p50", "TTFT p50")
            digits = 0 if g["metric"] == "TTFT p50" else (1 if g["metric"] != "cores used" else 2)
            lines.append(f"| {g['concurrency']} | {g['metric']}{' ms' if ms else ''} | "
                         f"{_fmt(g['ours'], 1000 if ms else 1, digits)} | {_fmt(g['vllm'], 1000 if ms else 1, digits)} | "
                         f"{_fmt(g['ratio'], 1, 2)} | {g['target']} | "
                         f"{'-' if g['met'] is None else ('met' if g['met'] else '**missed**')} |")
        known = [g for g in goals if g["met"] is not None]
        lines += ["", f"{sum(g['met'] for g in known)} of {len(known)} targets met."]
    if failed:
        lines += ["", "## Peers that did not run", ""] + [f"- {p}: {why}" for p, why in failed.items()]
    if meta.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in meta["notes"]]
    path.write_text("\n".join(lines) + "\n")


def mean_result(peer: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A `lmfoundry bench`-shaped result for bench_plot: each number the mean over rounds."""
    by_c: dict[int, list[dict[str, Any]]] = {}
    for r in runs:
        if r["peer"] == peer:
            for lv in r["levels"]:
                by_c.setdefault(lv["concurrency"], []).append(lv)
    levels = []
    for c, lvs in sorted(by_c.items()):
        levels.append({"concurrency": c, "output_tokens_per_s": statistics.mean(x["output_tokens_per_s"] for x in lvs),
                       **{key: {q: _mean([x[key][q] for x in lvs]) for q in ("p50", "p95", "p99")}
                          for key in ("ttft_s", "itl_s", "e2e_s")}})
    return {"model": peer, "levels": levels}
