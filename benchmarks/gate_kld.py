"""eval-gate's quick tier on the candidates that define its thresholds, measured in one run.

    python benchmarks/gate_kld.py [--rows float,w8a16-rtn,...] [--work DIR] [--reuse] [--gate default]

Builds each candidate from the shipped SmolLM2-135M (`lmfoundry quantize`, or a planted regression
on top of one), gates it against the bf16 baseline with the gate's quick tier, and writes a table
of verdicts, the divergence statistics with their intervals, flips, the generative check and the
CPU time of each model's evaluation (`benchmarks/results/gate_kld.{md,json}`, plus every row's own
report as `eval_gate_quick_<row>.{md,json}`).

The baseline is evaluated once (the gate's cache keeps its results and its next-token reference);
its time is the first row's. CPU seconds are the gate process's own (all threads), recorded when the
model was evaluated, so a row served from the cache still shows the time its evaluation took.
`--reuse` keeps candidates already built in `--work`.

The top-k check measures what the gate's coarsening costs: on the first windows, the mean and
p99 KLD of some candidates against references of several top-k sizes up to the whole vocabulary
(exact), all from the same forward passes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BASE = "smollm2-135m"
LMFOUNDRY = str(Path(sys.executable).with_name("lmfoundry"))


def _quantize(*flags: str) -> Callable[[Path], None]:
    def build(out: Path) -> None:
        subprocess.run([LMFOUNDRY, "quantize", BASE, "-o", str(out), "--quiet", "--overwrite", *flags], check=True)
    return build


def _scaled_by_3(source: str) -> Callable[[Path], None]:
    """A planted regression: one W4A16 linear's scales multiplied by 3 (the checkpoint's hashes in
    lmfoundry.json no longer match; the gate is called directly, without the CLI's verify step)."""
    def build(out: Path) -> None:
        from safetensors.torch import load_file, save_file

        src = out.parent / source
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(src, out)
        name = "model.layers.10.mlp.down_proj.weight_scale"
        for f in sorted(out.glob("*.safetensors")):
            tensors = load_file(f)
            if name in tensors:
                tensors[name] = tensors[name] * 3.0
                save_file(tensors, f, metadata={"format": "pt"})
                return
        raise SystemExit(f"{name} not found in {src}")
    return build


# row -> (what it is, how to build it; None: the baseline itself)
ROWS: dict[str, tuple[str, Callable[[Path], None] | None]] = {
    "float": ("the bf16 baseline against itself", None),
    "w8a16-rtn": ("INT8 weights, per channel, RTN", _quantize("--method", "rtn", "--scheme", "w8a16", "--per-channel")),
    "fp8-dynamic": ("FP8 weights and dynamic per-token FP8 activations",
                    _quantize("--method", "fp8", "--scheme", "fp8-dynamic")),
    "w4a16-rtn": ("INT4 weights, group 64, RTN", _quantize("--method", "rtn", "--scheme", "w4a16", "--group-size", "64")),
    "w4a16-gptq": ("INT4 weights, group 64, GPTQ (recipes/smollm2-w4a16-gptq.yaml)",
                   _quantize("--recipe", "smollm2-w4a16-gptq")),
    "w2a16-rtn": ("INT2 weights, group 64, RTN", _quantize("--method", "rtn", "--scheme", "w2a16", "--group-size", "64")),
    "w4a16-x3": ("w4a16-rtn with layer 10's down_proj scales x3 (planted)", _scaled_by_3("w4a16-rtn")),
}


def _metric(report: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((m for m in report["metrics"] if m["name"] == name), None)


def _summary(row: str, what: str, report: dict[str, Any], build_s: float | None) -> dict[str, Any]:
    def stat(name: str) -> dict[str, float] | None:
        m = _metric(report, name)
        return None if m is None else {"point": m["point"], "low": m["low"], "high": m["high"],
                                        "verdict": m["verdict"]}

    ppl = next(m for m in report["metrics"] if m["name"].startswith("perplexity/"))
    flips = {m["name"]: m["extra"] for m in report["metrics"] if m["name"].endswith("/acc_flips")}
    answers = report.get("generation") or []
    structured = [a for a in answers if a["baseline_valid"] is not None]
    return {
        "row": row, "what": what, "verdict": report["verdict"], "exit_code": report["exit_code"],
        "failing": report["failing"],
        "mean_kld": stat("divergence/mean_kld"), "p99_kld": stat("divergence/p99_kld"),
        "same_top": stat("divergence/same_top"), "rms_dp": stat("divergence/rms_dp"),
        "ppl_ratio": {"point": ppl["point"], "low": ppl["low"], "high": ppl["high"], "verdict": ppl["verdict"]},
        "flips": flips, "exact_match": stat("generation/exact_match"),
        "valid": [sum(bool(a["candidate_valid"]) for a in structured), sum(bool(a["baseline_valid"]) for a in structured),
                  len(structured)],
        "candidate_seconds": report["candidate"]["seconds"], "baseline_seconds": report["baseline"]["seconds"],
        "build_seconds": build_s, "divergence": report["divergence"],
    }


def _interval(s: dict[str, float] | None, digits: int = 4) -> str:
    if s is None:
        return "-"
    return f"{s['point']:.{digits}f} [{s['low']:.{digits}f}, {s['high']:.{digits}f}]"


def _all(observers: list[Callable[[Any, Any], None]]) -> Callable[[Any, Any], None]:
    """One perplexity observer feeding several (one forward pass for every reference size)."""
    def observe(logits: Any, targets: Any) -> None:
        for o in observers:
            o(logits, targets)
    return observe


def topk_sensitivity(candidates: dict[str, str], ks: tuple[int, ...], windows: int) -> list[dict[str, Any]]:
    """Mean / p99 KLD and the baseline's rest mass per reference size, exact at the vocabulary size."""
    import numpy as np

    from lmfoundry.calibration.data import eval_token_stream
    from lmfoundry.evals.divergence import DivergenceScorer, ReferenceRecorder
    from lmfoundry.evals.perplexity import perplexity
    from lmfoundry.runtime.loader import load_model, resolve_dtype

    dtype = resolve_dtype("auto", BASE)
    base, tok = load_model(BASE, dtype=dtype)
    stream = eval_token_stream(None, tok)[0][: windows * 512]
    vocab = base.config.vocab_size
    recorders = {k: ReferenceRecorder(min(k, vocab)) for k in (*ks, vocab)}
    perplexity(base, stream, ctx=512, progress=False, observe=_all(list(recorders.values())))
    del base
    out = []
    for row, path in candidates.items():
        model, _ = load_model(path, dtype=dtype)
        scorers = {k: DivergenceScorer(r.reference()) for k, r in recorders.items()}
        perplexity(model, stream, ctx=512, progress=False, observe=_all(list(scorers.values())))
        for k, scorer in scorers.items():
            st = scorer.statistics()
            out.append({"row": row, "top_k": k, "exact": k == vocab, "mean_kld": float(st.kld.mean()),
                        "p99_kld": float(np.quantile(st.kld, 0.99)), "rest_mass": float(st.rest_mass.mean())})
        del model
    return out


def write_markdown(rows: list[dict[str, Any]], meta: dict[str, Any], path: Path) -> None:
    lines = ["# eval-gate quick tier: divergence statistics against the bf16 baseline", "",
             f"SmolLM2-135M-Instruct, gate `{meta['gate']}` tier `{meta['tier']}`, {meta['threads']} threads, "
             f"{meta['date']}. Intervals: paired 95 % bootstrap over the 20 perplexity windows (KLD, same-top, "
             "perplexity) or prompts (exact match). KLD over the baseline's top-128 tokens plus a rest bucket.", "",
             "| candidate | verdict | mean KLD | p99 KLD | same top | ppl ratio | flips r->w / w->r (arc, piqa, hs) "
             "| exact match | valid JSON/tool (cand/base of n) | CPU min |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        flips = ", ".join(f"{f['right_to_wrong']}/{f['wrong_to_right']}" for f in r["flips"].values())
        cpu = r["candidate_seconds"].get("cpu")
        lines.append(f"| {r['row']} | **{r['verdict'].upper()}** ({r['exit_code']}) | {_interval(r['mean_kld'])} | "
                     f"{_interval(r['p99_kld'], 3)} | {_interval(r['same_top'], 3)} | {_interval(r['ppl_ratio'], 3)} | "
                     f"{flips} | {_interval(r['exact_match'], 2)} | {r['valid'][0]}/{r['valid'][1]} of {r['valid'][2]} | "
                     f"{'-' if cpu is None else f'{cpu / 60:.1f}'} |")
    base_cpu = rows[0]["baseline_seconds"].get("cpu") if rows else None
    lines += ["", "Rows: " + "; ".join(f"`{r['row']}`: {r['what']}" for r in rows) + ".", "",
              f"CPU min is the candidate's evaluation (load, tasks, perplexity + divergence, generation); the "
              f"baseline's took {'-' if base_cpu is None else f'{base_cpu / 60:.1f}'} CPU min once for all rows.", ""]
    for check in meta["checks"]:
        lines.append(f"- {check}")
    sens = meta.get("topk")
    if sens:
        exact = {r["row"]: r for r in sens if r["exact"]}
        lines += ["", f"## What the top-k coarsening costs (first {meta['topk_windows']} windows, same forward passes)", "",
                  "| candidate | top-k | baseline mass outside top-k | mean KLD | of exact | p99 KLD | of exact |",
                  "|---|---|---|---|---|---|---|"]
        for r in sens:
            e = exact[r["row"]]
            k = f"{r['top_k']} (whole vocabulary)" if r["exact"] else str(r["top_k"])
            lines.append(f"| {r['row']} | {k} | {r['rest_mass']:.4f} | {r['mean_kld']:.5f} | "
                         f"{r['mean_kld'] / e['mean_kld']:.1%} | {r['p99_kld']:.4f} | {r['p99_kld'] / e['p99_kld']:.1%} |")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--work", type=Path, default=Path("/tmp/lmfoundry-gate-kld"))
    ap.add_argument("--reuse", action="store_true", help="keep candidates already built in --work")
    ap.add_argument("--gate", default="default")
    ap.add_argument("--tier", default="quick")
    ap.add_argument("--out", type=Path, default=RESULTS / "gate_kld.json")
    ap.add_argument("--topk-rows", default="w8a16-rtn,fp8-dynamic,w4a16-rtn",
                    help="candidates for the top-k check (empty: skip it)")
    ap.add_argument("--topk", default="128,512,2048", help="reference sizes of the top-k check")
    ap.add_argument("--topk-windows", type=int, default=4)
    args = ap.parse_args()
    rows = args.rows.split(",")
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; known: {', '.join(ROWS)}")

    import torch

    from lmfoundry.evals.gate import run_gate

    args.work.mkdir(parents=True, exist_ok=True)
    results = []
    for row in rows:
        what, build = ROWS[row]
        candidate, build_s = BASE, None
        if build is not None:
            candidate = str(args.work / row)
            if not (args.reuse and (args.work / row / "config.json").exists()):
                t = time.time()
                build(args.work / row)
                build_s = round(time.time() - t, 1)
        res = run_gate(candidate, BASE, args.gate, args.tier, args.work / f"{row}-gate", write_promotion=False)
        shutil.copy(res.json_path, RESULTS / f"eval_gate_{args.tier}_{row}.json")
        shutil.copy(res.markdown_path, RESULTS / f"eval_gate_{args.tier}_{row}.md")
        results.append(_summary(row, what, res.report, build_s))
        print(f"{row:12s} {res.verdict:12s} mean KLD {_interval(results[-1]['mean_kld'])}", flush=True)
    checks = []
    by = {r["row"]: r for r in results}
    if "w4a16-gptq" in by and "w4a16-rtn" in by:
        g, r = by["w4a16-gptq"]["mean_kld"], by["w4a16-rtn"]["mean_kld"]
        apart = g["high"] < r["low"]
        checks.append(f"W4A16 GPTQ mean KLD {_interval(g)} vs RTN {_interval(r)}: "
                      f"{'lower, intervals do not overlap' if apart else 'intervals overlap'}")
    budget = 10 * 60  # the quick-tier budget: CPU seconds per model
    over = [f"{r['row']} {r['candidate_seconds']['cpu'] / 60:.1f}" for r in results
            if r["candidate_seconds"].get("cpu", 0) > budget]
    checks.append("quick tier within 10 CPU-minutes per model: " + ("every row" if not over else
                  "every row but " + ", ".join(over) + " CPU-min"))
    topk_rows = [r for r in args.topk_rows.split(",") if r and r in by]
    topk = topk_sensitivity({r: str(args.work / r) for r in topk_rows}, tuple(int(k) for k in args.topk.split(",")),
                            args.topk_windows) if topk_rows else []
    meta = {"gate": args.gate, "tier": args.tier, "threads": torch.get_num_threads(),
            "date": time.strftime("%Y-%m-%d"), "checks": checks, "omp": os.environ.get("OMP_NUM_THREADS"),
            "topk": topk, "topk_windows": args.topk_windows}
    args.out.write_text(json.dumps({"meta": meta, "rows": results}, indent=1) + "\n")
    write_markdown(results, meta, args.out.with_suffix(".md"))
    print(args.out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
