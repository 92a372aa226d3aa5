"""Which GEMMs an `--arch cpu` package should hold on this CPU: Inductor's C++ templates timed
against ATen's ("CPP,ATEN", max-autotune picks per shape) or ATen's alone ("ATEN").

    python benchmarks/cpu_step_gemm.py --model CKPT --workdir DIR --out benchmarks/results/cpu_step_gemm_avx512

Both bundles of the same W4A16/W8A16 checkpoint are built (kept in --workdir and reused), then
served in this process by the engine, greedy, `--prompt-tokens` random prompt tokens and
`--max-tokens` output tokens a request, `--concurrency` requests at once, with a fresh set of
prompts every round (so the prefix cache never skips a prefill). The bundles alternate (A B, then
B A) for `--rounds` rounds; the table gives output tokens per second, the best round and every
round, and the ratio ATEN / CPP,ATEN. `compile.cpu_step.gemm_backends` chooses by this table.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

BACKENDS = ("CPP,ATEN", "ATEN")


def build(model: str, workdir: Path, backends: str) -> Path:
    from lmfoundry.compile.cpu_step import build_cpu_engine
    from lmfoundry.engine_bundle.engine_manifest import is_engine_bundle

    out = workdir / backends.replace(",", "-").lower()
    if not is_engine_bundle(out):
        _, _, seconds = build_cpu_engine(model, out, backends=backends, log_line=print)
        print(f"built {out} ({backends}) in {seconds:.0f} s")
    return out


def tokens_per_second(engine: Any, concurrency: int, prompt_tokens: int, max_tokens: int, seed: int) -> float:
    import torch

    from lmfoundry.runtime.engine import SamplingParams

    vocab = engine.info.vocab_size
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(10, vocab, (prompt_tokens,), generator=gen).tolist() for _ in range(concurrency)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a W4A16 / W8A16 checkpoint folder")
    parser.add_argument("--workdir", required=True, help="where the two bundles are built (reused if there)")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", help="write OUT.json and OUT.md")
    args = parser.parse_args()

    import torch

    from lmfoundry.runtime.cpu.features import isa
    from lmfoundry.runtime.engine import EngineConfig, LLMEngine
    from lmfoundry.runtime.loader import load_model

    workdir = Path(args.workdir)
    bundles = {b: build(args.model, workdir, b) for b in BACKENDS}
    engines = {}
    for backends, folder in bundles.items():
        model, tok = load_model(folder, dtype=torch.bfloat16)
        if getattr(model, "compiled_step", None) is None:
            raise SystemExit(f"{folder}: the compiled step does not run on this CPU")
        engines[backends] = LLMEngine(model, tok, EngineConfig(kv_cache_memory_gb=0.25, num_threads=args.threads))
    concurrency = [int(c) for c in args.concurrency.split(",")]
    samples: dict[str, dict[int, list[float]]] = {b: {c: [] for c in concurrency} for b in BACKENDS}
    for c in concurrency:
        tokens_per_second(engines[BACKENDS[0]], c, args.prompt_tokens, 4, seed=-1)  # warm-up
        tokens_per_second(engines[BACKENDS[1]], c, args.prompt_tokens, 4, seed=-1)
        for r in range(args.rounds):
            order = BACKENDS if r % 2 == 0 else BACKENDS[::-1]
            for backends in order:
                samples[backends][c].append(
                    tokens_per_second(engines[backends], c, args.prompt_tokens, args.max_tokens, seed=1000 * c + r))
    for backends, engine in engines.items():
        assert engine.runner.executor.compiled_steps > 0, f"{backends}: the package never ran"

    lines = [f"# `--arch cpu` package GEMMs on {isa()} ({platform.processor() or platform.machine()})", "",
             f"Command: `python benchmarks/cpu_step_gemm.py --model {args.model} --concurrency {args.concurrency} "
             f"--prompt-tokens {args.prompt_tokens} --max-tokens {args.max_tokens} --rounds {args.rounds}`", "",
             "Output tokens/s of the engine on each bundle (best round; every round in brackets).", "",
             "| concurrency | CPP,ATEN | ATEN | ATEN / CPP,ATEN |", "|---:|---:|---:|---:|"]
    for c in concurrency:
        a, b = (samples[x][c] for x in BACKENDS)
        lines.append(f"| {c} | {max(a):.1f} ({', '.join(f'{v:.1f}' for v in a)}) | "
                     f"{max(b):.1f} ({', '.join(f'{v:.1f}' for v in b)}) | {max(b) / max(a):.2f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out + ".md").write_text(table + "\n")
        Path(args.out + ".json").write_text(json.dumps({"isa": isa(), "args": vars(args), "samples": {
            b: {str(c): v for c, v in s.items()} for b, s in samples.items()}}, indent=1) + "\n")


if __name__ == "__main__":
    main()
