"""Few-row bf16 products on CPU: the C product (`kernels/cpu/bf16_gemv.c`) against oneDNN's
prepacked GEMM, the two paths `PrepackedLinear` chooses between, per row count. It is the evidence
for `bf16_gemv.MAX_ROWS`, the most rows that go through the C product.

    python benchmarks/cpu_gemv.py --out benchmarks/results/cpu_gemv_smollm2

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


def measure(layer: list[tuple[str, int, int]], head: tuple[int, int], layers: int, rows: list[int],
            steps: int, rounds: int, threads: int) -> list[dict[str, Any]]:
    import torch

    from lmfoundry.kernels.cpu.bf16_gemv import Bf16Gemv, load_bf16_gemv
    from lmfoundry.kernels.error_bounds import assert_within, dot_bound

    torch.set_num_threads(threads)
    gemv = load_bf16_gemv()
    if gemv is None:
        raise SystemExit("the C product is not built here (no compiler, or no AVX-512 BF16: "
                         "lmfoundry.kernels.cpu.build.unavailable_reason('bf16_gemv'))")
    gen = torch.Generator().manual_seed(0)
    shapes = [(n, k) for _, n, k in layer] * layers + [head]
    weights = [(torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16) for n, k in shapes]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    blocked = [Bf16Gemv.block(w) for w in weights]
    out: list[dict[str, Any]] = []
    for m in rows:
        xs = {k: torch.randn(m, k, generator=gen).to(torch.bfloat16) for k in {k for _, k in shapes}}
        ys = [torch.empty(m, n, dtype=torch.bfloat16) for n, _ in shapes]
        onednn = [partial(torch.ops.mkldnn._linear_pointwise, xs[k], p, None, "none", [], "")
                  for (_, k), p in zip(shapes, packed, strict=True)]
        c = [partial(gemv, xs[k], b, None, y, threads=threads) for (_, k), b, y in zip(shapes, blocked, ys, strict=True)]
        for idx in [*range(len(layer)), len(shapes) - 1]:  # one layer's shapes and the head, as the tests bound it
            c[idx]()
            x, w = xs[shapes[idx][1]].double(), weights[idx].double()
            ref = x @ w.t()
            bound = dot_bound(ref, x.abs() @ w.abs().t(), shapes[idx][1], torch.bfloat16)
            assert_within(ys[idx], ref, bound, f"bf16_gemv {shapes[idx]} M={m}")
        samples: dict[str, list[float]] = {"onednn": [], "c": []}
        paths = {"onednn": onednn, "c": c}
        for r in range(rounds):
            for path in (("onednn", "c") if r % 2 == 0 else ("c", "onednn")):
                _step(paths[path])  # warm-up
                t0 = time.perf_counter()
                for _ in range(steps):
                    _step(paths[path])
                samples[path].append((time.perf_counter() - t0) / steps * 1e3)
        row = {"M": m, "onednn_ms": statistics.median(samples["onednn"]), "c_ms": statistics.median(samples["c"]),
               "onednn_rounds": samples["onednn"], "c_rounds": samples["c"]}
        row["ratio"] = row["c_ms"] / row["onednn_ms"]
        out.append(row)
        print(f"rows {m:3d}  oneDNN {row['onednn_ms']:7.2f} ms  C {row['c_ms']:7.2f} ms  C/oneDNN {row['ratio']:.2f}",
              flush=True)
    return out


def report(rows: list[dict[str, Any]], args: argparse.Namespace, shapes: Any, load: tuple[Any, Any]) -> str:
    from lmfoundry.kernels.cpu.bf16_gemv import MAX_ROWS

    layer, head, layers = shapes
    names = ", ".join(f"{name} {n}x{k}" for name, n, k in layer)
    lines = [f"# Few-row bf16 products in a decode step: the C product against oneDNN ({args.model})", "",
             f"Command: `python benchmarks/cpu_gemv.py {' '.join(args.argv)}`".rstrip(), "",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, {args.threads} threads; load average "
             f"{list(load[0])} before, {list(load[1])} after. {args.rounds} rounds, paths alternating (A B, B A); "
             f"each sample the mean of {args.steps} steps.", "",
             f"One step: {layers} layers of {names} (each layer its own random weights), then the LM head "
             f"{head[0]}x{head[1]}: every weight streams from memory once per step, as in serving.", "",
             f"`MAX_ROWS` in this tree: {MAX_ROWS} (inputs of up to that many rows take the C product).", "",
             "| rows | oneDNN ms/step | C ms/step | C / oneDNN | every round (oneDNN; C) |",
             "|---:|---:|---:|---:|---|"]
    for r in rows:
        rounds = ", ".join(f"{v:.2f}" for v in r["onednn_rounds"]) + "; " + ", ".join(f"{v:.2f}" for v in r["c_rounds"])
        lines.append(f"| {r['M']} | {r['onednn_ms']:.2f} | {r['c_ms']:.2f} | {r['ratio']:.2f} | {rounds} |")
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
