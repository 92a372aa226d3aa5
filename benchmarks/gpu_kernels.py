"""Check every lmfoundry kernel against its PyTorch reference on a GPU, and time it.

    python benchmarks/gpu_kernels.py                 # all kernels: check + time (Triton JIT)
    python benchmarks/gpu_kernels.py --engine ENGINE # also: launch ENGINE's shipped cubins (no JIT)
    python benchmarks/gpu_kernels.py --quick --json out.json

First it measures its own ceilings on this GPU — device copy bandwidth (GB/s) and dense matmul
throughput (bf16, int8, fp8 where available) — then, for each kernel and shape: a correctness check
at a small row count (error bounds from `lmfoundry.kernels.error_bounds`, poisoned outputs), and the
median time at each benchmark shape (`triton.testing.do_bench`), printed as achieved GB/s and
TFLOP/s with their fraction of the measured ceilings.

W4A16 on Llama-3-8B/70B layer shapes has its own section (`w4a16_llm_section`; `--only w4a16_llm`):
M = 1/16/64 with the weights HBM-resident (rotating copies exceed the L2), the tiled kernel against
dense bf16 `torch.matmul` (cuBLAS) and the compressed-tensors kernels it replaced.

Paged decode has its own section (`decode_section`; `--only paged_decode` runs just it and the
decode checks): batch 1/16/64 x 4096-token context, Llama-3-8B heads, bf16/int8/fp8 KV, with
FlashDecoding (`paged_decode`), the unsplit kernel it replaced and torch SDPA on a dense bf16 copy
of the same KV, each graph-timed and given as % of the copy bandwidth measured in the same run.

INT8/FP8 GEMM has its own section (`gemm8_section`; `--only gemm8`): M = N = K = 4096 and 8192
(TFLOP/s, % of the dense peak) and the 8B/70B layer shapes at M = 1/16/64 over rotating weight copies
(GB/s, % of copy bandwidth), each beside torch's kernel on the same operands (`torch._scaled_mm`
row-wise for FP8, `torch._int_mm` for INT8), both checked against the reference first.

Causal prefill has its own section (`prefill_section`; `--only prefill`): B x n-token prompts,
Llama-3-8B heads, bf16/int8/fp8 KV, against torch SDPA (flash) on dense bf16 of the same lengths,
TFLOP/s over the (query, key) pairs the causal mask keeps (`harness_attention.causal_attention_flops`).

`--engine` is the cross-version test of the cubin path: a bundle built on a CPU machine with
Triton 3.7.1 is loaded here (whatever torch/Triton this machine has), must select its cubins for
this arch, run every shipped specialization through the CUDA driver and pass the same checks,
with zero Triton compiles (counted) and zero JIT fallbacks.

Runs from a checkout without installing lmfoundry (the package folders are mapped on import).

The parts live beside this file: gpu_timing.py (the import mapping, the timers and the ceilings),
gpu_matmul_sections.py (W4A16 on LLM shapes, INT8/FP8 GEMM) and gpu_attention_sections.py (paged
decode, causal prefill); this file holds the command line, the per-kernel table (`run_all`), the
tile sweep and the `--engine` check.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules, from any working directory
import gpu_attention_sections  # noqa: E402
import gpu_matmul_sections  # noqa: E402
import gpu_timing  # noqa: E402  (maps the lmfoundry package folders on import)
import torch  # noqa: E402
from gpu_timing import BF, F16, acc_unit, ceilings, dense_ms, time_ms  # noqa: E402

from lmfoundry.kernels import harness  # noqa: E402
from lmfoundry.kernels.dispatch import JitLauncher  # noqa: E402


def cases(cap: int, quick: bool) -> list[tuple[str, dict, dict, dict, list[int]]]:
    """(kernel, types, semantics, shape, rows to time) — the default model's shapes and a 4096 one."""
    w4 = {"BITS": 4, "GROUP_SIZE": 64, "HAS_ZP": False, "HAS_GIDX": False, "HAS_BIAS": False}
    w4a = {"BITS": 4, "GROUP_SIZE": 128, "HAS_ZP": True, "HAS_GIDX": True, "HAS_BIAS": False}
    mm8 = {"A_PER_TOKEN": True, "B_PER_CHANNEL": True, "HAS_BIAS": False}
    attn = {"NUM_Q_HEADS": 32, "NUM_KV_HEADS": 8, "HEAD_DIM": 128, "PAGE": 16}
    big = [(4096, 4096)] if not quick else []
    out = []
    for n, k in [(960, 576), (3072, 576), (576, 1536)] + big:
        out.append(("w4a16_gemv", {"act": BF, "scale": BF}, w4, {"N": n, "K": k, "bits": 4}, [1, 4]))
        out.append(("w4a16_gemm", {"act": BF, "scale": BF}, w4, {"N": n, "K": k, "bits": 4}, [16, 256, 4096]))
    out.append(("w4a16_gemm", {"act": F16, "scale": F16}, w4a, {"N": 4096, "K": 4096, "bits": 4}, [256, 4096]))
    # the tiled layout compile writes (the engine's W4A16 kernel); the rows above are its baseline
    w4t = {"BITS": 4, "GROUP_SIZE": 64, "HAS_ZP": False, "HAS_BIAS": False}
    for n, k in [(960, 576), (3072, 576), (576, 1536)] + big:
        out.append(("w4a16_tiled", {"act": BF, "scale": BF}, w4t, {"N": n, "K": k, "bits": 4, "group": 64},
                    [1, 4, 16, 64, 256, 4096]))
    out.append(("w4a16_tiled", {"act": F16, "scale": F16}, {**w4t, "GROUP_SIZE": 128, "HAS_ZP": True},
                {"N": 4096, "K": 4096, "bits": 4, "group": 128}, [1, 16, 256, 4096]))
    for n, k in [(960, 576)] + big:
        out.append(("w8a8_gemm", {"a": "i8", "bscale": BF, "out": BF, "acc": "i32"}, {**mm8, "ACC_INT": True},
                    {"N": n, "K": k}, [1, 16, 64, 256, 4096]))
        if cap >= 89:
            out.append(("fp8_gemm", {"a": "fp8e4nv", "bscale": BF, "out": BF, "acc": "fp32"}, {**mm8, "ACC_INT": False},
                        {"N": n, "K": k}, [1, 16, 64, 256, 4096]))
    for q in (0, 1) + ((2,) if cap >= 89 else ()):
        out.append(("rmsnorm_quant", {"act": BF, "out": {0: BF, 1: "i8", 2: "fp8e4nv"}[q]},
                    {"APPLY_NORM": True, "HAS_RESIDUAL": True, "QUANT": q, "STATIC_SCALE": False}, {"H": 4096}, [1, 4096]))
    out.append(("silu_mul", {"act": BF}, {}, {"I": 14336}, [1, 4096]))
    out.append(("rotary", {"act": BF}, {"NUM_Q_HEADS": 32, "NUM_KV_HEADS": 8, "HEAD_DIM": 128}, {}, [1, 4096]))
    for kv, code in ((BF, 0), ("i8", 1)) + ((("fp8e4nv", 2),) if cap >= 89 else ()):
        out.append(("store_kv", {"act": BF, "kv": kv}, {"NUM_KV_HEADS": 8, "HEAD_DIM": 128, "PAGE": 16, "KV_QUANT": code},
                    {}, [1, 4096]))
        out.append(("paged_prefill", {"act": BF, "kv": kv}, {**attn, "KV_QUANT": code}, {"B": 4}, [512, 2048]))
        # decode kernels are checked here and timed against each other in `decode_section`
        out.append(("paged_decode_split", {"act": BF, "kv": kv}, {**attn, "KV_QUANT": code}, {"Hq": 32, "splits": 3}, []))
        out.append(("paged_decode_split", {"act": BF, "kv": kv}, {**attn, "KV_QUANT": code}, {"Hq": 32}, []))
        out.append(("paged_decode", {"act": BF, "kv": kv}, {**attn, "KV_QUANT": code}, {}, []))
    out.append(("paged_decode_reduce", {"act": BF}, {"NUM_Q_HEADS": 32, "HEAD_DIM": 128}, {"Hkv": 8, "splits": 5}, []))
    return out


def bench_shape(kernel: str, shape: dict, rows: int) -> dict:
    s = dict(shape)
    if kernel == "paged_prefill":
        s.update({"ctx": rows, "q_len": rows})
    elif kernel in ("paged_decode", "paged_decode_split", "paged_decode_reduce"):
        s.update({"B": rows, "ctx": 2048})
    else:
        s = harness.shape_for(kernel, s, rows)
    return s


def check_rows(kernel: str) -> int:
    return {"w4a16_gemv": 3, "paged_prefill": 80, "paged_decode": 3, "paged_decode_split": 3,
            "paged_decode_reduce": 3}.get(kernel, 37)


def run_all(args, cap: int, ceil: dict) -> list[dict]:
    from lmfoundry.kernels import tiles

    jit = JitLauncher(pick_config=lambda call: tiles.pick(cap, call))
    rows_out = []
    failures = 0
    for kernel, types, sem, shape, rows_list in cases(cap, args.quick):
        if args.only and kernel not in args.only and not (kernel.startswith("paged_decode") and "paged_decode" in args.only):
            continue
        label = f"{kernel} {types} {sem} {shape}"
        try:
            ex = harness.build(kernel, types, sem, bench_shape(kernel, shape, check_rows(kernel)), "cuda")
            harness.run_and_check(ex, jit, acc_unit(kernel, cap, jit.config_for(ex.call)))
            status = "ok"
        except Exception as exc:  # noqa: BLE001 - a wrong result or a toolchain error: report, go on
            status, failures = f"FAIL {type(exc).__name__}: {str(exc)[:400]}", failures + 1
        print(f"[check {status[:4]}] {label}" + ("" if status == "ok" else f"\n    {status}"), flush=True)
        for rows in rows_list if status == "ok" else []:
            ex = harness.build(kernel, types, sem, bench_shape(kernel, shape, rows), "cuda")
            ms = time_ms(ex, jit)
            gbps = ex.bytes / ms / 1e6
            tflops = ex.flops / ms / 1e9
            peak = {"w8a8_gemm": ceil.get("int8_TOPs"), "fp8_gemm": ceil.get("fp8_TFLOPs")}.get(kernel, ceil["bf16_TFLOPs"])
            row = {"kernel": kernel, "types": types, "semantics": sem, "shape": bench_shape(kernel, shape, rows),
                   "ms": ms, "GBps": gbps, "TFLOPs": tflops, "pct_copy_bw": 100 * gbps / ceil["copy_GBps"],
                   "pct_matmul": 100 * tflops / peak if peak and ex.flops else None, "check": status}
            if kernel.startswith("w4a16") and gpu_timing.TIME_WITH_GRAPH:  # the dense bf16 layer it replaces
                row["dense_bf16_ms"] = dense_ms(row["shape"])
                row["speedup_vs_dense"] = row["dense_bf16_ms"] / ms
            rows_out.append(row)
            mm = f" {tflops:7.1f} TFLOP/s ({row['pct_matmul']:5.1f}% of matmul)" if ex.flops else ""
            if "dense_bf16_ms" in row:
                mm += f"; dense bf16 {row['dense_bf16_ms'] * 1e3:.1f} us ({row['speedup_vs_dense']:.2f}x)"
            print(f"    rows={rows:<5} {ms * 1e3:9.1f} us {gbps:8.0f} GB/s ({row['pct_copy_bw']:5.1f}% of copy){mm}",
                  flush=True)
        if status != "ok":
            rows_out.append({"kernel": kernel, "types": types, "semantics": sem, "shape": shape, "check": status})
        if args.json:  # rewritten after every kernel so a crash later keeps what was measured
            Path(args.json).write_text(json.dumps({"ceilings": ceil, "rows": rows_out}, indent=1))
    print(f"{failures} check failures")
    return rows_out


SWEEP = {
    # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages); the GEMV sweep is at M=1
    "w4a16_gemm": [(bm, bn, bk, w, st) for bm, bn, bk, w in
                   [(64, 64, 64, 4), (64, 128, 64, 4), (64, 128, 128, 4), (64, 256, 64, 8), (128, 64, 64, 4),
                    (128, 128, 64, 8), (128, 128, 128, 8), (128, 256, 64, 8), (64, 128, 32, 4), (128, 128, 32, 8)]
                   for st in (3,)] + [(64, 128, 64, 4, 4), (128, 128, 64, 8, 4)],
    "w4a16_gemv": [(1, bn, bk, w, 2) for bn, bk, w in
                   [(8, 256, 4), (16, 256, 4), (32, 256, 4), (16, 128, 4), (16, 512, 4), (32, 128, 4),
                    (64, 128, 4), (8, 512, 4), (16, 256, 2), (32, 512, 8)]],
}


def sweep(args) -> list[dict]:
    """Time tile candidates of the W4A16 kernels on two shapes each (the table's inputs)."""
    from lmfoundry.kernels.spec import TileConfig

    out = []
    w4 = {"BITS": 4, "GROUP_SIZE": 64, "HAS_ZP": False, "HAS_GIDX": False, "HAS_BIAS": False}
    plan = {"w4a16_gemm": [((3072, 576), 256), ((4096, 4096), 4096), ((4096, 4096), 64)],
            "w4a16_gemv": [((3072, 576), 1), ((4096, 4096), 1)]}
    for kernel, shapes in plan.items():
        for (n, k), rows in shapes:
            best = None
            for bm, bn, bk, warps, stages in SWEEP[kernel]:
                if bm is not None and bm > 16 and rows <= 16:
                    continue
                tiles = {"BLOCK_N": bn, "BLOCK_K": bk} | ({"BLOCK_M": bm} if bm else {})
                cfg = TileConfig.make(num_warps=warps, num_stages=stages, **tiles)
                jit = JitLauncher(pick_config=lambda call, cfg=cfg: cfg)
                shape = harness.shape_for(kernel, {"N": n, "K": k, "bits": 4}, rows)
                try:
                    ex = harness.build(kernel, {"act": BF, "scale": BF}, w4, shape, "cuda")
                    harness.run_and_check(ex, jit, acc_unit(kernel, 90))
                    ms = time_ms(ex, jit)
                except Exception as exc:  # noqa: BLE001 - a config that does not compile/fit: skip it
                    print(f"  sweep {kernel} {shape} {cfg.as_dict()}: {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                out.append({"kernel": kernel, "shape": shape, "config": cfg.as_dict(), "ms": ms})
                if best is None or ms < best[0]:
                    best = (ms, cfg.as_dict())
            if best:
                print(f"sweep {kernel} N={n} K={k} rows={rows}: best {best[0] * 1e3:.1f} us {best[1]}", flush=True)
    return out


def verify_engine(path: str, cap: int) -> bool:
    """Load a bundle built elsewhere; every shipped kernel must run from its cubin and pass."""
    import triton

    from lmfoundry.kernels import registry
    from lmfoundry.runtime.kernel_set import load_engine

    compiles = {"n": 0}

    def counting(fn):
        def wrapper(*a, **kw):
            compiles["n"] += 1
            return fn(*a, **kw)
        return wrapper

    # JITFunction binds `triton.compiler.compile` when it first runs: patch where it is looked up.
    triton.compiler.compiler.compile = counting(triton.compiler.compiler.compile)
    triton.compiler.compile = triton.compiler.compiler.compile
    for kd in registry.KERNELS.values():
        if hasattr(kd.fn, "compile"):
            kd.fn.compile = counting(kd.fn.compile)
    t0 = time.perf_counter()
    try:
        ks = load_engine(path, "cuda")
    except Exception as exc:  # noqa: BLE001
        print(f"FAIL: loading {path}: {type(exc).__name__}: {exc}")
        return False
    print(f"engine {path}: mode={ks.mode} ({ks.reason}), loaded in {time.perf_counter() - t0:.2f} s; "
          f"torch {torch.__version__}, triton {triton.__version__} here, built with triton "
          f"{ks.manifest['toolchain']['triton']}")
    if ks.mode != "cubin":
        print("FAIL: the bundle was not used as cubins on this GPU")
        return False
    ok = True
    shipped = [k for ks_list in ks.launcher.index.values() for k in ks_list]
    for kernel in shipped:
        e = kernel.entry
        cover = e["covers"][0]
        lo, hi = cover["rows"]
        rows = min(hi, max(lo, check_rows(e["kernel"])))
        shape = bench_shape(e["kernel"], cover["shape"], rows)
        if e["kernel"] in ("paged_prefill", "paged_decode", "paged_decode_split", "paged_decode_reduce"):
            shape.update({"B": 2, "ctx": 80})
        if e["kernel"] in ("paged_decode_split", "paged_decode_reduce"):
            shape["splits"] = 3  # the partial-state path (a single split is the same code's other branch)
        try:
            ex = harness.build(e["kernel"], e["types"], e["semantics"], shape, "cuda")
            before = dict(ks.stats)
            runs_on = ks.launcher.find(ex.call)  # the cubin that runs it: its tiles bound the check
            harness.run_and_check(ex, ks.launcher, acc_unit(e["kernel"], cap, runs_on.config if runs_on else None))
            used = {k: ks.stats.get(k, 0) - before.get(k, 0) for k in ("cubin", "jit")}
            status = "ok" if used == {"cubin": 1, "jit": 0} else f"not from the cubin: {used}"
            ms = time_ms(ex, ks.launcher)
            print(f"[{status}] {e['key']} {e['sm']} {shape} {ms * 1e3:.1f} us")
            ok &= status == "ok"
        except Exception as exc:  # noqa: BLE001 - report every kernel, not only the first failure
            print(f"[FAIL] {e['key']} {shape}: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
            ok = False
    print(f"Triton compiles during the engine run: {compiles['n']}; stats {ks.stats}")
    return ok and compiles["n"] == 0 and ks.stats.get("jit", 0) == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", action="append", default=[],
                        help="engine bundle to verify (cubin launch, zero compiles); repeatable")
    parser.add_argument("--quick", action="store_true", help="skip the 4096-wide shapes")
    parser.add_argument("--skip-kernels", action="store_true", help="only verify --engine")
    parser.add_argument("--json", help="write the timing rows here")
    parser.add_argument("--only", type=lambda v: v.split(","), default=None,
                        help="comma list of kernels or sections to run (w4a16_llm: HBM-resident LLM-shape W4A16; "
                             "paged_decode: FlashDecoding vs SDPA; gemm8: INT8/FP8 GEMM vs torch._int_mm / "
                             "_scaled_mm; prefill: causal prefill vs SDPA)")
    parser.add_argument("--sweep", action="store_true", help="time W4A16 tile candidates (writes --json.sweep)")
    parser.add_argument("--graph", action="store_true",
                        help="time kernels by CUDA-graph replay (GPU time only, no Python dispatch)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("no CUDA GPU: this benchmark needs one (the CPU tests cover correctness via the interpreter)")
    import triton

    gpu_timing.TIME_WITH_GRAPH = args.graph  # read by time_ms and run_all
    major, minor = torch.cuda.get_device_capability()
    cap = major * 10 + minor
    print(f"{torch.cuda.get_device_name()} sm_{cap}; torch {torch.__version__}; triton {triton.__version__}")
    ok = True
    for engine in args.engine:
        ok &= verify_engine(engine, cap)
    if args.sweep:
        found = sweep(args)
        if args.json:
            Path(args.json + ".sweep").write_text(json.dumps(found, indent=1))
    rows = []
    if not args.skip_kernels:
        ceil = ceilings(cap)
        print("ceilings: " + ", ".join(f"{k} {v:.0f}" for k, v in ceil.items()))
        rows = run_all(args, cap, ceil)
        if (not args.only and not args.quick) or "w4a16_llm" in (args.only or []):
            rows += gpu_matmul_sections.w4a16_llm_section(args, cap, ceil)
        if not args.only or "paged_decode" in args.only:
            rows += gpu_attention_sections.decode_section(args, cap, ceil)
        if (not args.only and not args.quick) or "gemm8" in (args.only or []):
            rows += gpu_matmul_sections.gemm8_section(args, cap, ceil)
        if (not args.only and not args.quick) or "prefill" in (args.only or []):
            rows += gpu_attention_sections.prefill_section(args, cap, ceil)
        ok &= all(r["check"] == "ok" for r in rows)
        if args.json:
            Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                                   "triton": triton.__version__, "ceilings": ceil, "rows": rows},
                                                  indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
