"""Per-architecture tile tables: which tile configuration each kernel uses for which rows.

Why tables and not autotuning at build time: the build machine has no GPU. The tables encode the
usual shape of good configs per generation — Ampere (sm_80, 164 KiB shared memory per SM) and Ada
(sm_89, 100 KiB, so fewer pipeline stages) run `mma.sync` tiles; Hopper (sm_90a) needs 64-row
warpgroup tiles for `wgmma`, so its small-M GEMM bucket still uses BLOCK_M=64. `--tune` replaces an
entry by measurement when a GPU of that arch is present.

A GEMM table is a list of (max_rows, config) buckets, ascending; rows above the last bound use the
last entry. Kernels without a row dimension use their shape-derived default, with per-arch warps.

The tiled W4A16 kernel (`w4a16_tiled`) computes out^T = W x^T: its BLOCK_N (weight rows, <= 128)
is the MMA's M side, so on Hopper BLOCK_N >= 64 with 4 warps gives wgmma even for BLOCK_M = 16.
Its SPLIT_K (and that of the INT8/FP8 `scaled_mm` GEMMs) is not in the table: for buckets of at
most `SPLIT_MAX_M` rows it is chosen per shape (`_split_k`) so that n-tiles x splits fill the arch's
SMs (`lmfoundry.gpus.SM_COUNT`) — at decode a 4096-wide layer has only 32 tiles of 128 rows for
132 SMs. A weight-only decode GEMM streams its weight and nothing else, so one program per SM
cannot keep enough loads in flight: `w4a16_tiled` asks for at least `MIN_WAVES` programs per SM
(tests/compile/test_decode_sass.py checks the grid, and that the SM can hold them all at once).

`MEASURED_BUCKETS` and `MEASURED_SPLITS` hold what a GPU measured (`compile/tune.py`'s sweep, run
by `benchmarks/gpu_lease.sh tiles`): per kernel, arch and bucket a config that replaces the table's,
and per shape and bucket a SPLIT_K that replaces the model's. The sweep writes them as a patch,
applied through a reviewed commit, never at run time.
"""

from __future__ import annotations

from typing import Mapping

from lmfoundry.gpus import ARCH_OF_CAPABILITY, SM_COUNT, SM_NAME  # noqa: F401  (compile/kernel_selection.py reads them as tiles.*)
from lmfoundry.kernels import registry, tiled_layout, w4a16, w4a16_tiled
from lmfoundry.kernels.spec import KernelCall, TileConfig, next_pow2

UNBOUNDED = 1 << 30


def cfg(bm: int | None, bn: int, bk: int, warps: int, stages: int) -> TileConfig:
    kw = {"BLOCK_N": bn, "BLOCK_K": bk}
    if bm is not None:
        kw["BLOCK_M"] = bm
    return TileConfig.make(num_warps=warps, num_stages=stages, **kw)


def mm_cfg(bm: int, bn: int, bk: int, warps: int, stages: int, swap: bool = False) -> TileConfig:
    """A `scaled_mm` (W8A8 / FP8) entry; SPLIT_K 1 here, sized per shape by `buckets`."""
    return TileConfig.make(num_warps=warps, num_stages=stages, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=1,
                           SWAP_AB=int(swap))


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
    # INT8 / FP8 (`scaled_mm`): up to 16 tokens a 16-row tile (Hopper: SWAP_AB, the weight's 128 rows
    # are the wgmma M side); up to SPLIT_MAX_M rows SPLIT_K is sized per shape like W4A16's.
    "w8a8_gemm": {
        80: [(16, mm_cfg(16, 64, 128, 4, 4)), (32, mm_cfg(32, 64, 128, 4, 3)), (64, mm_cfg(64, 128, 128, 4, 3)),
             (128, mm_cfg(64, 128, 128, 4, 3)), (UNBOUNDED, mm_cfg(128, 128, 128, 8, 3))],
        89: [(16, mm_cfg(16, 64, 128, 4, 3)), (32, mm_cfg(32, 64, 128, 4, 2)), (64, mm_cfg(64, 128, 128, 4, 2)),
             (128, mm_cfg(64, 128, 128, 4, 2)), (UNBOUNDED, mm_cfg(128, 64, 128, 4, 3))],
        90: [(16, mm_cfg(16, 128, 128, 4, 4, swap=True)), (64, mm_cfg(64, 128, 128, 4, 3)),
             (128, mm_cfg(64, 128, 128, 4, 3)), (UNBOUNDED, mm_cfg(128, 128, 128, 8, 3))],
    },
    "fp8_gemm": {
        89: [(16, mm_cfg(16, 64, 128, 4, 3)), (32, mm_cfg(32, 64, 128, 4, 2)), (64, mm_cfg(64, 128, 128, 4, 2)),
             (128, mm_cfg(64, 128, 128, 4, 2)), (UNBOUNDED, mm_cfg(128, 64, 128, 4, 3))],
        90: [(16, mm_cfg(16, 128, 128, 4, 4, swap=True)), (64, mm_cfg(64, 128, 128, 4, 3)),
             (128, mm_cfg(64, 128, 128, 4, 3)), (UNBOUNDED, mm_cfg(128, 128, 128, 8, 3))],
    },
}

def tiled_cfg(bm: int, bn: int, warps: int, stages: int) -> TileConfig:
    """A `w4a16_tiled` entry; SPLIT_K 1 here, sized per shape by `buckets`."""
    return TileConfig.make(num_warps=warps, num_stages=stages, BLOCK_M=bm, BLOCK_N=bn, SPLIT_K=1)


# A stage holds one weight panel (BLOCK_N x 16 words: 8 KiB at 128 rows) and the x slices of its
# planes (BLOCK_M x 128 k x 2 bytes): 4 KiB at BLOCK_M 16, 32 KiB at 128 rows by 128 tokens. Small M
# is memory-bound: deep pipelines (4 stages) and split-K; large M takes 128x128 tiles. Hopper's
# buckets up to 32 rows take 64-row weight tiles (still one warpgroup's wgmma): twice the n-tiles of
# 128 rows, so half the splits reach MIN_WAVES and each tile's serial hand-over chain is half as
# long, and about half the registers of a 128-row tile (cuobjdump, Triton 3.7, sm_90a), so several
# programs share an SM. Untimed: no GPU was available when these were set (`MEASURED_BUCKETS` and
# `--tune` replace them by measurement).
GEMM_TABLES["w4a16_tiled"] = {
    80: [(16, tiled_cfg(16, 64, 4, 4)), (32, tiled_cfg(32, 64, 4, 4)), (64, tiled_cfg(64, 64, 4, 4)),
         (256, tiled_cfg(64, 64, 4, 3)), (UNBOUNDED, tiled_cfg(128, 128, 8, 3))],
    # 100 KiB of shared memory: fewer stages
    89: [(16, tiled_cfg(16, 64, 4, 3)), (32, tiled_cfg(32, 64, 4, 3)), (64, tiled_cfg(64, 64, 4, 3)),
         (256, tiled_cfg(64, 64, 4, 2)), (UNBOUNDED, tiled_cfg(128, 128, 8, 2))],
    90: [(16, tiled_cfg(16, 64, 4, 4)), (32, tiled_cfg(32, 64, 4, 4)), (64, tiled_cfg(64, 64, 4, 4)),
         (256, tiled_cfg(64, 64, 4, 4)), (UNBOUNDED, tiled_cfg(128, 128, 8, 3))],
}

MAX_SPLIT_K = 16
SPLIT_MAX_M = w4a16_tiled.SPLIT_MAX_M  # = kernels.splitk.SPLIT_MAX_M: rows up to which ops pass a split-K workspace
# Programs per SM a weight-only decode GEMM asks for (`w4a16_tiled`, buckets up to SPLIT_MAX_M rows):
# at one program per SM an SM has one CTA's few warps and its pipeline's few panels in flight, far
# from what streaming HBM at full rate takes.
MIN_WAVES = 2
# What one serial hand-over of a tile's partial (`kernels.splitk`: a counter round trip through L2,
# the partial stored and loaded back) costs, in K iterations of one program: `scaled_mm`'s long
# compute-bound iterations hide it; a `w4a16_tiled` iteration streams one 4-8 KiB panel, a fraction
# of an L2 round trip. Estimates, not measurements: `MEASURED_SPLITS` replaces the split they give.
HANDOVER_ITERS = {"w4a16_tiled": 4.0}
HANDOVER_DEFAULT = 0.25


def _split_k(capability: int, n: int, k_iters: int, config: TileConfig, max_rows: int,
             handover: float = HANDOVER_DEFAULT, min_programs: int = 0) -> int:
    """SPLIT_K for a GEMM bucket of at most `max_rows` rows whose K loop has `k_iters` iterations:
    the split minimizing waves x (iterations per split + 2), the +2 standing for pipeline fill and
    the epilogue, plus `handover` iterations per serial partial-sum hand-over, among the splits
    that give at least `min_programs` programs (all splits when none does). One wave of tiles x
    splits programs fills the arch's SMs once. 1 above SPLIT_MAX_M rows (no workspace)."""
    if max_rows > SPLIT_MAX_M:
        return 1
    sms = SM_COUNT.get(table_arch(capability), 0)
    if not sms:
        return 1
    tiles = -(-max_rows // config["BLOCK_M"]) * -(-n // config["BLOCK_N"])
    splits = range(1, min(MAX_SPLIT_K, k_iters) + 1)
    if any(tiles * s >= min_programs for s in splits):
        splits = range(-(-min_programs // tiles) if min_programs else 1, splits.stop)
    return min(splits, key=lambda s: -(-tiles * s // sms) * (-(-k_iters // s) + 2) + handover * (s - 1))


def shape_key(kernel: str, shape: Mapping[str, int], max_rows: int) -> tuple[int, ...]:
    """A static shape and bucket as `MEASURED_SPLITS` names them: the kernel's
    `static_shape` values in order, then the bucket's upper row bound."""
    return (*(int(shape.get(k, 0)) for k in registry.kernel(kernel).static_shape), max_rows)


def k_iterations(kernel: str, config: TileConfig, shape: Mapping[str, int]) -> int:
    """Iterations of a split-K kernel's K loop: panels (or groups, when longer) for `w4a16_tiled`,
    BLOCK_K tiles for `scaled_mm`."""
    if kernel == "w4a16_tiled":
        unit = max(tiled_layout.panel_k(shape["bits"]), shape.get("group", 0))
    else:
        unit = config["BLOCK_K"]
    return -(-shape["K"] // unit)


def model_split(capability: int, kernel: str, config: TileConfig, shape: Mapping[str, int], max_rows: int) -> int:
    """The SPLIT_K `_split_k`'s model gives a split-K kernel's config on this shape and bucket
    (for `w4a16_tiled` with the MIN_WAVES floor and its hand-over cost)."""
    floor = MIN_WAVES * SM_COUNT.get(table_arch(capability), 0) if kernel == "w4a16_tiled" else 0
    return _split_k(capability, shape["N"], k_iterations(kernel, config, shape), config, max_rows,
                    HANDOVER_ITERS.get(kernel, HANDOVER_DEFAULT), floor)


def _fit_split(capability: int, kernel: str, config: TileConfig, shape: Mapping[str, int], max_rows: int
               ) -> TileConfig:
    """A split-K kernel's table entry with SPLIT_K sized for this shape and bucket: measured where
    `MEASURED_SPLITS` has it, else the model's (`model_split`)."""
    d = dict(config.constexprs)
    if kernel != "w4a16_tiled":
        d["BLOCK_N"] = max(16, min(d["BLOCK_N"], next_pow2(shape["N"])))
        config = TileConfig.make(num_warps=config.num_warps, num_stages=config.num_stages, **d)
    split = MEASURED_SPLITS.get(kernel, {}).get(table_arch(capability), {}).get(shape_key(kernel, shape, max_rows))
    d["SPLIT_K"] = split if split is not None else model_split(capability, kernel, config, shape, max_rows)
    return TileConfig.make(num_warps=config.num_warps, num_stages=config.num_stages, **d)


# BEGIN MEASURED (written by compile/tune.py's `tiles_patch`; change it through a reviewed commit)
# kernel -> arch -> {bucket's max_rows: config}, and kernel -> arch -> {shape_key: SPLIT_K}
MEASURED_BUCKETS: dict[str, dict[int, dict[int, TileConfig]]] = {}
MEASURED_SPLITS: dict[str, dict[int, dict[tuple[int, ...], int]]] = {}
# END MEASURED


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
    # FlashDecoding: the tiles (BLOCK_G query heads per KV head, BLOCK_N keys, 32 for head_dim 256)
    # come from the shape (`paged_decode._split_default`); per arch only warps and stages. Two
    # stages of K and V tiles (cp.async, 40 KiB at head_dim 128) fit every arch's shared memory
    # several times over, so occupancy, not shared memory, limits the programs per SM.
    "paged_decode_split": {
        80: TileConfig.make(num_warps=4, num_stages=2),
        89: TileConfig.make(num_warps=4, num_stages=2),
        90: TileConfig.make(num_warps=4, num_stages=2),
    },
    "paged_decode_reduce": {
        80: TileConfig.make(num_warps=4, num_stages=1),
        89: TileConfig.make(num_warps=4, num_stages=1),
        90: TileConfig.make(num_warps=4, num_stages=1),
    },
}

# SMs of the arch's reference product, one table for every tile choice (`lmfoundry.gpus.SM_COUNT`:
# A100, L40S, H100/H200 SXM), for choosing FlashDecoding splits where no device can be asked (a
# bundle run through the CPU interpreter); on a GPU the device's own count is used
# (`paged_attention.device_sm_count`).
NOMINAL_SM_COUNT: dict[int, int] = SM_COUNT


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


def nominal_sm_count(capability: int) -> int:
    """SM count of the reference product of the table a capability uses (see NOMINAL_SM_COUNT)."""
    return NOMINAL_SM_COUNT[table_arch(capability)]


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
        measured = MEASURED_BUCKETS.get(kernel, {}).get(arch, {})
        out, lo = [], 1
        for hi, config in table:
            config = measured.get(hi, config)
            a, b = max(lo, first), min(hi, last)
            if a <= b:
                fitted = (_fit_split(capability, kernel, config, shape, b) if "SPLIT_K" in dict(config.constexprs)
                          else _fit(config, shape))
                out.append((a, b, fitted))
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
