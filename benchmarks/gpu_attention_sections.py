"""benchmarks/gpu_kernels.py's attention sections: paged decode and causal prefill.

Both time our paged-KV attention kernels against torch SDPA on a dense bf16 copy of the same
keys and values, at Llama-3-8B heads with bf16/int8/fp8 caches: decode as GB/s against the copy
bandwidth (FlashDecoding and the unsplit kernel it replaced), prefill as TFLOP/s over the causal
pairs against the bf16 peak. Run through `gpu_kernels.py --only paged_decode` / `--only prefill`
(or the full run); kept out of that file so the CLI and the per-kernel table stay readable. The
shapes and byte/FLOP counts are GPU-independent and tested on CPU.
"""

# The timing closures (B023) are each run inside the loop iteration that builds them.
# ruff: noqa: B023

from __future__ import annotations

import torch
from gpu_timing import BF, graph_ms

from lmfoundry.kernels import harness, harness_attention, harness_example
from lmfoundry.kernels.dispatch import JitLauncher

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
    from lmfoundry.kernels.kv_layout import PagedKVCache, dequantize_kv

    gen = torch.Generator(device="cuda").manual_seed(seed)
    b, n, hq, hkv, d, page = (case[k] for k in ("B", "ctx", "Hq", "Hkv", "D", "PAGE"))
    pages = -(-n // page)
    blocks = b * pages
    kv_dt = harness_example.TORCH_DTYPE[case["kv"]]
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


def decode_section(args, cap: int, ceil: dict) -> list[dict]:
    """FlashDecoding (`paged_decode`: split + merge, GQA per program) against the unsplit kernel it
    replaces and torch SDPA on a dense bf16 copy of the same KV, each as GB/s of the bytes it must
    move and as % of the device-to-device copy bandwidth measured at the start of this run. The
    first 4 sequences of every shape are checked against the reference (error_bounds.attention_bound)."""
    from lmfoundry.kernels import error_bounds, paged_attention, tiles

    jit = JitLauncher(pick_config=lambda call: tiles.pick(cap, call))
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
            "flash": lambda: paged_attention.paged_decode(q, cache, table, ctx, out=out_flash, launcher=jit),
            "unsplit": lambda: paged_attention.paged_decode_unsplit(q, cache, table, ctx, out=out_old, launcher=jit),
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
    (`harness_attention.causal_attention_flops`), ours reading the paged cache against torch SDPA (its flash
    backend on H100/H200) on dense bf16 [B, H, n, D] of the same lengths; % of the dense bf16 peak
    measured in this run. Correctness of the kernel at these heads is the per-kernel table's check."""
    from lmfoundry.kernels import tiles

    jit = JitLauncher(pick_config=lambda call: tiles.pick(cap, call))
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
        flops = harness_attention.causal_attention_flops([n] * b, [n] * b, hq, d)
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
