"""4-bit products of a serving step on CPU, per row count: the int4 C product (`runtime/cpu/native/int4_gemm.c`,
what `CProductLinear` runs for 4-bit codes) against PyTorch's int4pack kernel (what a W4A16 checkpoint ran before),
dequantize-then-GEMM (the other side of the crossover, `runtime/cpu/crossover.py`), and the float
model's own product on the same weights in bf16 (oneDNN prepacked, `PrepackedLinear`: the baseline
of "a quantized checkpoint is never slower than float").

    python benchmarks/cpu_int4.py --out benchmarks/results/cpu_int4_smollm2

What is timed is what a step does: every layer's 4-bit products (q/k/v and gate/up fused, as the
serving swap fuses them, o_proj, down_proj; group --group, symmetric) for the model's layers, each
layer with weights of its own, so the weights stream from memory as in a real step. The LM head
stays bf16 in a W4A16 checkpoint and is left out. Paths alternate (A B C D, then D C B A) for
`--rounds` rounds, each sample the mean of `--steps` steps after one warm-up; the table gives the
median round and every round. The C product is checked before timing against the float64 product
of the exactly dequantized weight, within the tests' bound, so a broken kernel cannot post a time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_gemv import model_shapes, time_alternating  # noqa: E402


def measure(layer: list[tuple[str, int, int]], layers: int, rows: list[int], group: int, steps: int, rounds: int,
            threads: int) -> list[dict[str, Any]]:
    import torch

    from lmfoundry.kernels.error_bounds import assert_within, dot_bound
    from lmfoundry.runtime.cpu.native.int4_gemm import dequantize, load_int4_gemm, pack

    torch.set_num_threads(threads)
    gemm = load_int4_gemm()
    if gemm is None:
        raise SystemExit("the int4 C product is not built here (no compiler or no AVX-512 BF16: "
                         "lmfoundry.runtime.cpu.native.build.unavailable_reason('int4_gemm'))")
    gen = torch.Generator().manual_seed(0)
    shapes = [(n, k) for _, n, k in layer] * layers
    codes = [torch.randint(0, 16, (n, k), generator=gen) for n, k in shapes]
    scales = [torch.rand(n, k // group, generator=gen) * 0.02 + 0.001 for n, k in shapes]
    weights4 = [pack(u, s, None, group) for u, s in zip(codes, scales, strict=True)]
    dense = [dequantize(w).to(torch.bfloat16) for w in weights4]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in dense]
    int4pack = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.int(), 1) for u in codes]
    scale_zeros = [torch.stack([s.t(), torch.zeros_like(s.t())], -1).to(torch.bfloat16).contiguous() for s in scales]
    scratch = {shape: torch.empty(shape, dtype=torch.bfloat16) for shape in set(shapes)}
    out: list[dict[str, Any]] = []
    for m in rows:
        xs = {k: torch.randn(m, k, generator=gen).to(torch.bfloat16) for k in {k for _, k in shapes}}
        ys = [torch.empty(m, n, dtype=torch.bfloat16) for n, _ in shapes]
        c = [partial(gemm, xs[k], w, None, y, threads) for (_, k), w, y in zip(shapes, weights4, ys, strict=True)]
        for idx in range(len(layer)):
            c[idx]()
            x, w = xs[shapes[idx][1]].double(), dequantize(weights4[idx]).double()
            ref = x @ w.t()
            k = shapes[idx][1]
            assert_within(ys[idx], ref, dot_bound(ref, x.abs() @ w.abs().t(), k + 2 * (k // group) + 2,
                                                  torch.bfloat16), f"int4 C product {shapes[idx]} M={m}")
        paths = {
            "int4 C": c,
            "int4pack": [partial(torch.ops.aten._weight_int4pack_mm_for_cpu, xs[k], p, group, sz)
                         for (_, k), p, sz in zip(shapes, int4pack, scale_zeros, strict=True)],
            "dequant+GEMM": [partial(_dequant_gemm, gemm, xs[k], w, scratch[(n, k)])
                             for (n, k), w in zip(shapes, weights4, strict=True)],
            "bf16 oneDNN": [partial(torch.ops.mkldnn._linear_pointwise, xs[k], p, None, "none", [], "")
                            for (_, k), p in zip(shapes, onednn, strict=True)],
        }
        samples = time_alternating(paths, rounds, steps)
        row = {"M": m, "ms": {name: statistics.median(v) for name, v in samples.items()}, "rounds": samples}
        row["speedup"] = {name: row["ms"][name] / row["ms"]["int4 C"] for name in paths if name != "int4 C"}
        out.append(row)
        print(f"rows {m:4d}  " + "  ".join(f"{name} {ms:8.2f} ms" for name, ms in row["ms"].items()) + "  "
              + "  ".join(f"{name}/C {v:.2f}" for name, v in row["speedup"].items()), flush=True)
    return out


def _dequant_gemm(gemm: Any, x: Any, w: Any, scratch: Any) -> Any:
    import torch

    return torch.matmul(x, gemm.dequantize(w, scratch).t())


def report(rows: list[dict[str, Any]], args: argparse.Namespace, shapes: Any, load: tuple[Any, Any]) -> str:
    from lmfoundry.runtime.cpu.features import describe

    layer, _, layers = shapes
    names = ", ".join(f"{name} {n}x{k}" for name, n, k in layer)
    base = list(rows[0]["ms"]) if rows else []
    others = [name for name in base if name != "int4 C"]
    lines = [f"# 4-bit products in a serving step: the int4 C product against the paths around it ({args.model})",
             "", f"Command: `python benchmarks/cpu_int4.py {' '.join(args.argv)}`".rstrip(), "",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, {args.threads} threads; load average "
             f"{list(load[0])} before, {list(load[1])} after. {args.rounds} rounds, paths alternating; each "
             f"sample the mean of {args.steps} steps. CPU: {describe()}.", "",
             f"One step: {layers} layers of {names} (W4 g{args.group}, each layer its own random codes): every "
             "weight streams from memory once per step. `x / C` is that path's time over the C product's "
             "(above 1: the C product is faster).", "",
             "| rows | " + " | ".join(f"{name} ms/step" for name in base) + " | "
             + " | ".join(f"{name} / C" for name in others) + " | every round (" + "; ".join(base) + ") |",
             "|---:|" + "---:|" * (len(base) + len(others)) + "---|"]
    for r in rows:
        rounds = "; ".join(", ".join(f"{v:.2f}" for v in r["rounds"][name]) for name in base)
        lines.append(f"| {r['M']} | " + " | ".join(f"{r['ms'][name]:.2f}" for name in base) + " | "
                     + " | ".join(f"{r['speedup'][name]:.2f}" for name in others) + f" | {rounds} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    import lmfoundry.model.config  # noqa: F401  (the package's import order: model before kernels)

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="model whose linear shapes are measured")
    p.add_argument("--rows", default="1,4,16,32,64,128,256,512", help="row counts (comma-separated)")
    p.add_argument("--group", type=int, default=64, help="group size of the codes")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--steps", type=int, default=3, help="steps per sample")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    args = p.parse_args()
    args.argv = sys.argv[1:]
    shapes = model_shapes(args.model)
    before = os.getloadavg()
    rows = measure(shapes[0], shapes[2], [int(r) for r in args.rows.split(",")], args.group, args.steps,
                   args.rounds, args.threads)
    load = (before, os.getloadavg())
    text = report(rows, args, shapes, load)
    print(text)
    if args.out:
        Path(f"{args.out}.md").write_text(text)
        Path(f"{args.out}.json").write_text(json.dumps({"argv": args.argv, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
