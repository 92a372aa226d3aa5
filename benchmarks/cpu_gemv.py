"""bf16 products of a decode step on CPU, per row count: the C product this CPU builds against
the paths it replaces.

- AVX512-BF16 / AMX CPUs: the few-row product (`runtime/cpu/native/bf16_gemv.c`) against oneDNN's
  prepacked GEMM, the two paths `PrepackedLinear` chooses between; the evidence for
  `bf16_gemv.MAX_ROWS`, the most rows that go through the C product.
- AVX2 CPUs (no bf16 arithmetic): the FMA product (`runtime/cpu/native/bf16_fma_gemm.c`, every row count)
  against `F.linear` in bf16 (oneDNN emulating bf16: what a bf16 model ran before) and float32
  `F.linear` on a float32 copy of the weights (the float32 model's product, twice the bytes).

    python benchmarks/cpu_gemv.py --out benchmarks/results/cpu_gemv_smollm2
    python benchmarks/cpu_gemv.py --rows 1,4,16,32,64,128,512 --out benchmarks/results/cpu_fma_gemm_smollm2_avx2

What is timed is what a decode step does: every layer's dense products (q/k/v and gate/up fused, as
the serving swap fuses them, o_proj, down_proj) for `--layers` layers (default the model's own count)
and the LM head, each layer with weights of its own, so the weights stream from memory as in a
real step instead of sitting in cache (a single weight called in a loop stays cached and favours
whatever reads it more often). Shapes come from the model's config (default smollm2-135m's);
weights are random. Both paths run the same inputs with `--threads` threads (default all cores);
paths alternate (A B, then B A) for `--rounds` rounds, each sample the mean of `--steps` steps
after one warm-up step; the table gives the median round and every round. The
C product is checked on every shape before timing against the float64 product, within the
tests' bound (`error_bounds.dot_bound`), so a broken kernel cannot post a time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable


def model_shapes(model: str) -> tuple[list[tuple[str, int, int]], tuple[int, int], int]:
    """One layer's fused dense products (name, out_features, in_features), the LM head's
    (out, in) and the model's layer count."""
    from lmfoundry.checkpoint.sources import resolve_model
    from lmfoundry.model.config import ModelConfig

    config = ModelConfig.from_dict(json.loads((resolve_model(model) / "config.json").read_text()))
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    layer = [("qkv_proj", (config.num_heads + 2 * config.num_kv_heads) * d, h),
             ("o_proj", h, config.num_heads * d), ("gate_up_proj", 2 * i, h), ("down_proj", h, i)]
    return layer, (config.vocab_size, h), config.num_layers


def _step(calls: list[Callable[[], Any]]) -> None:
    for call in calls:
        call()


def time_alternating(paths: dict[str, list[Callable[[], Any]]], rounds: int, steps: int) -> dict[str, list[float]]:
    """ms per step of each path (a step: its calls in order), `rounds` samples each, the paths
    alternating A B ..., then ... B A, each sample the mean of `steps` steps after one warm-up."""
    samples: dict[str, list[float]] = {name: [] for name in paths}
    for r in range(rounds):
        for path in (list(paths) if r % 2 == 0 else list(reversed(paths))):
            _step(paths[path])  # warm-up
            t0 = time.perf_counter()
            for _ in range(steps):
                _step(paths[path])
            samples[path].append((time.perf_counter() - t0) / steps * 1e3)
    return samples


def measure(layer: list[tuple[str, int, int]], head: tuple[int, int], layers: int, rows: list[int],
            steps: int, rounds: int, threads: int) -> list[dict[str, Any]]:
    import torch
    import torch.nn.functional as F

    from lmfoundry.kernels.error_bounds import assert_within, dot_bound
    from lmfoundry.runtime.cpu import features
    from lmfoundry.runtime.cpu.native.bf16_fma_gemm import load_bf16_fma_gemm
    from lmfoundry.runtime.cpu.native.bf16_gemv import load_bf16_gemv

    torch.set_num_threads(threads)
    onednn_bf16 = features.onednn_bf16()
    gemv = load_bf16_gemv() if onednn_bf16 else load_bf16_fma_gemm()
    if gemv is None:
        raise SystemExit("no C product is built here (no compiler, or neither AVX-512 BF16 nor AVX2 + FMA: "
                         "lmfoundry.runtime.cpu.native.build.unavailable_reason('bf16_gemv' / 'bf16_fma_gemm'))")
    gen = torch.Generator().manual_seed(0)
    shapes = [(n, k) for _, n, k in layer] * layers + [head]
    weights = [(torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16) for n, k in shapes]
    blocked = [gemv.block(w) for w in weights]
    if onednn_bf16:
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
        baselines = {"oneDNN": lambda xs: [partial(torch.ops.mkldnn._linear_pointwise, xs[k], p, None, "none", [], "")
                                           for (_, k), p in zip(shapes, packed, strict=True)]}
    else:
        wide = [w.float() for w in weights]
        baselines = {"bf16 F.linear": lambda xs: [partial(F.linear, xs[k], w) for (_, k), w in zip(shapes, weights,
                                                                                                  strict=True)],
                     "fp32 F.linear": lambda xs: [partial(F.linear, xs[k].float(), w) for (_, k), w in zip(shapes, wide,
                                                                                                      strict=True)]}
    out: list[dict[str, Any]] = []
    for m in rows:
        if onednn_bf16 and m > gemv.max_rows:
            continue
        xs = {k: torch.randn(m, k, generator=gen).to(torch.bfloat16) for k in {k for _, k in shapes}}
        ys = [torch.empty(m, n, dtype=torch.bfloat16) for n, _ in shapes]
        c = [partial(gemv, xs[k], b, None, y, threads=threads) for (_, k), b, y in zip(shapes, blocked, ys, strict=True)]
        for idx in [*range(len(layer)), len(shapes) - 1]:  # one layer's shapes and the head, as the tests bound it
            c[idx]()
            x, w = xs[shapes[idx][1]].double(), weights[idx].double()
            ref = x @ w.t()
            bound = dot_bound(ref, x.abs() @ w.abs().t(), shapes[idx][1], torch.bfloat16)
            assert_within(ys[idx], ref, bound, f"C product {shapes[idx]} M={m}")
        paths = {name: make(xs) for name, make in baselines.items()}
        paths["C"] = c
        samples = time_alternating(paths, rounds, steps)
        row = {"M": m, "ms": {name: statistics.median(v) for name, v in samples.items()}, "rounds": samples}
        row["ratio"] = {name: row["ms"]["C"] / row["ms"][name] for name in baselines}
        out.append(row)
        print(f"rows {m:3d}  " + "  ".join(f"{name} {ms:7.2f} ms" for name, ms in row["ms"].items()) + "  "
              + "  ".join(f"C/{name} {v:.2f}" for name, v in row["ratio"].items()), flush=True)
    return out


def report(rows: list[dict[str, Any]], args: argparse.Namespace, shapes: Any, load: tuple[Any, Any]) -> str:
    from lmfoundry.runtime.cpu.features import describe, onednn_bf16
    from lmfoundry.runtime.cpu.native.bf16_gemv import MAX_ROWS

    layer, head, layers = shapes
    names = ", ".join(f"{name} {n}x{k}" for name, n, k in layer)
    product = "few-row bf16_gemv" if onednn_bf16() else "FMA product bf16_fma_gemm (every row count)"
    base = list(rows[0]["ms"]) if rows else []
    lines = [f"# bf16 products in a decode step: the C product against the paths it replaces ({args.model})", "",
             f"Command: `python benchmarks/cpu_gemv.py {' '.join(args.argv)}`".rstrip(), "",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, {args.threads} threads; load average "
             f"{list(load[0])} before, {list(load[1])} after. {args.rounds} rounds, paths alternating (A B, B A); "
             f"each sample the mean of {args.steps} steps.", "",
             f"One step: {layers} layers of {names} (each layer its own random weights), then the LM head "
             f"{head[0]}x{head[1]}: every weight streams from memory once per step, as in serving.", "",
             f"CPU: {describe()}. C product here: {product}"
             + (f"; `MAX_ROWS` in this tree: {MAX_ROWS} (inputs of up to that many rows take it)." if onednn_bf16()
                else "."), "",
             "| rows | " + " | ".join(f"{name} ms/step" for name in base) + " | "
             + " | ".join(f"C / {name}" for name in base if name != "C") + " | every round (" + "; ".join(base) + ") |",
             "|---:|" + "---:|" * (2 * len(base) - 1) + "---|"]
    for r in rows:
        rounds = "; ".join(", ".join(f"{v:.2f}" for v in r["rounds"][name]) for name in base)
        lines.append(f"| {r['M']} | " + " | ".join(f"{r['ms'][name]:.2f}" for name in base) + " | "
                     + " | ".join(f"{r['ratio'][name]:.2f}" for name in base if name != "C") + f" | {rounds} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    import lmfoundry.model.config  # noqa: F401  (the package's import order: model before kernels)

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="model whose linear shapes are measured")
    p.add_argument("--rows", default="1,2,3,4,6,8,12,16", help="row counts (comma-separated)")
    p.add_argument("--layers", type=int, default=None, help="layers per step (default: the model's)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--steps", type=int, default=5, help="steps per sample")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    args = p.parse_args()
    args.argv = sys.argv[1:]
    args.rows = [int(v) for v in args.rows.split(",") if v]
    layer, head, layers = model_shapes(args.model)
    layers = args.layers or layers
    load0 = os.getloadavg()
    rows = measure(layer, head, layers, args.rows, args.steps, args.rounds, args.threads)
    text = report(rows, args, (layer, head, layers), (load0, os.getloadavg()))
    print(text)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".md").write_text(text)
        out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
        print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
