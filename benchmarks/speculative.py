"""Speculative decoding on CPU: decode tok/s with and without it, measured in the same run.

A repetitive workload (chat requests that ask to copy or lightly edit a code snippet or a passage,
so the answer quotes the prompt) runs through the engine once per mode: plain decoding, prompt
lookup (`ngram`) with a few draft lengths, and a draft model when --draft-model is given. Requests
run one at a time (batch 1, the latency-bound case speculation is for), greedy, after one warm-up
request per engine, each prompt on every mode in turn (interleaved, so load from elsewhere on the
machine weighs on all modes alike). Each row reports tokens, wall time, tok/s, the drafts' acceptance rate, the
speedup over plain decoding, and whether the tokens equal plain decoding's (they must).

    python benchmarks/speculative.py [--model smollm2-135m] [--max-tokens 64] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import torch

from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams

SNIPPET = "def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs)\n"
PASSAGE = ("The quick brown fox jumps over the lazy dog. The five boxing wizards jump quickly. "
           "Pack my box with five dozen liquor jugs.")
ASKS = [
    f"Repeat this Python code exactly, renaming `mean` to `average`:\n```python\n{SNIPPET}```",
    f'Copy this text word for word: "{PASSAGE}"',
    f"Add a docstring to this function and return the whole function:\n```python\n{SNIPPET}```",
    f"Rewrite this function with type hints, keeping everything else:\n```python\n{SNIPPET}```",
]


def make_engine(model, tok, draft=None, **spec) -> LLMEngine:
    """An engine for one mode, warmed up with one short request (counters reset after it)."""
    engine = LLMEngine(model, tok, EngineConfig(kv_cache_memory_gb=0.1, **spec), draft_model=draft)
    engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, temperature=0))
    if engine.speculator is not None:
        engine.speculator.num_draft_tokens = engine.speculator.num_accepted_tokens = 0
    return engine


def measure(engines: dict[str, LLMEngine], prompts: list[list[int]], max_tokens: int) -> dict[str, dict]:
    """Decode every prompt alone on every engine, interleaved (prompt by prompt, the order of the
    modes rotated), so that load from elsewhere on the machine falls on all modes alike."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    results = {name: {"tokens": [], "seconds": 0.0} for name in engines}
    names = list(engines)
    for i, ids in enumerate(prompts):
        for name in names[i % len(names):] + names[: i % len(names)]:
            start = time.perf_counter()
            out = engines[name].generate([ids], params)[0].outputs[0].token_ids
            results[name]["seconds"] += time.perf_counter() - start
            results[name]["tokens"].append(out)
    for name, r in results.items():
        s = engines[name].speculator
        r.update(n=sum(map(len, r["tokens"])), acceptance=s.acceptance_rate if s else None,
                 drafts=s.num_draft_tokens if s else 0)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft-model", default=None, help="also measure --speculative draft with this model")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=3, help=f"how many of the {len(ASKS)} requests to run")
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4], help="draft lengths to measure")
    ap.add_argument("--out", type=Path, default=None, help="also write the table (markdown) here")
    args = ap.parse_args()

    from lmfoundry.runtime.loader import load_model

    model, tok = load_model(args.model)
    draft = load_model(args.draft_model)[0] if args.draft_model else None
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": a}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False).input_ids
               for a in ASKS[: args.prompts]]
    modes: list[tuple[str, dict]] = [("plain", {})]
    modes += [(f"ngram k={k}", {"speculative": "ngram", "num_speculative_tokens": k}) for k in args.k]
    if draft is not None:
        modes += [(f"draft {args.draft_model} k={k}", {"speculative": "draft", "num_speculative_tokens": k,
                                                        "draft": draft}) for k in args.k]
    engines = {name: make_engine(model, tok, **spec) for name, spec in modes}
    load_before = os.getloadavg()[0]
    results = measure(engines, prompts, args.max_tokens)
    load_after = os.getloadavg()[0]
    for name, r in results.items():
        print(f"{name}: {r['n']} tokens in {r['seconds']:.1f} s", flush=True)

    base = results["plain"]
    lines = [
        f"# Speculative decoding, {args.model} on CPU",
        "",
        f"`python benchmarks/speculative.py --model {args.model} --max-tokens {args.max_tokens} "
        f"--prompts {args.prompts}` — {len(prompts)} chat requests that copy or edit a code snippet or a passage, "
        f"decoded one at a time (batch 1), greedy, up to {args.max_tokens} new tokens each; every mode in the "
        f"same process, interleaved prompt by prompt, after a warm-up request. "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; 1-minute load average {load_before:.1f} before and "
        f"{load_after:.1f} after (other work on the machine slows every mode alike, not equally "
        f"over time: hence the interleaving).",
        "",
        "| mode | tokens | seconds | tok/s | acceptance | speedup | same tokens as plain |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, r in results.items():
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f} ({r['drafts']} drafts)"
        lines.append(f"| {name} | {r['n']} | {r['seconds']:.1f} | {r['n'] / r['seconds']:.2f} | {acc} | "
                     f"{base['seconds'] / r['seconds'] * r['n'] / base['n']:.2f}x | "
                     f"{'yes' if r['tokens'] == base['tokens'] else 'NO'} |")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table)


if __name__ == "__main__":
    main()
