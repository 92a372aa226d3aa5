"""Resident memory of `lmfoundry serve`: a quantized checkpoint against the float model it came from,
per process and at several KV-cache budgets, so a memory ratio can be read for what it is.

`serve` runs two processes (the API process: HTTP, tokenizer; the engine process: model, KV cache).
Each row starts one server, reads each process's resident memory after start-up and again after a
load (streamed completions, 75 % sharing a long prefix, as serve_peers.py sends), and stops it. The
KV cache is allocated and touched at start-up, so it is resident in full at every budget; what a
budget leaves is the weights plus a fixed cost (Python, torch, the runtime's modules and kernels)
that both servers pay alike. The table prints the quantized/float ratio of the whole tree and of
the engine process without its KV budget, where the weights are.

    python benchmarks/serve_memory.py --model /path/w4a16 --float smollm2-135m --kv-cache-gb 1,0.25
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _servers import free_port, stop, wait_ready  # noqa: E402

HERE = Path(__file__).resolve().parent


def _processes(proc: psutil.Process) -> dict[str, int]:
    """Resident bytes of the API process and of the engine process (its one child)."""
    children = proc.children(recursive=True)
    return {"api": proc.memory_info().rss, "engine": sum(c.memory_info().rss for c in children)}


def measure(model: str, kv_gb: float, args: argparse.Namespace) -> dict[str, Any]:
    from lmfoundry.benchmarking.loadgen import make_prompts, normalize_url, run_level

    port = free_port()
    cmd = [sys.executable, "-m", "lmfoundry.cli", "serve", model, "--port", str(port), "--threads", str(args.threads),
           "--dtype", "bfloat16", "--max-model-len", "1024", "--kv-cache-gb", str(kv_gb), "--served-model-name", "model"]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONSAFEPATH="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            cwd="/")
    try:
        url = f"http://127.0.0.1:{port}"
        t0 = time.monotonic()
        wait_ready(url, proc, 600)
        started = time.monotonic() - t0
        ps = psutil.Process(proc.pid)
        idle = _processes(ps)
        prompts = make_prompts(args.requests, args.prefix_words, shared_fraction=0.75)
        level = asyncio.run(run_level(normalize_url(url), "model", prompts, args.concurrency, args.requests, args.max_tokens))
        if level["errors"]:
            raise RuntimeError(f"{model}: {level['errors']} request(s) failed under load: {level['first_error']}")
        loaded = _processes(ps)
    finally:
        stop(proc)
    return {"model": model, "kv_cache_gb": kv_gb, "start_s": round(started, 1), "idle": idle, "loaded": loaded,
            "output_tokens": level["output_tokens"]}


def _mib(b: float) -> str:
    return f"{b / 2**20:.0f}"


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [f"# Resident memory of `lmfoundry serve`: {args.model} against {args.float}", "",
             f"Command: `python benchmarks/serve_memory.py {' '.join(sys.argv[1:])}`", "",
             f"Each server: --threads {args.threads}, --dtype bfloat16, --max-model-len 1024; after start-up and after "
             f"{args.requests} streamed completions ({args.max_tokens} tokens each, {args.concurrency} in flight, 75 % "
             "sharing a long prefix). MiB of resident memory (RSS) per process.", "",
             "| model | KV GiB | API idle | engine idle | API loaded | engine loaded | tree loaded | engine - KV |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lo = r["loaded"]
        lines.append(f"| {r['model']} | {r['kv_cache_gb']:g} | {_mib(r['idle']['api'])} | {_mib(r['idle']['engine'])} | "
                     f"{_mib(lo['api'])} | {_mib(lo['engine'])} | {_mib(lo['api'] + lo['engine'])} | "
                     f"{_mib(lo['engine'] - r['kv_cache_gb'] * 2**30)} |")
    lines += ["", "| KV GiB | tree: quantized / float | engine - KV: quantized / float |", "|---:|---:|---:|"]
    for kv in args.kv_cache_gb:
        q = next(r for r in rows if r["model"] == args.model and r["kv_cache_gb"] == kv)["loaded"]
        f = next(r for r in rows if r["model"] == args.float and r["kv_cache_gb"] == kv)["loaded"]
        tree = (q["api"] + q["engine"]) / (f["api"] + f["engine"])
        weights = (q["engine"] - kv * 2**30) / (f["engine"] - kv * 2**30)
        lines.append(f"| {kv:g} | {tree:.2f} | {weights:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the quantized checkpoint (or bundle)")
    parser.add_argument("--float", required=True, help="the float model it came from")
    parser.add_argument("--kv-cache-gb", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 0.25])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prefix-words", type=int, default=300)
    parser.add_argument("--out", default=str(HERE / "results" / "serve_memory.json"))
    args = parser.parse_args()
    rows = [measure(m, kv, args) for kv in args.kv_cache_gb for m in (args.model, args.float)]
    text = report(rows, args)
    print(text)
    out = Path(args.out)
    out.write_text(json.dumps({"args": {k: v for k, v in vars(args).items()}, "rows": rows}, indent=1) + "\n")
    out.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
