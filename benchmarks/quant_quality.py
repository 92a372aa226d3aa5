"""Quantization quality and cost, ours against the peers, measured in one run.

    python benchmarks/quant_quality.py [--rows float,rtn,gptq,...] [--peers] [--num-samples 128]

Every row quantizes the same model with the same calibration token ids (recipe: source/num
samples/seq len/seed; the parent checks the hash each child recorded) and is scored on the same
held-out windows (tail of wiki.utf8, never used for calibration) by the same code: our loader +
evals/perplexity.py, also for the peers' checkpoints (llm-compressor writes compressed-tensors,
which our loader reads; GPTQModel's format is dequantized by GPTQModel itself into a float folder).

Each quantization runs in its own child process with OMP_NUM_THREADS=1; its CPU time (user+sys,
all threads) and peak RSS come from the kernel (`os.wait4`), the same way for ours and theirs.
The 1-minute load average before and after each row is recorded: the 2 cores are shared.

Rows are data: `ROWS` maps a name to a recipe (ours) or to a peer runner. A row whose method is
not available in this build is reported as "unavailable"; a failing peer as "failed" (with the
reason), never as a crash of the benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PEERS_DIR = ROOT / "benchmarks" / "peers"
sys.path.insert(0, str(PEERS_DIR))


@dataclass
class Row:
    """One table row: our quantizer (recipe overrides) or a peer runner."""

    label: str
    quantize: dict[str, Any] = field(default_factory=dict)  # recipe `quantize` overrides (ours)
    peer: str | None = None  # "llmcompressor" | "gptqmodel"
    peer_args: list[str] = field(default_factory=list)
    # rows of one family (ours and peers) quantize to the same scheme; `ratios()` compares the
    # best of ours with the best peer per family, and `--peers` adds the peers of the chosen families
    family: str = ""

    @property
    def is_float(self) -> bool:
        return not self.quantize and self.peer is None


W4 = {"scheme": "w4a16", "group_size": 64}
ROWS: dict[str, Row] = {
    "float": Row("float (fp32)"),
    "rtn": Row("RTN w4a16 g64 sym", {"method": "rtn", **W4}),
    "gptq": Row("GPTQ w4a16 g64 sym", {"method": "gptq", **W4}, family="gptq"),
    "gptq-actorder": Row("GPTQ+actorder(static) w4a16 g64 sym", {"method": "gptq", **W4, "actorder": "static"}, family="gptq"),
    "gptq-dynamic": Row("GPTQ+actorder(dynamic, g_idx) w4a16 g64 sym", {"method": "gptq", **W4, "actorder": "dynamic"}, family="gptq"),
    "gptq-actorder-damp0.1": Row("GPTQ+actorder(static) w4a16 g64 sym, dampening_frac 0.1",
                                 {"method": "gptq", **W4, "actorder": "static", "options": {"dampening_frac": 0.1}}, family="gptq"),
    "gptq-actorder-damp0.05": Row("GPTQ+actorder(static) w4a16 g64 sym, dampening_frac 0.05 (GPTQModel's default)",
                                  {"method": "gptq", **W4, "actorder": "static", "options": {"dampening_frac": 0.05}}, family="gptq"),
    "gptq-actorder-mse": Row("GPTQ+actorder(static) w4a16 g64 sym, mse observer",
                             {"method": "gptq", **W4, "actorder": "static", "observer": "mse"}, family="gptq"),
    "awq": Row("AWQ w4a16 g64 sym", {"method": "awq", **W4}, family="awq"),
    "rtn-asym": Row("RTN w4a16 g64 asym", {"method": "rtn", **W4, "symmetric": False}),
    "gptq-asym": Row("GPTQ+actorder w4a16 g64 asym", {"method": "gptq", **W4, "actorder": "static", "symmetric": False}),
    "awq-asym": Row("AWQ w4a16 g64 asym", {"method": "awq", **W4, "symmetric": False}),
    "rtn-channel": Row("RTN w4a16 per-channel sym", {"method": "rtn", "scheme": "w4a16", "per_channel": True}),
    "gptq-channel": Row("GPTQ+actorder w4a16 per-channel sym", {"method": "gptq", "scheme": "w4a16", "per_channel": True, "actorder": "static"}),
    "awq-channel": Row("AWQ w4a16 per-channel sym", {"method": "awq", "scheme": "w4a16", "per_channel": True}),
    # schemes other helpers are adding; "unavailable" until their modules exist
    "rtn-w8a8": Row("RTN w8a8", {"method": "rtn", "scheme": "w8a8"}),
    "smoothquant-w8a8": Row("SmoothQuant w8a8", {"method": "smoothquant", "scheme": "w8a8"}, family="w8a8-int8"),
    "smoothquant-w8a8-search": Row("SmoothQuant w8a8, alpha searched per layer", {
        "method": "smoothquant", "scheme": "w8a8", "options": {"alpha_search": True}}, family="w8a8-int8"),
    "smoothquant-gptq-w8a8": Row("SmoothQuant w8a8 + GPTQ weights (llm-compressor's recipe)", {
        "method": "smoothquant", "scheme": "w8a8", "options": {"weight_method": "gptq"}}, family="w8a8-int8"),
    "fp8-dynamic": Row("FP8 dynamic", {"method": "fp8", "scheme": "fp8-dynamic"}, family="fp8-dynamic"),
    "fp8-static": Row("FP8 static", {"method": "fp8", "scheme": "fp8-static"}),
    "gptq-kv-int8": Row("GPTQ+actorder w4a16 g64 + KV int8", {"method": "gptq", **W4, "actorder": "static", "kv_cache": "int8"}),
    "gptq-kv-fp8": Row("GPTQ+actorder w4a16 g64 + KV fp8", {"method": "gptq", **W4, "actorder": "static", "kv_cache": "fp8"},
                       family="w4a16-kv-fp8"),
    # peers: name them in --rows, or --peers adds those of the families chosen
    "llmc-gptq": Row("llm-compressor GPTQModifier (actorder static, its default) g64 sym", peer="llmcompressor",
                     peer_args=["--method", "gptq", "--group-size", "64"], family="gptq"),
    "llmc-awq": Row("llm-compressor AWQModifier g64 sym", peer="llmcompressor",
                    peer_args=["--method", "awq", "--group-size", "64"], family="awq"),
    "gptqmodel-gptq": Row("GPTQModel GPTQ g64 sym (fp32)", peer="gptqmodel", peer_args=["--group-size", "64"], family="gptq"),
    "llmc-sq-w8a8": Row("llm-compressor SmoothQuantModifier(0.5) + GPTQModifier W8A8 (int8 channel sym, int8 dynamic token)",
                        peer="llmcompressor", peer_args=["--method", "smoothquant-w8a8", "--smoothing-strength", "0.5"],
                        family="w8a8-int8"),
    "llmc-fp8-dynamic": Row("llm-compressor QuantizationModifier FP8_DYNAMIC (fp8 channel, dynamic token; data-free)",
                            peer="llmcompressor", peer_args=["--method", "fp8-dynamic"], family="fp8-dynamic"),
    "llmc-gptq-kv-fp8": Row("llm-compressor GPTQModifier (actorder static) g64 sym + kv_cache_scheme fp8 tensor static",
                            peer="llmcompressor", peer_args=["--method", "gptq", "--group-size", "64", "--kv-cache", "fp8"],
                            family="w4a16-kv-fp8"),
}
DEFAULT_ROWS = ["float", "rtn", "gptq", "gptq-actorder", "awq", "gptq-asym", "awq-asym", "gptq-channel", "awq-channel"]
PEER_ROWS = [n for n, r in ROWS.items() if r.peer]
# ours/theirs targets of the issue that asked for a family's comparison (none: ratios only)
FAMILY_TARGETS: dict[str, dict[str, float]] = {"gptq": {"ppl": 0.9, "cpu": 0.5}, "awq": {"ppl": 0.9, "cpu": 0.5}}


def peers_for(names: list[str]) -> list[str]:
    """The peer rows of the families among `names` (what `--peers` adds)."""
    families = {ROWS[n].family for n in names if n in ROWS and ROWS[n].family}
    return [n for n in PEER_ROWS if ROWS[n].family in families and n not in names]


# ------------------------------------------------------------------------------- child process
def run_child(cmd: list[str], log: Path, env: dict[str, str] | None = None, timeout: float | None = None) -> dict[str, Any]:
    """Run `cmd`, return rc, wall, CPU (user+sys of it and its descendants) and peak RSS from the
    kernel's accounting of exactly this child."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
    load0 = os.getloadavg()[0]
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=full_env)
        deadline = None if timeout is None else t0 + timeout
        while True:
            pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if deadline and time.time() > deadline:
                proc.kill()
                pid, status, ru = os.wait4(proc.pid, 0)
                status = -9
                break
            time.sleep(0.5)
    # No peak RSS from `ru`: its ru_maxrss carries this (large) parent's resident size across
    # fork+exec. Each child reports its own VmHWM instead (status file / peer_stats.json).
    return {"rc": os.waitstatus_to_exitcode(status) if status != -9 else -9, "wall_s": time.time() - t0,
            "cpu_s": ru.ru_utime + ru.ru_stime, "load_before": load0, "load_after": os.getloadavg()[0]}


def child_quantize(args: argparse.Namespace) -> None:
    """Inside a child: run one of our rows through the same job as `lmfoundry quantize`."""
    from lmfoundry.calibration.job import QuantizeJob, run_job
    from lmfoundry.errors import UserError
    from lmfoundry.quantizers.methods import get_quantizer
    from lmfoundry.recipe import Recipe

    row = ROWS[args.child_row]
    out = Path(args.work) / args.child_row
    status = Path(args.work) / f"{args.child_row}.status.json"
    rec = Recipe().with_overrides(**row.quantize)
    rec = rec.with_overrides(source=args.calib, num_samples=args.num_samples, seq_len=args.seq_len, seed=args.seed)
    try:
        get_quantizer(rec.quantize.method)  # "not available in this build" -> unavailable
    except UserError as exc:
        status.write_text(json.dumps({"state": "unavailable", "reason": str(exc)}))
        return
    try:
        summary = run_job(QuantizeJob(args.model, out, rec, overwrite=True, doctor=False, progress=True))
    except (UserError, ModuleNotFoundError) as exc:
        status.write_text(json.dumps({"state": "unavailable", "reason": f"{type(exc).__name__}: {exc}"}))
        return
    status.write_text(json.dumps({"state": "ok", "summary": summary}))


# -------------------------------------------------------------------------------------- parent
def score(folder: Path, stream, ctx: int, windows: int) -> dict[str, Any]:
    import gc

    import torch

    from lmfoundry.evals.perplexity import perplexity
    from lmfoundry.runtime.loader import load_model

    model, _ = load_model(folder, dtype=torch.float32)
    res = perplexity(model, stream, ctx=ctx, max_windows=windows, progress=False)
    del model
    gc.collect()
    return {"ppl": res.ppl, "tokens": res.tokens, "windows": res.windows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"comma list of: {', '.join(ROWS)}")
    ap.add_argument("--peers", action="store_true",
                    help=f"add the peer rows of the families among --rows (peers: {', '.join(PEER_ROWS)})")
    ap.add_argument("--calib", default="c4")
    ap.add_argument("--num-samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--eval-windows", type=int, default=40)
    ap.add_argument("--work", default="/work/bench-out", help="checkpoints and logs (outside the repo)")
    ap.add_argument("--tag", default="", help="suffix of the result files")
    ap.add_argument("--peer-timeout", type=float, default=3600.0)
    ap.add_argument("--include-results", default=None,
                    help="results JSON of an earlier run with the same calibration and eval settings (e.g. the "
                         "peer rows, which take long): its rows join this table")
    ap.add_argument("--merge", nargs="+", default=None,
                    help="only merge these results JSONs (same calibration ids and eval windows) into one table")
    ap.add_argument("--child-row", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.child_row:
        child_quantize(args)
        return
    if args.merge:
        merge(args)
        return

    import torch

    torch.set_num_threads(1)
    from lmfoundry.calibration.data import eval_token_stream, load_calibration, token_hash
    from lmfoundry.checkpoint.sources import resolve_model
    from lmfoundry.checkpoint.tokenizer import load_tokenizer

    names = [n.strip() for n in args.rows.split(",") if n.strip()]
    if args.peers:
        names += peers_for(names)
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        raise SystemExit(f"unknown row(s) {unknown}; known: {', '.join(ROWS)}")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    folder = resolve_model(args.model)
    tok = load_tokenizer(folder)
    calib = load_calibration(args.calib, tok, args.num_samples, args.seq_len, args.seed)
    ids_file = work / "calib_ids.pt"
    torch.save(calib.token_ids, ids_file)
    stream, eval_src, _ = eval_token_stream(None, tok)
    print(f"model {folder}\ncalibration {calib.describe()}\neval {eval_src}: {args.eval_windows} x {args.ctx}", flush=True)
    args.load_start, args.started = os.getloadavg(), time.time()

    results: list[dict[str, Any]] = []
    float_ppl = None
    if args.include_results:
        prev = json.loads(Path(args.include_results).read_text())
        same = (prev["meta"]["calibration"]["token_ids_sha256"] == calib.token_sha256
                and prev["meta"]["eval_windows"] == args.eval_windows and prev["meta"]["ctx"] == args.ctx)
        if not same:
            raise SystemExit(f"{args.include_results}: different calibration ids or eval windows")
        for r in prev["rows"]:
            if r["row"] == "float":
                float_ppl = r["ppl"]
            if r["state"] != "ok":
                continue  # failed or unavailable rows are tried again
            if r["row"] in names:
                names.remove(r["row"])
            results.append({**r, "from_run": prev["meta"]["created_unix"]})
    for name in names:
        row = ROWS[name]
        rec: dict[str, Any] = {"row": name, "label": row.label, "family": row.family, "peer": row.peer}
        print(f"--- {name}: {row.label}", flush=True)
        if row.is_float:
            rec.update(state="ok", wall_s=0.0, cpu_s=0.0, peak_rss_mib=None)
            rec.update(score(folder, stream, args.ctx, args.eval_windows))
        elif row.peer is None:
            stats = run_child([sys.executable, __file__, "--child-row", name, "--model", args.model, "--calib", args.calib,
                               "--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len),
                               "--seed", str(args.seed), "--work", str(work)], work / f"{name}.log")
            rec.update(stats)
            status_file = work / f"{name}.status.json"
            status = json.loads(status_file.read_text()) if status_file.exists() else {"state": "failed"}
            status_file.unlink(missing_ok=True)
            rec["state"] = status["state"] if stats["rc"] == 0 else "failed"
            rec["reason"] = status.get("reason") or (f"exit {stats['rc']}, see {work / (name + '.log')}" if stats["rc"] else None)
            if rec["state"] == "ok":
                manifest = json.loads((work / name / "lmfoundry.json").read_text())
                if manifest["calibration"]["token_ids_sha256"] != token_hash(calib.token_ids):
                    raise SystemExit(f"{name}: calibration ids differ from the parent's")
                rec["manifest_warnings"] = len(manifest["warnings"])
                run = json.loads((work / name / "lmfoundry-run.json").read_text())  # the run record
                rec["peak_rss_mib"] = run["peak_rss_bytes"] / 2**20  # the child's own VmHWM
                rec.update(score_or_fail(work / name, stream, args.ctx, args.eval_windows))
        else:
            rec.update(run_peer(row, name, folder, ids_file, work, args.peer_timeout))
            if rec["state"] == "ok":
                rec.update(score_or_fail(Path(rec.pop("score_folder")), stream, args.ctx, args.eval_windows))
        if name == "float":
            float_ppl = rec.get("ppl")
        if rec.get("ppl") is not None and float_ppl is not None:
            rec["ppl_increase"] = rec["ppl"] - float_ppl
        results.append(rec)
        print(json.dumps(rec), flush=True)
        write_results(results, args, calib.describe(), eval_src)
    print(table(results, args, calib.describe(), eval_src))


def score_or_fail(folder: Path, stream, ctx: int, windows: int) -> dict[str, Any]:
    """`score`, or a failed row whose reason is what our loader / evaluation raised (e.g. a
    checkpoint layout it does not read), instead of a crash of the whole benchmark."""
    try:
        return score(folder, stream, ctx, windows)
    except Exception as exc:
        return {"state": "failed", "reason": f"scoring {folder} with lmfoundry failed: {type(exc).__name__}: {exc}"}


def log_error(log: Path) -> str | None:
    """The last exception line of a child's log (`SomeError: message`), for the table."""
    import re

    if not log.exists():
        return None
    lines = log.read_text(errors="replace").splitlines()
    for line in reversed(lines[-400:]):
        if re.match(r"^[A-Za-z_.]*(Error|Exception|Interrupt)\b.*", line.strip()):
            return line.strip()[:300]
    return None


def run_peer(row: Row, name: str, model: Path, ids_file: Path, work: Path, timeout: float) -> dict[str, Any]:
    import shutil

    from venvs import ensure

    try:
        py = ensure(row.peer)
    except Exception as exc:  # an install failure is reported in the table, not a crash
        return {"state": "failed", "reason": f"install of {row.peer} failed: {exc}"}
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(str(out) + ".gptq", ignore_errors=True)
    if row.peer == "llmcompressor":
        cmd = [str(py), str(PEERS_DIR / "llmcompressor_run.py"), "--model", str(model), "--ids", str(ids_file),
               "--out", str(out), *row.peer_args]
        stats = run_child(cmd, work / f"{name}.log", timeout=timeout)
        ok = stats["rc"] == 0 and (out / "config.json").exists()
        score_folder = out
    else:
        common = [str(py), str(PEERS_DIR / "gptqmodel_run.py"), "--model", str(model), "--ids", str(ids_file),
                  "--out", str(out), *row.peer_args]
        stats = run_child(common + ["--stage", "quantize"], work / f"{name}.log", timeout=timeout)
        ok = stats["rc"] == 0
        if ok:  # dequantize for scoring, untimed
            ex = run_child(common + ["--stage", "export"], work / f"{name}.export.log", timeout=timeout)
            ok = ex["rc"] == 0
        score_folder = out
    res: dict[str, Any] = {**stats, "state": "ok" if ok else "failed", "score_folder": str(score_folder)}
    peer_stats = next((p for p in (out / "peer_stats.json", Path(str(out) + ".gptq") / "peer_stats.json")
                       if p.exists()), None)
    if ok and peer_stats is not None:
        res["peak_rss_mib"] = json.loads(peer_stats.read_text()).get("peak_rss", 0) / 2**20 or None
    if not ok:
        why = f"timed out after {timeout:.0f} s" if stats["rc"] == -9 else f"exit {stats['rc']}"
        err = log_error(work / f"{name}.log")
        res["reason"] = f"{why}{f' ({err})' if err else ''}, see {work / (name + '.log')}"
        res.pop("score_folder")
    return res


def table(results: list[dict[str, Any]], args: argparse.Namespace, calib: dict[str, Any], eval_src: str) -> str:
    lines = [
        f"Model {args.model}; calibration {calib['source'].split('/')[-1]} {calib['num_samples']} x {calib['seq_len']} "
        f"tokens (seed {calib['seed']}, ids sha256 {calib['token_ids_sha256'][:12]}); perplexity on {eval_src}, "
        f"{args.eval_windows} windows x {args.ctx}. CPU = user+sys of the quantization process (1 thread).",
    ]
    machine = machine_line(args)
    if machine:
        lines += ["", machine]
    lines += [
        "",
        "| row | method | wall s | CPU s | peak RSS MiB | perplexity | increase over float | load avg (before/after) |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        if r["state"] != "ok":
            lines.append(f"| {r['row']} | {r['label']} | {r['state']}: {r.get('reason', '')} | | | | | |")
            continue
        rss = f"{r['peak_rss_mib']:.0f}" if r.get("peak_rss_mib") else "-"
        inc = f"{r['ppl_increase']:+.3f}" if r.get("ppl_increase") is not None else "-"
        load = f"{r['load_before']:.1f}/{r['load_after']:.1f}" if "load_before" in r else "-"
        lines.append(f"| {r['row']} | {r['label']} | {r['wall_s']:.0f} | {r['cpu_s']:.0f} | {rss} | {r['ppl']:.3f} | {inc} | {load} |")
    lines += ["", *ratios(results)]
    return "\n".join(lines)


def machine_line(args: argparse.Namespace) -> str:
    """Cores and load averages over the run (the cores are shared with other work)."""
    start = getattr(args, "load_start", None)
    if start is None:
        return ""
    start, now = ("/".join(f"{x:.1f}" for x in la) for la in (start, os.getloadavg()))
    wall = time.time() - args.started
    return (f"Machine: {os.cpu_count()} cores, shared; load average (1/5/15 min) {start} at the start, "
            f"{now} after {wall / 60:.0f} min (when this table was written).")


def is_peer(r: dict[str, Any]) -> bool:
    if "peer" in r:  # recorded since the peer field exists
        return bool(r["peer"])
    row = ROWS.get(r["row"])
    return bool(row and row.peer)


def ratios(results: list[dict[str, Any]]) -> list[str]:
    """ours/theirs per family (in the table's order): best perplexity increase over float, and CPU
    time against the fastest peer of the family."""
    out = []
    families = list(dict.fromkeys(r["family"] for r in results if r.get("family")))
    for fam in families:
        ok = [r for r in results if r.get("family") == fam and r["state"] == "ok" and r.get("ppl_increase") is not None]
        ours = [r for r in ok if not is_peer(r)]
        peers = [r for r in ok if is_peer(r)]
        if not ours or not peers:
            missing = "peer" if ours else "ours"
            failed = [r["row"] for r in results if r.get("family") == fam and r["state"] != "ok"]
            out.append(f"{fam}: no ratio (no scored {missing} row{'; not ok: ' + ', '.join(failed) if failed else ''})")
            continue
        target = FAMILY_TARGETS.get(fam, {})
        best_ours = min(ours, key=lambda r: r["ppl_increase"])
        best_peer = min(peers, key=lambda r: r["ppl_increase"])
        fastest = min(peers, key=lambda r: r["cpu_s"])
        if best_peer["ppl_increase"] > 0:
            ppl_ratio = f"ratio {best_ours['ppl_increase'] / best_peer['ppl_increase']:.2f}"
        else:
            ppl_ratio = "ratio undefined (peer increase <= 0)"
        cpu_ratio = f"ratio {best_ours['cpu_s'] / fastest['cpu_s']:.2f}" if fastest["cpu_s"] > 0 else "ratio undefined"
        out.append(
            f"{fam}: ours ({best_ours['row']}) ppl increase {best_ours['ppl_increase']:.3f} vs best peer "
            f"({best_peer['row']}) {best_peer['ppl_increase']:.3f}: {ppl_ratio}"
            + (f" (target <= {target['ppl']})" if "ppl" in target else "")
            + f"; CPU {best_ours['cpu_s']:.0f} s vs fastest peer ({fastest['row']}) {fastest['cpu_s']:.0f} s: {cpu_ratio}"
            + (f" (target <= {target['cpu']})" if "cpu" in target else "")
        )
    return out


def merge(args: argparse.Namespace) -> None:
    """One table from several runs that used the same calibration ids and eval windows."""
    runs = [json.loads(Path(f).read_text()) for f in args.merge]
    meta = runs[0]["meta"]
    for r in runs[1:]:
        m = r["meta"]
        if (m["calibration"]["token_ids_sha256"], m["eval_windows"], m["ctx"]) != (
                meta["calibration"]["token_ids_sha256"], meta["eval_windows"], meta["ctx"]):
            raise SystemExit("runs differ in calibration ids or eval windows; not merging")
    rows: dict[str, dict[str, Any]] = {}
    for r in runs:
        for row in r["rows"]:
            if row["row"] == "float" and "float" in rows:
                if abs(row["ppl"] - rows["float"]["ppl"]) > 1e-9:
                    raise SystemExit("float perplexity differs between runs")
                continue
            rows[row["row"]] = {**row, "run": r["meta"]["created_unix"]}
    args.eval_windows, args.ctx, args.model = meta["eval_windows"], meta["ctx"], meta["model"]
    write_results(list(rows.values()), args, meta["calibration"], meta["eval"])
    print(table(list(rows.values()), args, meta["calibration"], meta["eval"]))


def write_results(results, args, calib, eval_src) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "quant_quality" + (f"_{args.tag}" if args.tag else "")
    meta = {"model": args.model, "calibration": calib, "eval": eval_src, "eval_windows": args.eval_windows,
            "ctx": args.ctx, "nproc": os.cpu_count(), "created_unix": int(time.time()),
            "load_avg_start": getattr(args, "load_start", None), "load_avg_end": os.getloadavg(),
            "wall_s": time.time() - args.started if getattr(args, "started", None) else None}
    (RESULTS / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": results}, indent=2) + "\n")
    (RESULTS / f"{stem}.md").write_text(table(results, args, calib, eval_src) + "\n")


if __name__ == "__main__":
    main()
