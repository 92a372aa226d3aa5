"""Is a quantized artifact smaller and faster than float in our own CPU runtime? Measured here.

    python benchmarks/cpu_packed.py --workdir /tmp/cpu-packed [--rounds 2] [--concurrency 1,4]
        [--llama-cpp-python .gl/xllama/bin/python] [--big /work/big/llama8b-w4a16]
        [--out benchmarks/results/cpu_packed_smollm2.md]

Servers, each its own process given the whole machine (--threads = cores), all on SmolLM2-135M:
  float-bf16   `lmfoundry serve smollm2-135m --dtype bfloat16` (the baseline of every ratio)
  w4a16        RTN int4 symmetric g32, packed (int4pack) eager
  w8a16        RTN int8 per channel, packed (int8pack) eager
  w8a8         RTN int8 weights per channel + dynamic per-token int8 activations (torch._int_mm)
  bundle       the w4a16 checkpoint compiled with `lmfoundry compile --arch cpu` (AOTInductor)
  llama.cpp    the same w4a16 checkpoint exported to GGUF Q4_0 (`lmfoundry export`: the same codes and
               fp16 scales, no requantization) served by the llama.cpp server of the `xllamacpp` wheel
               from a side venv (--llama-cpp-python); absent when not given
The load is `lmfoundry bench`'s (streamed completions, a shared prompt prefix, greedy, ignore_eos),
one level at a time; the peers are interleaved (round 1: A B C ..., round 2: A B C ...) so a drift
in machine load shows as a spread between rounds. Per level: output tok/s, TTFT/ITL p50, and the
server's CPU seconds over its whole process tree (live children and reaped ones) over the level's
wall time (cores used). Resident memory: RSS of the server's process tree after the load, and the
bytes of the decoder layers' weight buffers as loaded (the artifact's own footprint). --big serves a
large W4A16 checkpoint (benchmarks/calibration_scale.py makes a Llama-3-8B-shaped source) at
concurrency 1 and reports its RSS and tok/s.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _servers import LLAMA_CPP_SHIM, free_port, loadavg, stop, tree_cpu_seconds, tree_rss, wait_ready  # noqa: E402

from lmfoundry.engine_bundle.engine_manifest import is_engine_bundle  # noqa: E402

MODEL = "smollm2-135m"
ARTIFACTS = {  # name -> quantize arguments (RTN: data-free, so every artifact is reproducible)
    "w4a16": ["--method", "rtn", "--scheme", "w4a16", "--group-size", "32", "--dtype", "float16"],
    "w8a16": ["--method", "rtn", "--scheme", "w8a16", "--per-channel"],
    "w8a8": ["--method", "rtn", "--scheme", "w8a8"],
}


def run(cmd: list[str], env: dict[str, str] | None = None) -> None:
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)


def prepare(work: Path, threads: int, with_gguf: bool) -> dict[str, str]:
    """The artifacts each server loads (built once; reused when present)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    lmf = [sys.executable, "-m", "lmfoundry.cli"]
    paths = {"float-bf16": MODEL}
    for name, args in ARTIFACTS.items():
        out = work / name
        if not (out / "lmfoundry.json").is_file():
            run([*lmf, "quantize", MODEL, "-o", str(out), "--overwrite", "--quiet", *args], env)
        paths[name] = str(out)
    bundle = work / "w4a16-cpu-engine"
    if not is_engine_bundle(bundle):
        run([*lmf, "compile", str(work / "w4a16"), "--arch", "cpu", "-o", str(bundle), "--max-tokens", "2048"], env)
    paths["bundle"] = str(bundle)
    if with_gguf:
        gguf = work / "w4a16-q4_0.gguf"
        if not gguf.is_file():
            run([*lmf, "export", str(work / "w4a16"), "-o", str(gguf), "--tokenizer-pre", "smollm", "--quiet"], env)
        paths["llama.cpp"] = str(gguf)
    return paths


def server_command(peer: str, target: str, args: argparse.Namespace, port: int) -> list[str]:
    if peer == "llama.cpp":
        return [args.llama_cpp_python, "-c", LLAMA_CPP_SHIM, target, str(port), str(args.threads),
                str(max(args.levels)), str(args.max_model_len * max(args.levels))]
    return [sys.executable, "-m", "lmfoundry.cli", "serve", target, "--port", str(port), "--threads",
            str(args.threads), "--dtype", "bfloat16", "--max-model-len", str(args.max_model_len),
            "--max-num-batched-tokens", "512", "--served-model-name", "model"]


def measure(peer: str, target: str, args: argparse.Namespace, levels: list[int], requests: int | None = None,
            max_tokens: int | None = None) -> dict[str, Any]:
    """Start one server, run each level (`requests` of `max_tokens`, default the CLI's), stop it."""
    from lmfoundry.benchmarking.loadgen import run_bench

    port = free_port()
    cmd = server_command(peer, target, args, port)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
    log = open(args.workdir / f"{peer}.log", "a")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    ps = psutil.Process(proc.pid)
    url = f"http://127.0.0.1:{port}"
    out: dict[str, Any] = {"peer": peer, "target": target, "levels": [], "loadavg_before": loadavg()}
    try:
        t0 = time.monotonic()
        wait_ready(url, proc, args.start_timeout)
        out["startup_s"] = round(time.monotonic() - t0, 1)
        asyncio.run(run_bench(url, [1], 4, args.prefix_words, 2, model="model", warmup=1))  # warm-up
        for c in levels:
            cpu0, w0 = tree_cpu_seconds(ps), time.monotonic()
            res = asyncio.run(run_bench(url, [c], max_tokens or args.max_tokens, args.prefix_words,
                                        requests or args.requests, model="model", warmup=0))
            wall, cpu = time.monotonic() - w0, tree_cpu_seconds(ps) - cpu0
            level = res["levels"][0]
            level.update(cpu_seconds=round(cpu, 2), wall_s=round(wall, 2), cores_used=round(cpu / wall, 2))
            out["levels"].append(level)
            print(f"   {peer:<10} c={c:<3} {level['output_tokens_per_s']:7.1f} tok/s  "
                  f"TTFT p50 {level['ttft_s']['p50'] * 1000:6.0f} ms  ITL p50 {level['itl_s']['p50'] * 1000:5.1f} ms  "
                  f"cores {level['cores_used']:.2f}", flush=True)
        out["rss_bytes"] = tree_rss(ps)
    finally:
        stop(proc)
        log.close()
    return out


ENGINE_SCRIPT = """
import json, sys, time, torch
from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams
from lmfoundry.runtime.loader import load_model
target, threads, tokens, levels = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
torch.set_num_threads(threads)
model, tok = load_model(target, dtype=torch.bfloat16)
engine = LLMEngine(model, tok, EngineConfig(kv_cache_memory_gb=0.5, max_num_batched_tokens=512))
prompt = "The history of the city, told by its oldest inhabitants, begins with"
engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0))
out = {}
for c in levels:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    engine.generate([f"{prompt} {i}" for i in range(c)], [params] * c)
    out[c] = c * tokens / (time.perf_counter() - t0)
print(json.dumps(out))
"""


def engine_tok_s(target: str, args: argparse.Namespace) -> dict[int, float]:
    """Output tok/s of the engine itself (no HTTP), in a fresh process with the server's threads:
    prompt prefill plus greedy decode of --max-tokens per sequence, c sequences at once."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
    out = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, target, str(args.threads), str(args.max_tokens),
                          json.dumps(args.levels)], capture_output=True, text=True, env=env, check=True)
    return {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def weight_bytes(target: str) -> int | None:
    """Bytes of the decoder layers' weight buffers as the runtime loads the artifact."""
    import torch

    from lmfoundry.runtime.loader import load_model

    model, _ = load_model(target, dtype=torch.bfloat16)
    if not hasattr(model, "model"):
        return None
    tensors = [t for layer in model.model.layers for t in [*layer.parameters(), *layer.buffers()]]
    return sum(t.numel() * t.element_size() for t in tensors)


def summarize(runs: list[dict[str, Any]], levels: list[int]) -> dict[str, dict[int, dict[str, Any]]]:
    """peer -> concurrency -> means over rounds (and the per-round tok/s)."""
    table: dict[str, dict[int, dict[str, Any]]] = {}
    for r in runs:
        for lv in r["levels"]:
            row = table.setdefault(r["peer"], {}).setdefault(lv["concurrency"], {"tok_s": [], "ttft": [], "itl": [],
                                                                                 "cores": [], "rss": []})
            row["tok_s"].append(lv["output_tokens_per_s"])
            row["ttft"].append(lv["ttft_s"]["p50"])
            row["itl"].append(lv["itl_s"]["p50"])
            row["cores"].append(lv["cores_used"])
            row["rss"].append(r.get("rss_bytes", 0))
    return table


def markdown(meta: dict[str, Any], table: dict[str, dict[int, dict[str, Any]]], wbytes: dict[str, int | None],
             big: dict[str, Any] | None, levels: list[int], engine: dict[str, list[dict[int, float]]]) -> str:
    base = table.get("float-bf16", {})
    lines = [f"# CPU runtime: quantized artifacts vs float ({meta['date']})", "",
             f"Machine: {meta['machine']}; {meta['threads']} threads per server; {meta['rounds']} interleaved "
             f"rounds; {meta['max_tokens']} output tokens per request, {meta['prefix_words']}-word shared prefix; "
             f"load average before/after {meta['loadavg_before']} / {meta['loadavg_after']}.", "",
             "| server | c | tok/s (rounds) | x float-bf16 | TTFT p50 ms | ITL p50 ms | cores used | server RSS MiB "
             "| decoder weights MiB (x float) |", "|---|---|---|---|---|---|---|---|---|"]
    fw = wbytes.get("float-bf16")
    for peer, rows in table.items():
        for c in levels:
            if c not in rows:
                continue
            r = rows[c]
            mean = statistics.mean(r["tok_s"])
            ratio = mean / statistics.mean(base[c]["tok_s"]) if c in base else float("nan")
            wb = wbytes.get(peer)
            wcol = f"{wb / 2**20:.1f} ({wb / fw:.2f})" if wb and fw else "-"
            lines.append(f"| {peer} | {c} | {mean:.1f} ({', '.join(f'{x:.1f}' for x in r['tok_s'])}) | {ratio:.2f} | "
                         f"{statistics.mean(r['ttft']) * 1000:.0f} | {statistics.mean(r['itl']) * 1000:.1f} | "
                         f"{statistics.mean(r['cores']):.2f} | {max(r['rss']) / 2**20:.0f} | {wcol} |")
    if engine:
        base_e = engine.get("float-bf16")
        lines += ["", "The engine alone (`LLMEngine.generate` in one process, no HTTP; same artifacts and threads), "
                      "output tok/s, mean of the rounds (x float-bf16):", "",
                  "| artifact | " + " | ".join(f"c={c}" for c in levels) + " |", "|---|" + "---|" * len(levels)]
        for peer, rounds in engine.items():
            cells = []
            for c in levels:
                v = statistics.mean(r[c] for r in rounds)
                ratio = v / statistics.mean(r[c] for r in base_e) if base_e else float("nan")
                cells.append(f"{v:.1f} ({ratio:.2f})")
            lines.append(f"| {peer} | " + " | ".join(cells) + " |")
    if big is not None:
        lv = big["levels"][0]
        lines += ["", f"Large model: `{big['target']}` served at c=1: {lv['output_tokens_per_s']:.2f} tok/s, "
                      f"server RSS {big['rss_bytes'] / 2**30:.2f} GiB, decoder weights "
                      f"{(big.get('weight_bytes') or 0) / 2**30:.2f} GiB, start-up {big['startup_s']:.0f} s."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prefix-words", type=int, default=100)
    ap.add_argument("--requests", type=int, default=None, help="requests per level (default max(2c, 8))")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads per server (default: cores)")
    ap.add_argument("--peers", default="float-bf16,w4a16,w8a16,w8a8,bundle,llama.cpp")
    ap.add_argument("--llama-cpp-python", default=None, help="python of a venv with xllamacpp (enables llama.cpp)")
    ap.add_argument("--no-engine", action="store_true", help="skip the in-process engine section")
    ap.add_argument("--no-servers", action="store_true", help="only the in-process engine section")
    ap.add_argument("--big", default=None, help="a large W4A16 checkpoint to serve at c=1 (RSS and tok/s)")
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--out", type=Path, default=None, help="write the table (.md) and the raw runs (.json) here")
    args = ap.parse_args()
    args.levels = [int(x) for x in args.concurrency.split(",")]
    args.workdir.mkdir(parents=True, exist_ok=True)
    peers = [p for p in args.peers.split(",") if p != "llama.cpp" or args.llama_cpp_python]
    paths = prepare(args.workdir, args.threads, "llama.cpp" in peers)
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} cores", "threads": args.threads, "rounds": args.rounds, "max_tokens": args.max_tokens,
            "prefix_words": args.prefix_words, "loadavg_before": loadavg()}
    wbytes = {p: weight_bytes(paths[p]) for p in peers if p != "llama.cpp"}
    runs = []
    for r in range(0 if args.no_servers else args.rounds):
        print(f"== round {r + 1}", flush=True)
        for peer in peers:
            runs.append(measure(peer, paths[peer], args, args.levels))
    engine: dict[str, list[dict[int, float]]] = {}
    if not args.no_engine:
        for r in range(args.rounds):
            print(f"== engine in-process, round {r + 1}", flush=True)
            for peer in peers:
                if peer != "llama.cpp":
                    engine.setdefault(peer, []).append(engine_tok_s(paths[peer], args))
                    print(f"   {peer:<10} {engine[peer][-1]}", flush=True)
    big = None
    if args.big:
        print("== large model", flush=True)
        big = measure("big", args.big, args, [1], requests=3, max_tokens=32)
        big["weight_bytes"] = weight_bytes(args.big)
    meta["loadavg_after"] = loadavg()
    table = summarize(runs, args.levels)
    text = markdown(meta, table, wbytes, big, args.levels, engine)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "runs": runs, "weight_bytes": wbytes,
                                                             "engine": engine, "big": big}, indent=1) + "\n")


if __name__ == "__main__":
    main()
