"""The serving load in one process, and where its steps' time goes, by kernel.

    python benchmarks/serve_mix.py --concurrency 16,32 --out benchmarks/results/serve_mix_avx2

`--concurrency` closed-loop streams through `LLMEngine` (no HTTP, no API process), each sending
its next request when the last one finishes, with serve_peers' prompts (75 % share a ~430-token
system prompt that a warm-up request puts in the prefix cache, the rest are distinct prompts of
the same length; greedy, `--max-tokens` tokens with ignore_eos) until `--requests` have finished.
The engine runs as `serve` runs it on CPU (bf16 where the CPU kernels build, the CPU step budget,
`--threads` threads). A kernel change can be measured here in a minute, without a server's
process noise; serve_peers.py remains the measure against other servers.

Per level: output tok/s, steps and ms per step, TTFT p50 (the first token, which may be a special
one with no text: serve_peers counts the first chunk with text) and time per output token p50.
Then the share of the measured wall time spent in each kernel's Python entry point (wall time
around the call, so a share includes the calling thread's wait for its OpenMP workers): the dense
products (the FMA or oneDNN path, the LM head included), the LM head alone, decode and prefill
attention, SiLU-mul, RMSNorm, rotary, the KV write, sampling and verification; the rest is Python
and PyTorch ops around them. Levels run in the order given, each on a fresh engine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from step_profile import _timed  # the same wall-time wrapper around an engine's method

PARTS = ("dense products", "LM head", "decode attention", "prefill attention", "SiLU-mul", "RMSNorm", "rotary",
         "KV write", "sampling")


TOTALS: dict[str, float] = defaultdict(float)  # seconds per part since the level's start
_wrapped: list[bool] = []


def _instrument(engine: Any) -> None:
    """Wrap the kernels' entry points (class attributes, once: every instance any engine holds)
    and this engine's LM head."""
    engine.runner.executor.logits = _timed(TOTALS, "LM head", engine.runner.executor.logits)
    if _wrapped:
        return
    _wrapped.append(True)
    from lmfoundry.runtime.cpu.dense_linears import PrepackedLinear
    from lmfoundry.runtime.cpu.native import norm_act, paged_decode, paged_prefill, rope, store_kv
    from lmfoundry.runtime.engine import llm_engine

    for cls, name, part in ((PrepackedLinear, "forward", "dense products"),
                            (paged_decode.PagedDecode, "__call__", "decode attention"),
                            (paged_prefill.PagedPrefill, "__call__", "prefill attention"),
                            (norm_act.NormAct, "silu_mul", "SiLU-mul"), (norm_act.NormAct, "rms_norm", "RMSNorm"),
                            (rope.RopeQK, "__call__", "rotary"), (store_kv.StoreKV, "__call__", "KV write")):
        setattr(cls, name, _timed(TOTALS, part, getattr(cls, name)))
    llm_engine.verify = _timed(TOTALS, "sampling", llm_engine.verify)  # type: ignore[attr-defined]


def run_level(concurrency: int, requests: int, max_tokens: int, threads: int, model: str) -> dict[str, Any]:
    import torch

    from lmfoundry.benchmarking.loadgen import make_prompts
    from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams
    from lmfoundry.runtime.engine.engine_config import default_step_tokens
    from lmfoundry.runtime.loader import resolve_dtype

    torch.set_num_threads(threads)
    config = EngineConfig(kv_cache_memory_gb=1.0, max_num_batched_tokens=default_step_tokens("cpu"))
    engine = LLMEngine.from_pretrained(model, resolve_dtype("auto", model, "cpu"), config)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    prompts = make_prompts(requests + 1, 300, shared_fraction=0.75)
    engine.generate(prompts[:1], params)  # the system prompt into the prefix cache, the kernels warm
    _instrument(engine)
    TOTALS.clear()
    queue = iter(prompts[1:])
    sent: dict[str, float] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}

    def send() -> None:
        prompt = next(queue, None)
        if prompt is not None:
            rid = f"r{len(sent)}"
            engine.add_request(rid, prompt, params)
            sent[rid] = time.perf_counter()

    for _ in range(concurrency):
        send()
    done = steps = 0
    start = time.perf_counter()
    while engine.has_unfinished():
        events = engine.step()
        steps += 1
        now = time.perf_counter()
        for event in events:
            first.setdefault(event.request_id, now)
            last[event.request_id] = now
            if event.request_finished:
                done += 1
                send()
    wall = time.perf_counter() - start
    engine.close()
    return {
        "concurrency": concurrency, "requests": done, "steps": steps, "wall_s": wall,
        "output_tokens_per_s": done * max_tokens / wall, "ms_per_step": 1000 * wall / steps,
        "ttft_p50_s": statistics.median(first[r] - sent[r] for r in first),
        "tpot_p50_s": statistics.median((last[r] - first[r]) / (max_tokens - 1) for r in first),
        "share": {part: TOTALS[part] / wall for part in PARTS},
    }


def markdown(levels: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"# The serving mix in one process ({meta['threads']} threads, {meta['date']})", "",
             f"Command: `{meta['command']}`", "", f"Machine: {meta['machine']}; load average before/after "
             f"{meta['loadavg_before']} / {meta['loadavg_after']}.", "",
             "| c | requests | output tok/s | steps | ms/step | TTFT p50 ms (first token) | TPOT p50 ms |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for lv in levels:
        lines.append(f"| {lv['concurrency']} | {lv['requests']} | {lv['output_tokens_per_s']:.1f} | {lv['steps']} | "
                     f"{lv['ms_per_step']:.1f} | {1000 * lv['ttft_p50_s']:.0f} | {1000 * lv['tpot_p50_s']:.1f} |")
    lines += ["", "Share of wall time in each kernel's entry point (the LM head's product is also counted in the "
              "dense products):", "", "| part | " + " | ".join(f"c = {lv['concurrency']}" for lv in levels) + " |",
              "|---|" + "---:|" * len(levels)]
    for part in PARTS:
        lines.append(f"| {part} | " + " | ".join(f"{100 * lv['share'][part]:.1f} %" for lv in levels) + " |")
    rest = [1 - sum(v for k, v in lv["share"].items() if k != "LM head") for lv in levels]
    lines.append("| the rest (Python, PyTorch ops) | " + " | ".join(f"{100 * r:.1f} %" for r in rest) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--concurrency", default="16,32")
    p.add_argument("--requests", type=int, default=64, help="finished requests per level")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "serve_mix")
    args = p.parse_args()
    import lmfoundry.cli  # noqa: F401  (the package's import order: model config before the engine)

    before = os.getloadavg()
    levels = [run_level(int(c), args.requests, args.max_tokens, args.threads, args.model)
              for c in args.concurrency.split(",")]
    meta = {"command": "python benchmarks/serve_mix.py " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out") + f" --out {args.out}",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "threads": args.threads,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "loadavg_before": [round(x, 2) for x in before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "levels": levels}, indent=1))
    text = markdown(levels, meta)
    args.out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
