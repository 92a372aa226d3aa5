"""What `serve --deterministic` costs: engine tok/s of batch-invariant execution against the
default execution, measured in the same run.

The same workload runs through two engines over the same checkpoint in the same dtype, one with
`EngineConfig(deterministic=True)`, one without (each on its own copy of the model: the module
swaps are made in place). For every concurrency c, c distinct prompts of about --prompt-words words
are generated together, greedy, --max-tokens tokens each (EOS ignored), and, separately, prefilled
alone (max_tokens 1: the prompt's throughput). Rounds alternate the two modes (default first in
odd rounds, deterministic first in even ones) so that load from elsewhere on the machine falls on
both; every round is kept and the median reported. The deterministic answers at every concurrency
are also compared with c = 1's, byte for byte (they must be equal), and the default ones too (they
usually are not).

    python benchmarks/deterministic.py [--model smollm2-135m] [--dtype bfloat16] [--concurrency 1,8,32]
        [--max-tokens 32] [--rounds 2] [--threads 2] [--out benchmarks/results/deterministic]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams

WORDS = ("the river carried old stories past the quiet town where bakers rose before dawn and children counted "
         "boats while the mayor argued about bridges taxes and the price of bread").split()
MODES = ("default", "deterministic")


def prompt_ids(tok, i: int, words: int) -> list[int]:
    """Prompt i: a distinct sequence of `words` words (a rotation of the word list, numbered)."""
    text = " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(words))
    return tok(f"Note {i}: {text}. Summary:").input_ids


def engine(model_name: str, dtype: torch.dtype, deterministic: bool) -> LLMEngine:
    from lmfoundry.runtime.loader import load_model

    model, tok = load_model(model_name, dtype=dtype)
    eng = LLMEngine(model, tok, EngineConfig(kv_cache_memory_gb=0.5, max_num_batched_tokens=1024,
                                             deterministic=deterministic))
    eng.generate([prompt_ids(tok, 999, 8)], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    return eng


def timed(eng: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=1)
    start = time.perf_counter()
    outs = eng.generate(prompts, [params] * len(prompts))
    seconds = time.perf_counter() - start
    first = outs[0].outputs[0]
    return seconds, [first.token_ids, [(lp.token_id, lp.logprob) for lp in first.logprobs]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--prompt-words", type=int, default=80)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "0")) or os.cpu_count())
    ap.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    levels = [int(c) for c in args.concurrency.split(",")]
    engines = {mode: engine(args.model, dtype, mode == "deterministic") for mode in MODES}
    tok = engines["default"].tokenizer
    prompts = [prompt_ids(tok, i, args.prompt_words) for i in range(max(levels))]
    load_before = os.getloadavg()
    rows: dict[str, dict] = {}
    for c in levels:
        for mode in MODES:
            rows[f"{mode}/c{c}"] = {"mode": mode, "concurrency": c, "decode_s": [], "prefill_s": [], "first": None}
    for r in range(args.rounds):
        order = MODES if r % 2 == 0 else MODES[::-1]
        for c in levels:
            for mode in order:
                row = rows[f"{mode}/c{c}"]
                seconds, first = timed(engines[mode], prompts[:c], args.max_tokens)
                row["decode_s"].append(seconds)
                row["first"] = first
                seconds, _ = timed(engines[mode], prompts[:c], 1)
                row["prefill_s"].append(seconds)
            print(f"round {r + 1} c={c}: " + ", ".join(
                f"{m} {rows[f'{m}/c{c}']['decode_s'][-1]:.2f} s" for m in MODES), file=sys.stderr, flush=True)
    prompt_tokens = {c: sum(len(p) for p in prompts[:c]) for c in levels}
    for row in rows.values():
        c = row["concurrency"]
        row["tok_s"] = c * args.max_tokens / statistics.median(row["decode_s"])
        row["prompt_tok_s"] = prompt_tokens[c] / statistics.median(row["prefill_s"])
        row["same_as_c1"] = row["first"] == rows[f"{row['mode']}/c{levels[0]}"]["first"]
    result = {"model": args.model, "dtype": args.dtype, "threads": args.threads, "rounds": args.rounds,
              "max_tokens": args.max_tokens, "prompt_tokens": prompt_tokens, "cpu": platform.processor() or
              platform.machine(), "load_before": load_before, "load_after": os.getloadavg(),
              "command": "python " + " ".join(sys.argv), "rows": {k: {x: v for x, v in r.items() if x != "first"}
                                                                  for k, r in rows.items()}}
    lines = [f"# Deterministic mode cost: {args.model}, {args.dtype}, {args.threads} thread"
             f"{'s' if args.threads > 1 else ''}", "",
             f"Command: `{result['command']}`", "",
             f"{args.rounds} rounds, modes alternated; median round shown (every round in the JSON). Load average "
             f"before {load_before[0]:.2f}, after {result['load_after'][0]:.2f}.", "",
             "| c | mode | output tok/s | prompt tok/s | deterministic / default (output) | prompt | first answer = c 1's |",
             "|---|---|---|---|---|---|---|"]
    for c in levels:
        base = rows[f"default/c{c}"]
        for mode in MODES:
            row = rows[f"{mode}/c{c}"]
            ratio = f"{row['tok_s'] / base['tok_s']:.2f}" if mode == "deterministic" else ""
            pratio = f"{row['prompt_tok_s'] / base['prompt_tok_s']:.2f}" if mode == "deterministic" else ""
            lines.append(f"| {c} | {mode} | {row['tok_s']:.1f} | {row['prompt_tok_s']:.1f} | {ratio} | {pratio} | "
                         f"{row['same_as_c1']} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        Path(args.out).with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
