"""The FP8 GEMM's error bound at the longest K the GPU lease checks (28672, a 70B down_proj).

No GPU here, so the kernel's accumulation is emulated exactly as `scaled_mm.fp8_accumulation`
describes it: the tensor core sums each BLOCK_K tile of e4m3 products from zero keeping 14
significant bits (truncating), each tile sum is added to an fp32 accumulator, split-K partials meet
in fp32, then the fp32 scale epilogue. The bound must hold for that, through the same harness check
the GPU benchmark runs, and must reject the same arithmetic without the per-tile promotion (every
product summed in the tensor core's 14 bits, what `tl.dot` does without `max_num_imprecise_acc`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmfoundry.kernels import harness, scaled_mm, tiles
from lmfoundry.kernels.error_bounds import (
    U32,
    TiledAccumulation,
    assert_within,
    dot_bound,
    dot_gamma,
    gamma,
)
from lmfoundry.kernels.spec import KernelCall, TileConfig

K = 28672
E4M3 = torch.float8_e4m3fn
TYPES = {"a": "fp8e4nv", "bscale": "bf16", "out": "bf16", "acc": "fp32"}
SEMANTICS = {"A_PER_TOKEN": True, "B_PER_CHANNEL": True, "HAS_BIAS": False, "ACC_INT": False}


def truncated(x: np.ndarray, bits: int = 14) -> np.ndarray:
    """x rounded toward zero to `bits` significant bits: relative error below 2^(1 - bits)."""
    mantissa, exponent = np.frexp(x)
    return np.ldexp(np.trunc(mantissa * 2.0**bits) / 2.0**bits, exponent)


def hopper_dot(products: np.ndarray, tile_k: int, splits: int = 1) -> np.ndarray:
    """Sum rows of exact products [outputs, K] the way the kernel does (see the module docstring);
    `tile_k` = K is the same arithmetic without promotion. Returns fp32 values as float64."""
    rows, k = products.shape
    tiles_n = -(-k // tile_k)
    padded = np.zeros((rows, tiles_n * tile_k))
    padded[:, :k] = products
    padded = padded.reshape(rows, tiles_n, tile_k)
    tile_sums = np.zeros((rows, tiles_n))
    for i in range(tile_k):  # every tile at once, product by product
        tile_sums = truncated(tile_sums + padded[:, :, i])
    per_split = -(-tiles_n // splits)
    total = np.zeros(rows, dtype=np.float32)
    for s in range(splits):  # each split's fp32 accumulator, then the serial split-K reduction
        acc = np.zeros(rows, dtype=np.float32)
        for t in range(s * per_split, min((s + 1) * per_split, tiles_n)):
            acc = acc + tile_sums[:, t].astype(np.float32)
        total = total + acc
    return total.astype(np.float64)


class EmulatedHopperFp8:
    """An `Launcher` computing an fp8_gemm call with `hopper_dot` and the kernel's fp32 epilogue."""

    def __init__(self, config: TileConfig, promote: bool = True) -> None:
        self.config, self.promote = config, promote

    def run(self, call: KernelCall) -> None:
        a, s = call.args, call.semantics
        m, n, k = a["M"], a["N"], a["K"]
        x = a["a_ptr"].double().numpy()
        w = a["b_ptr"].double().numpy()
        products = (x[:, None, :] * w[None, :, :]).reshape(m * n, k)  # e4m3 x e4m3: exact in float64
        acc = hopper_dot(products, self.config["BLOCK_K"] if self.promote else k, self.config["SPLIT_K"])
        xs = a["a_scale_ptr"].float().reshape(-1)[: m if s["A_PER_TOKEN"] else 1].reshape(-1, 1)
        ws = a["b_scale_ptr"].float().reshape(-1)[: n if s["B_PER_CHANNEL"] else 1].reshape(1, -1)
        out = torch.from_numpy(acc.astype(np.float32)).reshape(m, n) * xs * ws
        a["out_ptr"].copy_(out.to(a["out_ptr"].dtype))


def lease_config(m: int, n: int) -> TileConfig:
    """The Hopper table's tiles for this shape (what the GPU lease's JIT and a bundle run)."""
    return next(cfg for lo, hi, cfg in tiles.buckets(90, "fp8_gemm", {"N": n, "K": K}) if lo <= m <= hi)


def test_a_coarse_unit_over_the_whole_k_has_no_bound_there():
    """Why the tiled model exists: one 2^-13 unit over K >= 2^13 terms leaves γ_K undefined
    (the lease's `gamma undefined for n=8196` at every K >= 8192)."""
    with pytest.raises(ValueError, match="gamma undefined"):
        gamma(K + 4, scaled_mm.FP8_MMA_U)
    assert dot_gamma(K, scaled_mm.fp8_accumulation(lease_config(37, 16)), 4) < 0.02


@pytest.mark.parametrize("m", [2, 37])
def test_harness_check_passes_the_kernels_accumulation_at_k_28672(m):
    """The GPU benchmark's own check (`harness.run_and_check` with `fp8_accumulation` of the tiles
    that ran) accepts the emulated Hopper arithmetic at the lease's longest K, split-K included
    (M = 2 takes the Hopper table's SWAP_AB bucket, M = 37 the 64-row one; both split K here)."""
    n = 16
    config = lease_config(m, n)
    assert config["BLOCK_K"] == 128
    ex = harness.build("fp8_gemm", TYPES, SEMANTICS, {"M": m, "N": n, "K": K}, "cpu")
    harness.run_and_check(ex, EmulatedHopperFp8(config), scaled_mm.fp8_accumulation(config))


def test_bound_at_k_28672_holds_with_promotion_and_fails_without():
    """Same-sign operands (every truncation then pushes the same way: the worst case a bound must
    cover) at K = 28672: the kernel's arithmetic is inside the bound; summing all of K in the
    tensor core's 14 bits is far outside it; and a bound that took each tile's sum as exact fp32
    would reject the kernel's own result, so the tile unit in the bound is not slack."""
    gen = torch.Generator().manual_seed(43)
    x = (torch.randn(2, K, generator=gen).abs() * 40).clamp(max=448).to(E4M3).double()
    w = (torch.randn(8, K, generator=gen).abs() * 40).clamp(max=448).to(E4M3).double()
    exact = x @ w.t()
    abs_products = exact.abs()  # same signs: Σ|a b| = |Σ a b|
    config = lease_config(2, 8)
    acc = scaled_mm.fp8_accumulation(config)
    products = (x.numpy()[:, None, :] * w.numpy()[None, :, :]).reshape(16, K)

    def result(tile_k: int) -> torch.Tensor:
        return torch.from_numpy(hopper_dot(products, tile_k, config["SPLIT_K"])).reshape(2, 8)

    bound = dot_bound(exact, abs_products, K, torch.float32, acc, extra=4)
    assert_within(result(config["BLOCK_K"]), exact, bound, "promoted every BLOCK_K")
    with pytest.raises(AssertionError, match="outside the bound"):
        assert_within(result(K), exact, bound, "never promoted")
    exact_tiles = TiledAccumulation(config["BLOCK_K"], U32, U32, config["SPLIT_K"])
    with pytest.raises(AssertionError, match="outside the bound"):
        assert_within(result(config["BLOCK_K"]), exact, dot_bound(exact, abs_products, K, torch.float32,
                                                                  exact_tiles, extra=4), "fp32 tiles")
