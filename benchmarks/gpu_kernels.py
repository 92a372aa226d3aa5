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
TFLOP/s over the (query, key) pairs the causal mask keeps (`harness.causal_attention_flops`).

`--engine` is the cross-version test of the cubin path: a bundle built on a CPU machine with
Triton 3.7.1 is loaded here (whatever torch/Triton this machine has), must select its cubins for
this arch, run every shipped specialization through the CUDA driver and pass the same checks,
with zero Triton compiles (counted) and zero JIT fallbacks.

Runs from a checkout without installing lmfoundry (the package folders are mapped on import).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _bootstrap_import() -> None:
    """Make `import lmfoundry.kernels` work from a bare checkout (no editable install needed)."""
    try:
        import lmfoundry.kernels  # noqa: F401

        return
    except ImportError:
        pass
    import importlib.machinery
    import importlib.util

    mapping = {"lmfoundry": REPO / "lmfoundry", "lmfoundry.kernels": REPO / "kernels",
               "lmfoundry.compile": REPO / "compile", "lmfoundry.runtime": REPO / "runtime",
               "lmfoundry.runtime.engine": REPO / "runtime" / "engine", "lmfoundry.runtime.server": REPO / "runtime" / "server",
               "lmfoundry.quantizers": REPO / "quantizers", "lmfoundry.calibration": REPO / "calibration",
               "lmfoundry.evals": REPO / "evals", "lmfoundry.recipes": REPO / "recipes"}

    class Finder:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name in mapping:
                return importlib.util.spec_from_file_location(name, mapping[name] / "__init__.py",
                                                              submodule_search_locations=[str(mapping[name])])
            return None

    sys.meta_path.insert(0, Finder)


_bootstrap_import()

import torch  # noqa: E402

from lmfoundry.kernels import harness  # noqa: E402
from lmfoundry.kernels.dispatch import JitExecutor  # noqa: E402

BF, F16 = "bf16", "fp16"


def bench(fn, warmup: int = 25, rep: int = 100) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


GRAPH_REPEAT = 20
TIME_WITH_GRAPH = False  # set by --graph


def time_ms(ex, executor) -> float:
    """Median ms of one call. Plain: `harness.time_ms` (Python dispatch + launch included, so
    calls under ~50 us measure the host). --graph: GRAPH_REPEAT calls captured in one CUDA graph,
    replayed and divided: the GPU time of the kernel alone."""
    if not TIME_WITH_GRAPH:
        return harness.time_ms(ex, executor)
    call = ex.clone()
    return graph_ms(lambda: executor.run(call), fallback=lambda: harness.time_ms(ex, executor))


def dense_ms(shape: dict) -> float:
    """Graph-replay time of torch's bf16 `linear` (cuBLAS) for the same M, N, K: the baseline a
    weight-only kernel must beat when decoding is memory-bound."""
    x = torch.randn(shape["M"], shape["K"], device="cuda", dtype=torch.bfloat16)
    w = torch.randn(shape["N"], shape["K"], device="cuda", dtype=torch.bfloat16)
    torch.nn.functional.linear(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_REPEAT):
            torch.nn.functional.linear(x, w)
    return bench(graph.replay) / GRAPH_REPEAT


def ceilings(cap: int) -> dict[str, float]:
    """Copy bandwidth and matmul throughput measured on this GPU."""
    out: dict[str, float] = {}
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    out["copy_GBps"] = 2 * n / bench(lambda: dst.copy_(src)) / 1e6  # read + write
    src = dst = None  # free 2 GiB before the matmuls
    m = 8192
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    out["bf16_TFLOPs"] = 2 * m**3 / bench(lambda: a @ b) / 1e9
    ai = torch.randint(-127, 128, (m, m), device="cuda", dtype=torch.int8)
    bi = torch.randint(-127, 128, (m, m), device="cuda", dtype=torch.int8).t()
    try:
        out["int8_TOPs"] = 2 * m**3 / bench(lambda: torch._int_mm(ai, bi)) / 1e9
    except Exception as exc:  # noqa: BLE001 - report what is missing, keep going
        print(f"  (int8 ceiling unavailable: {exc})")
    if cap >= 89:
        af = a.to(torch.float8_e4m3fn)
        bf = b.to(torch.float8_e4m3fn).t()
        one = torch.ones((), device="cuda")
        try:
            out["fp8_TFLOPs"] = 2 * m**3 / bench(lambda: torch._scaled_mm(af, bf, one, one, out_dtype=torch.bfloat16)) / 1e9
        except Exception as exc:  # noqa: BLE001
            print(f"  (fp8 ceiling unavailable: {exc})")
    return out


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


def acc_unit(kernel: str, cap: int) -> float:
    # Tensor cores may truncate while accumulating; Hopper's fp8 wgmma keeps ~14 bits per K tile.
    return 2.0**-13 if kernel == "fp8_gemm" else 2.0**-22


def run_all(args, cap: int, ceil: dict) -> list[dict]:
    from lmfoundry.kernels import tiles

    jit = JitExecutor(pick_config=lambda call: tiles.pick(cap, call))
    rows_out = []
    failures = 0
    for kernel, types, sem, shape, rows_list in cases(cap, args.quick):
        if args.only and kernel not in args.only and not (kernel.startswith("paged_decode") and "paged_decode" in args.only):
            continue
        label = f"{kernel} {types} {sem} {shape}"
        try:
            ex = harness.build(kernel, types, sem, bench_shape(kernel, shape, check_rows(kernel)), "cuda")
            harness.run_and_check(ex, jit, acc_unit(kernel, cap))
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
            if kernel.startswith("w4a16") and TIME_WITH_GRAPH:  # the dense bf16 layer it replaces
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


# ---- W4A16 on LLM layer shapes, weights HBM-resident: tiled kernel vs dense bf16 cuBLAS ----------

# N x K of Llama-3-8B / 70B layers (8B: down 4096x14336, gate or up 14336x4096; 4096x28672 and
# 70B's down 8192x28672 as the long-K cases), g128 symmetric bf16 as GPTQ checkpoints ship them.
W4A16_LLM_SHAPES = [(4096, 14336), (14336, 4096), (4096, 28672), (8192, 28672)]
W4A16_LLM_ROWS = (1, 16, 64)
HBM_PASS_BYTES = 512 << 20  # weight bytes one timed pass reads, >= 4x the L2 too: DRAM, not L2, is timed


def rotated_ms(fns: list) -> float:
    """GPU ms per call when the callables run in turn, captured in one CUDA graph: with one weight
    copy per callable and more copies than fit in L2, every call reads its weight from DRAM."""
    for fn in fns:
        fn()  # compile, allocate split-K counters, warm cuBLAS outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    return bench(graph.replay) / len(fns)


def w4a16_llm_section(args, cap: int, ceil: dict) -> list[dict]:
    """The decode regime the tiled W4A16 kernel exists for: M = 1/16/64 tokens on 8B/70B layer
    shapes, each of ours (`w4a16_tiled`, tile table of this arch), the compressed-tensors kernels it
    replaced (`w4a16_gemv`/`w4a16_gemm`) and dense bf16 `torch.matmul` (cuBLAS) timed over rotating
    weight copies that together exceed the L2 several times, so all three stream from HBM. Checked
    first against the dequantize-then-matmul reference with `error_bounds.exact_weight_bound`."""
    from functools import partial

    from lmfoundry.kernels import error_bounds, tiled_layout, tiles, w4a16, w4a16_tiled

    jit = JitExecutor(pick_config=lambda call: tiles.pick(cap, call))
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    need = max(HBM_PASS_BYTES, 4 * l2)
    rows: list[dict] = []
    print(f"W4A16 (g128 sym, bf16) vs dense bf16 on LLM shapes, HBM-resident (L2 {l2 >> 20} MiB, "
          f">= {need >> 20} MiB of weights per timed pass)")
    for n, k in W4A16_LLM_SHAPES:
        gen = torch.Generator().manual_seed(n * 7 + k)
        group = 128
        packed = w4a16.PackedLinear(
            tiled_layout.pack_codes(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32), 4, 1),
            (torch.rand(n, k // group, generator=gen) * 0.02 + 0.002).bfloat16(), 4, group, k)
        tiled = tiled_layout.repack_tiled(packed)
        exact, offset, weight_u = w4a16_tiled.tiled_error_terms(tiled, torch.bfloat16)
        tiled = tiled.to("cuda")
        dense = packed.dequantize().to(torch.bfloat16).cuda()  # the same weights, dense
        legacy = w4a16.PackedLinear(packed.weight_packed.cuda(), packed.weight_scale.cuda(), 4, group, k)
        copies = lambda nbytes: max(2, -(-need // nbytes))  # noqa: E731
        tiled_copies = [tiled] + [tiled_layout.TiledLinear(tiled.qweight.clone(), tiled.scale.clone(), 4, group, k, n)
                                  for _ in range(copies(tiled.nbytes()) - 1)]
        dense_copies = [dense] + [dense.clone() for _ in range(copies(dense.numel() * 2) - 1)]
        legacy_bytes = legacy.weight_packed.numel() * 4 + legacy.weight_scale.numel() * 2
        legacy_copies = [legacy] + [w4a16.PackedLinear(legacy.weight_packed.clone(), legacy.weight_scale.clone(), 4,
                                                       group, k) for _ in range(copies(legacy_bytes) - 1)]
        for m in W4A16_LLM_ROWS:
            x = torch.randn(m, k, generator=gen).bfloat16().cuda()
            out, dout, lout = (torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in range(3))
            cfg = tiles.pick(cap, w4a16_tiled.make_tiled_call(x, tiled, out))
            status = "ok"
            try:
                got = w4a16_tiled.w4a16_tiled_linear(x, tiled, out=error_bounds.poisoned((m, n), torch.bfloat16, "cuda"),
                                               executor=jit)
                error_bounds.assert_written(got, "w4a16_tiled")
                ref = (x.float() @ dense.float().t()).bfloat16().cpu()
                bound = error_bounds.exact_weight_bound(ref, x.cpu(), exact, offset, torch.bfloat16, weight_u, 2.0**-22)
                error_bounds.assert_within(got.cpu(), ref, bound, f"w4a16_tiled {n}x{k} M={m}")
            except Exception as exc:  # noqa: BLE001 - report, keep timing the others
                status = f"FAIL {type(exc).__name__}: {str(exc)[:300]}"
            ours = rotated_ms([partial(w4a16_tiled.w4a16_tiled_linear, x, t, out=out, executor=jit) for t in tiled_copies])
            cublas = rotated_ms([partial(torch.matmul, x, w.t(), out=dout) for w in dense_copies])
            before = rotated_ms([partial(w4a16.w4a16_linear, x, w, out=lout, executor=jit) for w in legacy_copies])
            gbps = tiled.nbytes() / ours / 1e6
            row = {"section": "w4a16_llm", "kernel": "w4a16_tiled", "shape": {"N": n, "K": k, "M": m, "group": group},
                   "config": cfg.as_dict(), "ms": ours, "GBps": gbps, "pct_copy_bw": 100 * gbps / ceil["copy_GBps"],
                   "dense_bf16_ms": cublas, "speedup_vs_dense": cublas / ours, "legacy_ms": before,
                   "speedup_vs_legacy": before / ours, "weight_copies": len(tiled_copies), "check": status}
            rows.append(row)
            print(f"  [{status[:4]}] {n}x{k} M={m:<3} tiled {ours * 1e3:8.1f} us {gbps:6.0f} GB/s "
                  f"({row['pct_copy_bw']:4.0f}% of copy) | dense bf16 {cublas * 1e3:8.1f} us "
                  f"({cublas / ours:4.2f}x) | before {before * 1e3:8.1f} us ({before / ours:4.2f}x) "
                  f"tiles {dict(cfg.constexprs)} w{cfg.num_warps} s{cfg.num_stages}", flush=True)
            if status != "ok":
                print(f"    {status}")
        del tiled_copies, dense_copies, legacy_copies
        torch.cuda.empty_cache()
    return rows


# ---- paged decode: FlashDecoding vs the unsplit kernel vs torch SDPA -----------------------------
# Llama-3-8B attention (32 query heads, 8 KV heads, head_dim 128), blocks of 16, one decode token per
# sequence over a 4096-token context; batch 64 is the serving case, 1 and 16 the latency cases.
DECODE_BATCHES = (1, 16, 64)
DECODE_CONTEXT = 4096
DECODE_HEADS = {"Hq": 32, "Hkv": 8, "D": 128, "PAGE": 16}


def decode_cases(cap: int, quick: bool) -> list[dict]:
    """The section's shapes: bf16 queries over bf16, int8 and (sm_89+) fp8 KV caches."""
    kvs = [BF, "i8"] + (["fp8e4nv"] if cap >= 89 else [])
    if quick:
        kvs = kvs[:1]
    return [{"B": b, "ctx": DECODE_CONTEXT, **DECODE_HEADS, "act": BF, "kv": kv} for kv in kvs for b in DECODE_BATCHES]


def decode_bytes(case: dict) -> dict[str, int]:
    """Bytes each implementation must move at least once: every cached key and value of every
    sequence (at the cache's width; SDPA reads a dense bf16 copy), the block table, q and out."""
    width = {BF: 2, "i8": 1, "fp8e4nv": 1}
    b, n, hq, hkv, d = case["B"], case["ctx"], case["Hq"], case["Hkv"], case["D"]
    qo = 2 * b * hq * d * 2
    kv = 2 * b * n * hkv * d
    table = b * -(-n // case["PAGE"]) * 4 + b * 4
    return {"paged": kv * width[case["kv"]] + table + qo, "sdpa": kv * 2 + qo}


def decode_inputs(case: dict, seed: int = 0):
    """Random cache (codes drawn directly in the storage dtype, scales > 0), shuffled block table,
    queries; and the same keys/values dense [B, Hkv, ctx, D] in bf16 for SDPA."""
    from lmfoundry.kernels.paged_kv import PagedKVCache, dequantize_kv

    gen = torch.Generator(device="cuda").manual_seed(seed)
    b, n, hq, hkv, d, page = (case[k] for k in ("B", "ctx", "Hq", "Hkv", "D", "PAGE"))
    pages = -(-n // page)
    blocks = b * pages
    kv_dt = harness.TORCH_DTYPE[case["kv"]]
    shape = (blocks, page, hkv, d)

    def codes() -> torch.Tensor:
        x = torch.randn(shape, generator=gen, device="cuda")
        if kv_dt == torch.int8:
            return (x * 40).round().clamp(-127, 127).to(torch.int8)
        if kv_dt == torch.float8_e4m3fn:
            return (x * 40).clamp(-448, 448).to(kv_dt)
        return x.to(kv_dt)

    scale = (torch.rand(hkv, generator=gen, device="cuda") * 0.02 + 0.01) if kv_dt != torch.bfloat16 else None
    cache = PagedKVCache(codes(), codes(), *(s if s is not None else torch.ones(hkv, device="cuda")
                                            for s in (scale, scale)))
    table = torch.randperm(blocks, generator=gen, device="cuda").to(torch.int32).view(b, pages)
    ctx = torch.full((b,), n, dtype=torch.int32, device="cuda")
    q = torch.randn(b, hq, d, generator=gen, device="cuda").to(torch.bfloat16)

    def dense(c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        x = dequantize_kv(c[table.long()].reshape(b, pages * page, hkv, d)[:, :n], s)
        return x.to(torch.bfloat16).transpose(1, 2).contiguous()  # [B, Hkv, ctx, D]

    return cache, table, ctx, q, dense(cache.key_cache, cache.k_scale), dense(cache.value_cache, cache.v_scale)


def graph_ms(fn, fallback=None) -> float:
    """GPU ms of one `fn()` by replaying GRAPH_REPEAT calls captured in one CUDA graph (so two
    kernel launches are not charged Python dispatch); `fallback()` (default: plain do_bench of
    `fn`) when capture fails, e.g. for an executor that synchronizes."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile / load outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(GRAPH_REPEAT):
                fn()
    except Exception as exc:  # noqa: BLE001 - report and time with dispatch instead
        print(f"    (graph capture failed, timing with dispatch: {type(exc).__name__}: {str(exc)[:120]})")
        torch.cuda.synchronize()
        return fallback() if fallback is not None else bench(fn)
    return bench(graph.replay) / GRAPH_REPEAT


def decode_section(args, cap: int, ceil: dict) -> list[dict]:
    """FlashDecoding (`paged_decode`: split + merge, GQA per program) against the unsplit kernel it
    replaces and torch SDPA on a dense bf16 copy of the same KV, each as GB/s of the bytes it must
    move and as % of the device-to-device copy bandwidth measured at the start of this run. The
    first 4 sequences of every shape are checked against the reference (error_bounds.attention_bound)."""
    from lmfoundry.kernels import error_bounds, paged_attention, tiles

    jit = JitExecutor(pick_config=lambda call: tiles.pick(cap, call))
    sms = paged_attention.device_sm_count(torch.device("cuda"))
    copy = ceil["copy_GBps"]
    print(f"paged decode, Hq {DECODE_HEADS['Hq']} / Hkv {DECODE_HEADS['Hkv']} / D {DECODE_HEADS['D']}, "
          f"ctx {DECODE_CONTEXT}, {sms} SMs; copy {copy:.0f} GB/s", flush=True)
    rows = []
    for case in decode_cases(cap, args.quick):
        cache, table, ctx, q, k_dense, v_dense = decode_inputs(case)
        splits = paged_attention.decode_splits(case["B"], case["Hkv"], table.shape[1] * case["PAGE"], sms, case["PAGE"])
        out_flash, out_old = torch.empty_like(q), torch.empty_like(q)
        qd = q[:, :, None, :]  # [B, Hq, 1, D]
        runs = {
            "flash": lambda: paged_attention.paged_decode(q, cache, table, ctx, out=out_flash, executor=jit),
            "unsplit": lambda: paged_attention.paged_decode_unsplit(q, cache, table, ctx, out=out_old, executor=jit),
            "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(qd, k_dense, v_dense, enable_gqa=True),
        }
        nbytes = decode_bytes(case)
        row: dict = {"section": "paged_decode", "shape": {k: case[k] for k in ("B", "ctx", "Hq", "Hkv", "D", "PAGE")},
                     "kv": case["kv"], "splits": splits}
        status = "ok"
        try:
            runs["flash"]()
            runs["unsplit"]()
            torch.cuda.synchronize()
            n = min(4, case["B"])
            sub = table[:n].cpu()
            cpu_cache = type(cache)(*(t.cpu() for t in (cache.key_cache, cache.value_cache, cache.k_scale, cache.v_scale)))
            cu = torch.arange(n + 1, dtype=torch.int32)
            sm = 1 / (case["D"] ** 0.5)
            ref = paged_attention.reference(q[:n].cpu(), cpu_cache, sub, cu, ctx[:n].cpu(), sm)
            for name, got, kw in (("flash", out_flash, {"p_split": True, "splits": splits}), ("unsplit", out_old, {})):
                bound = error_bounds.attention_bound(q[:n].cpu(), cpu_cache, sub, cu, ctx[:n].cpu(), ref, sm,
                                               torch.bfloat16 if kw else torch.float32, **kw)
                error_bounds.assert_within(got[:n].cpu(), ref, bound, f"{name} decode")
        except Exception as exc:  # noqa: BLE001 - a wrong result: report, keep timing the others
            status = f"FAIL {type(exc).__name__}: {str(exc)[:300]}"
        row["check"] = status
        line = []
        for name, fn in runs.items():
            ms = graph_ms(fn)
            moved = nbytes["sdpa" if name == "sdpa" else "paged"]
            gbps = moved / ms / 1e6
            row[name] = {"us": ms * 1e3, "GBps": gbps, "pct_copy_bw": 100 * gbps / copy}
            line.append(f"{name} {ms * 1e3:8.1f} us {gbps:6.0f} GB/s ({100 * gbps / copy:4.1f}%)")
        row["speedup_vs_unsplit"] = row["unsplit"]["us"] / row["flash"]["us"]
        row["speedup_vs_sdpa"] = row["sdpa"]["us"] / row["flash"]["us"]
        print(f"[check {status[:4]}] kv {case['kv']:8} B={case['B']:<3} splits {splits:<3} " + " | ".join(line)
              + f" | x{row['speedup_vs_unsplit']:.2f} vs unsplit, x{row['speedup_vs_sdpa']:.2f} vs SDPA", flush=True)
        if status != "ok":
            print(f"    {status}")
        rows.append(row)
    return rows


# ---- INT8 / FP8 GEMM beside torch's own: square compute-bound shapes and HBM-bound decode ---------
# Square M = N = K (the 4096^3 and 8192^3: tensor-core bound) and the Llama-3-8B/70B layer
# shapes at M = 1/16/64 over rotating weight copies (weight-read bound). Per-token activation and
# per-channel weight scales, bf16 out: what a W8A8 / FP8-dynamic checkpoint runs.
GEMM8_SQUARE = (4096, 8192)
GEMM8_LLM_ROWS = (1, 16, 64)
GEMM8_TYPES = {"w8a8_gemm": {"a": "i8", "bscale": BF, "out": BF, "acc": "i32"},
               "fp8_gemm": {"a": "fp8e4nv", "bscale": BF, "out": BF, "acc": "fp32"}}
GEMM8_SEM = {"A_PER_TOKEN": True, "B_PER_CHANNEL": True, "HAS_BIAS": False}


def gemm8_kernels(cap: int) -> list[str]:
    """INT8 everywhere; FP8 from sm_89 (Ada, Hopper)."""
    return ["w8a8_gemm"] + (["fp8_gemm"] if cap >= 89 else [])


def gemm8_example(kernel: str, m: int, n: int, k: int, device: str):
    """Random operands and scales for our scaled GEMM (examples' builder: checked against its reference)."""
    return harness.build(kernel, GEMM8_TYPES[kernel], {**GEMM8_SEM, "ACC_INT": kernel == "w8a8_gemm"},
                          {"M": m, "N": n, "K": k}, device)


def gemm8_peer(call):
    """torch's own kernel on the same operands: `torch._scaled_mm` with row-wise scales (cuBLASLt;
    the same per-token x per-channel epilogue as ours) for FP8; for INT8 `torch._int_mm`, which
    returns the raw int32 products with no scaling at all, so its time is a floor under any scaled
    INT8 GEMM torch could offer (M <= 16 is padded to 32 rows, as CUDA's _int_mm requires M > 16).
    Returns (fn, to_out): to_out maps fn's result to our output."""
    a, b = call.args["a_ptr"], call.args["b_ptr"]
    out_dtype = call.args["out_ptr"].dtype
    sa = call.args["a_scale_ptr"].float().reshape(-1, 1)
    sb = call.args["b_scale_ptr"].float().reshape(1, -1)
    if a.dtype == torch.int8:
        m = a.shape[0]
        if a.is_cuda and m <= 16:  # CUDA's _int_mm wants M > 16: pad (the weight read is the cost there)
            a = torch.cat([a, a.new_zeros(32 - m, a.shape[1])])
        return (lambda: torch._int_mm(a, b.t())), (lambda r: (r[:m].float() * sa * sb).to(out_dtype))
    return (lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)), (lambda r: r)


def gemm8_check(ex, executor, acc_u: float) -> None:
    """Ours and the peer (its output mapped to ours) against the reference, under the same bound:
    the peer passing is what makes the time ratio a like-for-like one."""
    import dataclasses

    ref = harness.run_and_check(ex, executor, acc_u)
    fn, to_out = gemm8_peer(ex.call)
    peer = dataclasses.replace(ex.call, args={**ex.call.args, "out_ptr": to_out(fn())})
    ex.check(peer, ref, acc_u)


def gemm8_section(args, cap: int, ceil: dict) -> list[dict]:
    """Our INT8/FP8 GEMM (per-arch tile table, split-K for small M) against torch's kernel on the
    same operands. Square M=N=K: TFLOP/s and % of the dense peak measured at the start of this run.
    LLM shapes at M = 1/16/64: weight copies rotated past the L2 so both read from HBM; GB/s of the
    weight bytes and % of the copy bandwidth. Each shape is checked first at 37 rows (ours and the
    peer, against the reference with `error_bounds.dot_bound`)."""
    from functools import partial

    from lmfoundry.kernels import scaled_mm, tiles

    jit = JitExecutor(pick_config=lambda call: tiles.pick(cap, call))
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    need = max(HBM_PASS_BYTES, 4 * l2)
    rows: list[dict] = []
    plan = [(sq, sq, sq, 1) for sq in GEMM8_SQUARE] + [(m, n, k, 0) for n, k in W4A16_LLM_SHAPES for m in GEMM8_LLM_ROWS]
    for kernel in gemm8_kernels(cap):
        peak = ceil.get("int8_TOPs" if kernel == "w8a8_gemm" else "fp8_TFLOPs")
        print(f"{kernel} vs {'torch._int_mm (int32, unscaled)' if kernel == 'w8a8_gemm' else 'torch._scaled_mm row-wise'}"
              f" (dense peak {peak or 0:.0f}, L2 {l2 >> 20} MiB)", flush=True)
        checked: dict[tuple[int, int], str] = {}
        for m, n, k, square in plan:
            if (n, k) not in checked:
                try:
                    gemm8_check(gemm8_example(kernel, 37, n, k, "cuda"), jit, acc_unit(kernel, cap))
                    checked[(n, k)] = "ok"
                except Exception as exc:  # noqa: BLE001 - report, keep timing
                    checked[(n, k)] = f"FAIL {type(exc).__name__}: {str(exc)[:300]}"
            ex = gemm8_example(kernel, m, n, k, "cuda")
            c = ex.call
            weight_bytes = n * k + c.args["b_scale_ptr"].numel() * c.args["b_scale_ptr"].element_size()
            copies = 1 if square else max(2, -(-need // weight_bytes))
            calls = [c] + [scaled_mm.make_call(c.kernel, c.args["a_ptr"], c.args["a_scale_ptr"], c.args["b_ptr"].clone(),
                                               c.args["b_scale_ptr"].clone(), None, torch.empty_like(c.args["out_ptr"]),
                                               a_per_token=True, b_per_channel=True) for _ in range(copies - 1)]
            ours = rotated_ms([partial(jit.run, call) for call in calls])
            row = {"section": "gemm8", "kernel": kernel, "shape": {"M": m, "N": n, "K": k}, "ms": ours,
                   "config": tiles.pick(cap, c).as_dict(), "weight_copies": copies, "check": checked[(n, k)]}
            try:
                peer_ms = rotated_ms([gemm8_peer(call)[0] for call in calls])
                row.update({"peer_ms": peer_ms, "ratio_vs_peer": peer_ms / ours})
            except RuntimeError as exc:  # a torch build without the kernel for this arch / dtype
                row["peer"] = f"n/a: {str(exc).splitlines()[0][:160]}"
            tflops = 2 * m * n * k / ours / 1e9
            gbps = weight_bytes / ours / 1e6
            row.update({"TFLOPs": tflops, "pct_peak": 100 * tflops / peak if peak else None, "GBps": gbps,
                        "pct_copy_bw": 100 * gbps / ceil["copy_GBps"]})
            rows.append(row)
            vs = (f"peer {row['peer_ms'] * 1e3:8.1f} us (ours x{row['ratio_vs_peer']:.2f})" if "peer_ms" in row
                  else row["peer"])
            what = (f"{tflops:6.0f} TFLOP/s ({row['pct_peak'] or 0:4.0f}% of peak)" if square
                    else f"{gbps:6.0f} GB/s ({row['pct_copy_bw']:4.0f}% of copy)")
            print(f"  [{row['check'][:4]}] M={m:<5} {n}x{k} ours {ours * 1e3:8.1f} us {what} | {vs} | "
                  f"tiles {row['config']}", flush=True)
            del calls
            torch.cuda.empty_cache()
    return rows


# ---- causal prefill: our paged kernel vs torch SDPA (flash) on the same lengths, dense bf16 KV ------
PREFILL_CASES = ((1, 4096), (4, 2048), (4, 4096))  # (sequences, tokens each); all of each is prompt
PREFILL_HEADS = {"NUM_Q_HEADS": 32, "NUM_KV_HEADS": 8, "HEAD_DIM": 128, "PAGE": 16}


def prefill_cases(cap: int) -> list[dict]:
    """Each (B, n) with bf16, int8 and (sm_89+) fp8 KV: a whole prompt of n tokens per sequence."""
    kvs = [(BF, 0), ("i8", 1)] + ([("fp8e4nv", 2)] if cap >= 89 else [])
    return [{"B": b, "ctx": n, "q_len": n, "uniform": 1, "kv": kv, "KV_QUANT": code}
            for kv, code in kvs for b, n in PREFILL_CASES]


def prefill_section(args, cap: int, ceil: dict) -> list[dict]:
    """Causal prefill TFLOP/s with FLOPs counted over the (query, key) pairs the mask keeps
    (`harness.causal_attention_flops`), ours reading the paged cache against torch SDPA (its flash
    backend on H100/H200) on dense bf16 [B, H, n, D] of the same lengths; % of the dense bf16 peak
    measured in this run. Correctness of the kernel at these heads is the per-kernel table's check."""
    from lmfoundry.kernels import tiles

    jit = JitExecutor(pick_config=lambda call: tiles.pick(cap, call))
    hq, hkv, d = PREFILL_HEADS["NUM_Q_HEADS"], PREFILL_HEADS["NUM_KV_HEADS"], PREFILL_HEADS["HEAD_DIM"]
    print(f"causal prefill, Hq {hq} / Hkv {hkv} / D {d}; dense bf16 peak {ceil['bf16_TFLOPs']:.0f} TFLOP/s", flush=True)
    rows = []
    for case in prefill_cases(cap):
        b, n = case["B"], case["ctx"]
        ex = harness.build("paged_prefill", {"act": BF, "kv": case["kv"]}, {**PREFILL_HEADS, "KV_QUANT": case["KV_QUANT"]},
                            {k: case[k] for k in ("B", "ctx", "q_len", "uniform")}, "cuda")
        call = ex.clone()
        ours = graph_ms(lambda: jit.run(call))
        q = torch.randn(b, hq, n, d, device="cuda", dtype=torch.bfloat16)
        kd, vd = (torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        sdpa = graph_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, kd, vd, is_causal=True,
                                                                                 enable_gqa=True))
        flops = harness.causal_attention_flops([n] * b, [n] * b, hq, d)
        assert flops == ex.flops  # the example counts the same causal pairs
        row = {"section": "prefill", "shape": {"B": b, "n": n, **PREFILL_HEADS}, "kv": case["kv"], "ms": ours,
               "TFLOPs": flops / ours / 1e9, "sdpa_ms": sdpa, "sdpa_TFLOPs": flops / sdpa / 1e9,
               "ratio_vs_sdpa": sdpa / ours, "config": tiles.pick(cap, call).as_dict(), "check": "ok"}
        row["pct_peak"] = 100 * row["TFLOPs"] / ceil["bf16_TFLOPs"]
        rows.append(row)
        print(f"  kv {case['kv']:8} B={b} n={n:<5} ours {ours * 1e3:9.1f} us {row['TFLOPs']:6.1f} TFLOP/s "
              f"({row['pct_peak']:4.1f}% of bf16 peak) | SDPA bf16 {sdpa * 1e3:9.1f} us {row['sdpa_TFLOPs']:6.1f} "
              f"TFLOP/s | ours x{row['ratio_vs_sdpa']:.2f}", flush=True)
    return rows


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
                jit = JitExecutor(pick_config=lambda call, cfg=cfg: cfg)
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
    shipped = [k for ks_list in ks.executor.index.values() for k in ks_list]
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
            harness.run_and_check(ex, ks.executor, acc_unit(e["kernel"], cap))
            used = {k: ks.stats.get(k, 0) - before.get(k, 0) for k in ("cubin", "jit")}
            status = "ok" if used == {"cubin": 1, "jit": 0} else f"not from the cubin: {used}"
            ms = time_ms(ex, ks.executor)
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

    global TIME_WITH_GRAPH
    TIME_WITH_GRAPH = args.graph
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
            rows += w4a16_llm_section(args, cap, ceil)
        if not args.only or "paged_decode" in args.only:
            rows += decode_section(args, cap, ceil)
        if (not args.only and not args.quick) or "gemm8" in (args.only or []):
            rows += gemm8_section(args, cap, ceil)
        if (not args.only and not args.quick) or "prefill" in (args.only or []):
            rows += prefill_section(args, cap, ceil)
        ok &= all(r["check"] == "ok" for r in rows)
        if args.json:
            Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                                   "triton": triton.__version__, "ceilings": ceil, "rows": rows},
                                                  indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
