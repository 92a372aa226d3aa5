"""Per-architecture tile tables: which tile configuration each kernel uses for which rows.

Why tables and not autotuning at build time: the build machine has no GPU. The tables encode the
usual shape of good configs per generation — Ampere (sm_80, 164 KiB shared memory per SM) and Ada
(sm_89, 100 KiB, so fewer pipeline stages) run `mma.sync` tiles; Hopper (sm_90a) needs 64-row
warpgroup tiles for `wgmma`, so its small-M GEMM bucket still uses BLOCK_M=64. `--tune` replaces an
entry by measurement when a GPU of that arch is present.

A GEMM table is a list of (max_rows, config) buckets, ascending; rows above the last bound use the
last entry. Kernels without a row dimension use their shape-derived default, with per-arch warps.
"""

from __future__ import annotations

from typing import Mapping

from lmfoundry.gpus import ARCH_OF_CAPABILITY, SM_NAME  # noqa: F401  (compile/plan.py reads them as tiles.*)
from lmfoundry.kernels import registry, w4a16
from lmfoundry.kernels.spec import KernelCall, TileConfig, next_pow2

UNBOUNDED = 1 << 30


def cfg(bm: int | None, bn: int, bk: int, warps: int, stages: int) -> TileConfig:
    kw = {"BLOCK_N": bn, "BLOCK_K": bk}
    if bm is not None:
        kw["BLOCK_M"] = bm
    return TileConfig.make(num_warps=warps, num_stages=stages, **kw)


# kernel -> arch -> [(max_rows, config)]
GEMM_TABLES: dict[str, dict[int, list[tuple[int, TileConfig]]]] = {
    "w4a16_gemm": {
        80: [(32, cfg(32, 64, 64, 4, 3)), (128, cfg(64, 128, 64, 4, 3)), (UNBOUNDED, cfg(128, 128, 64, 8, 3))],
        89: [(32, cfg(32, 64, 64, 4, 2)), (128, cfg(64, 128, 64, 4, 2)), (UNBOUNDED, cfg(128, 64, 64, 4, 3))],
        # H200 sweep (benchmarks/results/gpu_kernels_h200.md): 64x64 tiles win at M <= 128
        90: [(128, cfg(64, 64, 64, 4, 3)), (UNBOUNDED, cfg(128, 128, 64, 8, 3))],
    },
    "w4a16_gemv": {
        # Few output columns per program (many programs to stream the weight), a long k-tile.
        # M=1 alone; 2..4 rows share each weight tile (BLOCK_M 4)
        80: [(1, cfg(1, 8, 256, 4, 2)), (UNBOUNDED, cfg(4, 8, 256, 4, 2))],
        89: [(1, cfg(1, 8, 256, 4, 2)), (UNBOUNDED, cfg(4, 8, 256, 4, 2))],
        # H200, graph-timed sweep: 8x256 4.1 us at 3072x576, 14.2 us at 4096x4096 (8x512: 4.3 / 13.7)
        90: [(1, cfg(1, 8, 256, 4, 2)), (UNBOUNDED, cfg(4, 8, 256, 4, 2))],
    },
    "w8a8_gemm": {
        80: [(32, cfg(32, 64, 128, 4, 3)), (128, cfg(64, 128, 128, 4, 3)), (UNBOUNDED, cfg(128, 128, 128, 8, 3))],
        89: [(32, cfg(32, 64, 128, 4, 2)), (128, cfg(64, 128, 128, 4, 2)), (UNBOUNDED, cfg(128, 64, 128, 4, 3))],
        90: [(128, cfg(64, 128, 128, 4, 3)), (UNBOUNDED, cfg(128, 128, 128, 8, 3))],
    },
    "fp8_gemm": {
        89: [(32, cfg(32, 64, 128, 4, 2)), (128, cfg(64, 128, 128, 4, 2)), (UNBOUNDED, cfg(128, 64, 128, 4, 3))],
        90: [(128, cfg(64, 128, 128, 4, 3)), (UNBOUNDED, cfg(128, 128, 128, 8, 3))],
    },
}

ATTENTION_TABLE: dict[str, dict[int, TileConfig]] = {
    "paged_prefill": {
        80: TileConfig.make(num_warps=4, num_stages=2, BLOCK_M=64, BLOCK_N=64),
        89: TileConfig.make(num_warps=4, num_stages=2, BLOCK_M=64, BLOCK_N=32),
        90: TileConfig.make(num_warps=4, num_stages=2, BLOCK_M=64, BLOCK_N=64),
    },
    "paged_decode": {
        80: TileConfig.make(num_warps=4, num_stages=2, BLOCK_N=64),
        89: TileConfig.make(num_warps=4, num_stages=2, BLOCK_N=64),
        90: TileConfig.make(num_warps=4, num_stages=2, BLOCK_N=64),
    },
}


# Rows each kernel is ever called with (the W4A16 op sends M <= GEMV_MAX_M to the GEMV).
ROW_RANGE: dict[str, tuple[int, int]] = {
    "w4a16_gemv": (1, w4a16.GEMV_MAX_M),
    "w4a16_gemm": (w4a16.GEMV_MAX_M + 1, UNBOUNDED),
}


def table_arch(capability: int) -> int:
    """The table a device capability uses (sm_86/87 use Ampere's, unknown newer ones Hopper's)."""
    if capability in (80, 86, 87):
        return 80
    if capability == 89:
        return 89
    return 90 if capability >= 90 else 80


def _fit(config: TileConfig, shape: Mapping[str, int]) -> TileConfig:
    """Shrink BLOCK_N for layers narrower than the table's tile (no idle half-tiles)."""
    d = dict(config.constexprs)
    if "N" in shape and "BLOCK_N" in d:
        d["BLOCK_N"] = max(16, min(d["BLOCK_N"], next_pow2(shape["N"])))
    return TileConfig.make(num_warps=config.num_warps, num_stages=config.num_stages, **d)


def buckets(capability: int, kernel: str, shape: Mapping[str, int]) -> list[tuple[int, int, TileConfig]]:
    """[(min_rows, max_rows, config)] a build must cover for this kernel and static shape."""
    arch = table_arch(capability)
    kd = registry.kernel(kernel)
    if kernel in GEMM_TABLES:
        table = GEMM_TABLES[kernel].get(arch)
        if table is None:
            raise KeyError(f"{kernel} has no tile table for sm_{capability}")
        first, last = ROW_RANGE.get(kernel, (1, UNBOUNDED))
        out, lo = [], 1
        for hi, config in table:
            a, b = max(lo, first), min(hi, last)
            if a <= b:
                out.append((a, b, _fit(config, shape)))
            lo = hi + 1
        return out
    base = kd.default_config(shape)
    if kernel in ATTENTION_TABLE:
        d = dict(base.constexprs)
        t = ATTENTION_TABLE[kernel][arch]
        d.update(dict(t.constexprs))
        base = TileConfig.make(num_warps=t.num_warps, num_stages=t.num_stages, **d)
    return [(1, UNBOUNDED, base)]


def pick(capability: int, call: KernelCall) -> TileConfig:
    """The table's config for a runtime call (what the JIT fallback uses on that GPU)."""
    rows = call.shape.get(call.kernel.rows, 1) if call.kernel.rows else 1
    for lo, hi, config in buckets(capability, call.kernel.name, call.shape):
        if lo <= rows <= hi:
            return config
    return buckets(capability, call.kernel.name, call.shape)[-1][2]
