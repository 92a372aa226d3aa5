"""benchmarks/gpu_kernels.py's matmul sections: W4A16 on LLM layer shapes and INT8/FP8 GEMM.

Both time our GEMM kernels against torch's (cuBLAS dense bf16, `torch._int_mm`,
`torch._scaled_mm`) on Llama-3-8B/70B layer shapes at M = 1/16/64 over weight copies rotated past
the L2, so they share the shapes and the rotation; the GEMM section adds the square compute-bound
shapes. Each shape is checked against the reference before it is timed. Run through
`gpu_kernels.py --only w4a16_llm` / `--only gemm8` (or the full run); kept out of that file so the
CLI and the per-kernel table stay readable. The peer and check helpers are GPU-independent and
tested on CPU (tests/kernels/test_gpu_benchmark_sections.py).
"""

from __future__ import annotations

import torch
from gpu_timing import BF, acc_unit, rotated_ms

from lmfoundry.kernels import harness
from lmfoundry.kernels.dispatch import JitLauncher

# ---- W4A16 on LLM layer shapes, weights HBM-resident: tiled kernel vs dense bf16 cuBLAS ----------

# N x K of Llama-3-8B / 70B layers (8B: down 4096x14336, gate or up 14336x4096; 4096x28672 and
# 70B's down 8192x28672 as the long-K cases), g128 symmetric bf16 as GPTQ checkpoints ship them.
W4A16_LLM_SHAPES = [(4096, 14336), (14336, 4096), (4096, 28672), (8192, 28672)]
W4A16_LLM_ROWS = (1, 16, 64)
HBM_PASS_BYTES = 512 << 20  # weight bytes one timed pass reads, >= 4x the L2 too: DRAM, not L2, is timed


def w4a16_llm_section(args, cap: int, ceil: dict) -> list[dict]:
    """The decode regime the tiled W4A16 kernel exists for: M = 1/16/64 tokens on 8B/70B layer
    shapes, each of ours (`w4a16_tiled`, tile table of this arch), the compressed-tensors kernels it
    replaced (`w4a16_gemv`/`w4a16_gemm`) and dense bf16 `torch.matmul` (cuBLAS) timed over rotating
    weight copies that together exceed the L2 several times, so all three stream from HBM. Checked
    first against the dequantize-then-matmul reference with `error_bounds.exact_weight_bound`."""
    from functools import partial

    from lmfoundry.kernels import error_bounds, tiled_layout, tiles, w4a16, w4a16_tiled

    jit = JitLauncher(pick_config=lambda call: tiles.pick(cap, call))
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
                                               launcher=jit)
                error_bounds.assert_written(got, "w4a16_tiled")
                ref = (x.float() @ dense.float().t()).bfloat16().cpu()
                bound = error_bounds.exact_weight_bound(ref, x.cpu(), exact, offset, torch.bfloat16, weight_u, 2.0**-22)
                error_bounds.assert_within(got.cpu(), ref, bound, f"w4a16_tiled {n}x{k} M={m}")
            except Exception as exc:  # noqa: BLE001 - report, keep timing the others
                status = f"FAIL {type(exc).__name__}: {str(exc)[:300]}"
            ours = rotated_ms([partial(w4a16_tiled.w4a16_tiled_linear, x, t, out=out, launcher=jit) for t in tiled_copies])
            cublas = rotated_ms([partial(torch.matmul, x, w.t(), out=dout) for w in dense_copies])
            before = rotated_ms([partial(w4a16.w4a16_linear, x, w, out=lout, launcher=jit) for w in legacy_copies])
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


def gemm8_check(ex, launcher, acc_u) -> None:
    """Ours and the peer (its output mapped to ours) against the reference, under the same bound:
    the peer passing is what makes the time ratio a like-for-like one."""
    import dataclasses

    ref = harness.run_and_check(ex, launcher, acc_u)
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

    jit = JitLauncher(pick_config=lambda call: tiles.pick(cap, call))
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
                    ex = gemm8_example(kernel, 37, n, k, "cuda")
                    gemm8_check(ex, jit, acc_unit(kernel, cap, jit.config_for(ex.call)))
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
