"""The measuring half of benchmarks/gpu_kernels.py, shared by its per-kernel table and its sections.

Imported first by every part of that script: it maps the lmfoundry package folders on import (a
bare checkout runs without installing lmfoundry; benchmarks/gpu_serve.py uses the same mapping),
then gives what every number the script prints rests on: `triton.testing.do_bench` medians
(`bench`), per-call timing with or without CUDA-graph replay (`time_ms`, `graph_ms`, and
`rotated_ms` for weights kept out of the L2), the dense bf16 baseline (`dense_ms`), the copy
bandwidth and matmul peaks measured on this GPU (`ceilings`) and the accumulation unit the
correctness checks are bounded with (`acc_unit`). Kept apart so the sections can share them
without importing the CLI.
"""

from __future__ import annotations

import sys
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

BF, F16 = "bf16", "fp16"


def bench(fn, warmup: int = 25, rep: int = 100) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


GRAPH_REPEAT = 20
TIME_WITH_GRAPH = False  # set by --graph


def time_ms(ex, launcher) -> float:
    """Median ms of one call. Plain: `harness.time_ms` (Python dispatch + launch included, so
    calls under ~50 us measure the host). --graph: GRAPH_REPEAT calls captured in one CUDA graph,
    replayed and divided: the GPU time of the kernel alone."""
    if not TIME_WITH_GRAPH:
        return harness.time_ms(ex, launcher)
    call = ex.clone()
    return graph_ms(lambda: launcher.run(call), fallback=lambda: harness.time_ms(ex, launcher))


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


def graph_ms(fn, fallback=None) -> float:
    """GPU ms of one `fn()` by replaying GRAPH_REPEAT calls captured in one CUDA graph (so two
    kernel launches are not charged Python dispatch); `fallback()` (default: plain do_bench of
    `fn`) when capture fails, e.g. for an launcher that synchronizes."""
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


def acc_unit(kernel: str, cap: int, config=None):
    """How `kernel` accumulates on this GPU with tile `config` (the checks' `acc_u`). Tensor cores
    may truncate while accumulating: 2^-22 for the fp16/bf16 MMAs; the FP8 GEMM sums each BLOCK_K
    tile in the tensor core's coarser unit and the tiles in fp32 (`scaled_mm.fp8_accumulation`),
    which is bounded at any K where one 2^-13 unit over the whole K is not (K >= 2^13)."""
    if kernel == "fp8_gemm":
        from lmfoundry.kernels.scaled_mm import fp8_accumulation

        if config is None:
            raise ValueError("fp8_gemm's accumulation depends on its tile config (BLOCK_K, SPLIT_K)")
        return fp8_accumulation(config)
    return 2.0**-22
