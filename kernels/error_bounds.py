"""Error bounds derived from floating-point arithmetic, shared by the kernel tests and the GPU
benchmark, plus the "every output element was written" check.

Model: a result rounded to a format with unit roundoff u is within u·|x| of the exact value
(plus the format's smallest normal, covering underflow); a sum of n products accumulated in a
format with unit roundoff u_acc is within γ_n·Σ|a_i·b_i| of the exact sum, γ_n = n·u/(1 - n·u),
whatever the summation order. A kernel and its reference each round once to the output format and
each accumulate in fp32, so their difference is bounded by twice each term.

γ_n exists only while n·u < 1: a whole K-term sum in a coarse accumulator has no bound at all past
K = 1/u (2^13 for 2^-13). A kernel that sums tiles of K in the coarse unit and adds the tile sums in
fp32 (`TiledAccumulation`, the FP8 GEMM on Hopper) is bounded at any K by `dot_gamma`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

U32 = 2.0**-24
UNIT_ROUNDOFF = {
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
    torch.float32: 2.0**-24,
    torch.float64: 2.0**-53,
    torch.float8_e4m3fn: 2.0**-4,
}


def unit_roundoff(dtype: torch.dtype) -> float:
    return UNIT_ROUNDOFF[dtype]


def gamma(n: int, u: float = U32) -> float:
    """γ_n: relative bound on the rounding error of an n-term sum/product chain."""
    if n * u >= 1:
        raise ValueError(f"gamma undefined for n={n}, u={u}")
    return n * u / (1.0 - n * u)


@dataclass(frozen=True)
class TiledAccumulation:
    """A K-term dot product summed tile by tile: each tile of `tile_k` products is summed from zero
    with unit roundoff `tile_u` (the tensor core's own accumulation), and each tile sum is added to
    an accumulator of unit roundoff `acc_u` (an fp32 register); `splits` split-K partial sums are
    then added together at `acc_u` too. What a kernel's accumulation is comes from the kernel
    (`scaled_mm.fp8_accumulation`)."""

    tile_k: int
    tile_u: float
    acc_u: float = U32
    splits: int = 1


# How a dot product accumulates: one unit roundoff for the whole sum, or tile by tile.
Accumulation = Union[float, TiledAccumulation]


def dot_gamma(k: int, acc: Accumulation = U32, extra: int = 0) -> float:
    """θ with |computed - exact| <= θ·Σ|a_i b_i| for a k-term dot product accumulated as `acc`
    says, followed by `extra` more roundings at the accumulator's precision (epilogue operations).

    Tiled: a tile of n <= tile_k terms summed from zero carries γ_n(tile_u) per term; the tile sums
    (and the split sums and the extra operations) form a chain of ceil(k / tile_k) + splits + extra
    roundings at acc_u, which perturbs each tile sum by γ_chain(acc_u) of its computed value, itself
    within (1 + γ_n(tile_u))·Σ|terms of the tile|. Defined at every k whose tile count keeps the
    fp32 chain below 1/acc_u, unlike γ_k(tile_u)."""
    if not isinstance(acc, TiledAccumulation):
        return gamma(k + extra, acc)
    per_tile = gamma(min(k, acc.tile_k), acc.tile_u)
    chain = -(-k // acc.tile_k) + acc.splits + extra
    return per_tile + gamma(chain, acc.acc_u) * (1 + per_tile)


def dot_bound(
    ref: torch.Tensor, abs_products: torch.Tensor, k: int, out_dtype: torch.dtype, acc_u: Accumulation = U32,
    extra: int = 2,
) -> torch.Tensor:
    """Bound on |kernel - reference| for an accumulated dot product rounded to out_dtype.

    `abs_products` is Σ_k |a_k b_k| per output element (computed in float64); `acc_u` is how the
    kernel accumulates: a unit roundoff (fp32 round-to-nearest by default; tensor-core accumulation
    on a GPU may be coarser, pass it explicitly there) or a `TiledAccumulation`. `extra`: roundings
    after the sum (the default 2 covers the accumulator's start and a conversion).
    """
    u_out = unit_roundoff(out_dtype)
    tiny = torch.finfo(out_dtype).tiny
    return 2 * u_out * ref.double().abs() + 2 * dot_gamma(k, acc_u, extra) * abs_products.double() + 2 * tiny


def assert_within(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor | float, what: str = "") -> None:
    """Raise AssertionError naming the worst element when |out - ref| exceeds `bound` anywhere."""
    err = (out.double() - ref.double()).abs()
    bound_t = torch.as_tensor(bound, dtype=torch.float64, device=err.device).expand_as(err)
    bad = ~(err <= bound_t)  # NaN counts as a violation
    if bool(bad.any()):
        ratio = torch.where(bad, err / bound_t.clamp_min(1e-300), torch.zeros_like(err))
        ratio = torch.nan_to_num(ratio, nan=float("inf"))
        idx = tuple(int(i) for i in torch.unravel_index(ratio.argmax(), err.shape))
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{err.numel()} elements outside the bound; worst at {idx}: "
            f"out={out[idx].item()!r} ref={ref[idx].item()!r} err={err[idx].item():.3e} "
            f"bound={bound_t[idx].item():.3e}"
        )


def poisoned(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """An output buffer every element of which a correct kernel must overwrite."""
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=torch.float32, device=device).to(dtype)
    return torch.full(shape, POISON_INT, dtype=dtype, device=device)


POISON_INT = -128  # never produced by symmetric int8 quantization (codes are clamped to ±127)


def assert_written(out: torch.Tensor, what: str = "") -> None:
    """Raise unless no poison value (NaN, or POISON_INT for integer tensors) is left in `out`."""
    if out.dtype.is_floating_point:
        left = torch.isnan(out.float())
    else:
        left = out == POISON_INT
    if bool(left.any()):
        raise AssertionError(f"{what}: {int(left.sum())}/{out.numel()} output elements never written")


def rmsnorm_bound(x: torch.Tensor, weight: torch.Tensor, ref: torch.Tensor, eps: float) -> torch.Tensor:
    """|kernel - reference| for Hugging Face RMSNorm in dtype u: the normalised value (rounded to the
    dtype) may differ by one rounding (fp32 rsqrt vs 1/sqrt differ by a few fp32 ulps), the weight
    product by one more; each side rounds its result once."""
    u = unit_roundoff(ref.dtype)
    xf = x.double()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).abs()
    nw = normed * weight.double().abs()
    return 2 * u * nw * (1 + 8 * U32 / u) + 2 * u * ref.double().abs() + 2 * torch.finfo(ref.dtype).tiny


def quantization_error(h_abs: torch.Tensor, scale: torch.Tensor, code_dtype: torch.dtype) -> torch.Tensor:
    """Bound on |code * scale - h| for symmetric quantization with `scale` (fp32 division):
    int8 rounds to the nearest code (s/2); e4m3 rounds relative 2^-4, or 2^-10 s in subnormals."""
    s = scale.double()
    if code_dtype == torch.int8:
        return s / 2 * (1 + 8 * U32) + 4 * U32 * h_abs
    return 2.0**-4 * h_abs * (1 + 8 * U32) + 2.0**-10 * s


def attention_bound(
    q: torch.Tensor,
    cache,  # lmfoundry.kernels.kv_layout.PagedKVCache
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    ctx_lens: torch.Tensor,
    ref: torch.Tensor,
    sm_scale: float,
    p_dtype: torch.dtype,
    *,
    p_split: bool = False,
    splits: int = 1,
    p_hi_lo: bool = True,
) -> torch.Tensor:
    """Per (token, head, dim) bound on |kernel - reference| for causal paged attention.

    Each softmax weight p_j is off by a relative ε: the score's dot-product error (γ_D·Σ|q||k|
    scaled), fp32 exp and scale roundings, and P rounded to `p_dtype` for the PV product. A weighted
    mean with weights perturbed by ≤ ε moves by ≤ 2ε/(1-ε)·max|v|; the PV and normaliser sums add
    γ_N·max|v|; each side rounds the output once.

    FlashDecoding (`paged_attention.paged_decode`) changes three terms:
      - `p_split`: P enters the PV product as hi + lo in `p_dtype`, relative error u² instead of u;
        where P is subnormal in `p_dtype` (fp16) each weight is also off by up to the subnormal
        spacing σ, against a normaliser ≥ P_SCALE: n·σ/P_SCALE·max|v| more;
      - the online rescaling by exp2(m_old - m_new) once per key tile: its argument roundings
        telescope to u32·2·max|score|, each exp2 adds ≤ 4·u32 (ex2.approx: 2^-22.5): at most one
        tile per 16 keys, n/4·u32 in ε;
      - `splits` > 1: the merge weighs each split's state by one more exp2 (the same two terms,
        once) and sums `splits` more terms (γ_{N+S}).
    With `p_hi_lo=False` (and `p_split`), P is rounded once to `p_dtype` instead of split into
    hi + lo (the CPU decode kernel's bf16 P): relative error u, the other terms as for p_split.
    """
    from lmfoundry.kernels.kv_layout import dequantize_kv

    q, block_table, cu_seqlens_q, ctx_lens, ref = (t.cpu() for t in (q, block_table, cu_seqlens_q, ctx_lens, ref))
    hq, d = q.shape[1], q.shape[2]
    hkv, page = cache.num_kv_heads, cache.block_size
    key_cache, value_cache = cache.key_cache.cpu(), cache.value_cache.cpu()
    k_scale, v_scale = cache.k_scale.cpu(), cache.v_scale.cpu()
    bound = torch.zeros(ref.shape, dtype=torch.float64)
    u_p = unit_roundoff(p_dtype) ** 2 if p_split and p_hi_lo else unit_roundoff(p_dtype)
    sub = torch.finfo(p_dtype).smallest_normal * torch.finfo(p_dtype).eps if p_split else 0.0  # subnormal spacing
    for b in range(len(ctx_lens)):
        start, stop, n = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(ctx_lens[b])
        if stop == start or n == 0:  # no keys: the output is exactly 0 on both sides
            continue
        blocks = block_table[b, : -(-n // page)].long()
        k = dequantize_kv(key_cache[blocks].reshape(-1, hkv, d)[:n], k_scale).double()
        v = dequantize_kv(value_cache[blocks].reshape(-1, hkv, d)[:n], v_scale).double()
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
        abs_scores = torch.einsum("qhd,khd->hqk", q[start:stop].double().abs(), k.abs()) * sm_scale
        delta = (2 * gamma(d + 4) + 8 * U32) * abs_scores.amax(-1)  # [h, q]
        eps = u_p + delta + 16 * U32
        chain = n + 2
        if p_split:
            eps = eps + n / 4 * U32 + (2 * U32 * abs_scores.amax(-1) + 4 * U32) * (2 if splits > 1 else 1)
            chain += splits
        vmax = v.abs().amax(0)  # [h, d]
        per = (2 * eps / (1 - eps) + 2 * gamma(chain))[..., None] * vmax[:, None, :]
        if p_split:
            from lmfoundry.kernels.paged_attention import P_SCALE

            per = per + 2 * n * sub / P_SCALE * vmax[:, None, :]
        bound[start:stop] = per.permute(1, 0, 2)
    return bound + 2 * unit_roundoff(ref.dtype) * ref.double().abs() + 2 * torch.finfo(ref.dtype).tiny


def exact_weight_bound(
    ref: torch.Tensor,
    x: torch.Tensor,
    w_exact: torch.Tensor,
    offset_abs: torch.Tensor,
    out_dtype: torch.dtype,
    weight_u: float,
    acc_u: Accumulation = U32,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bound on |kernel - reference| for a weight-only GEMM whose kernel multiplies exact integer
    weights (q - z) and applies the scale s to fp32 partial sums, against a reference that first
    rounds each dequantized weight (q - z) * s to the scale dtype and the activation dtype.

    Reference: |w_ref - w| <= weight_u |w| per weight (weight_u = u_s + u_a + u_s u_a), then an fp32
    sum of K products (gamma_{K+2}) and one rounding to the output. Kernel: each weight enters as
    an exact code plus a constant offset B that a second fp32 sum (of x) cancels, per group,
    (bf16: sum x (B + q) - (B + z) sum x), so its terms carry |x| (|w| + 2 |s| (B + 2^b)) =
    |x| (|w| + 2 offset_abs); every term passes through at most K + 32 fp32 roundings (group sum,
    three epilogue operations, the sums over groups and over at most 16 splits), and one rounding
    to the output. `x` [M, K] and `w_exact` [N, K] = (q - z) s, `offset_abs` [N, K] = |s| (B + 2^b)
    (zero where no offset is cancelled), all in the kernel's column order; `acc_u` as in `dot_bound`.
    """
    k = x.shape[-1]
    xa = x.double().abs()
    mag = xa @ w_exact.double().abs().t()
    if bias is not None:
        mag = mag + bias.double().abs()
    offs = xa @ offset_abs.double().t()
    u_out = unit_roundoff(out_dtype)
    ref_side = weight_u * mag + dot_gamma(k, acc_u, 2) * (1 + weight_u) * mag
    kernel_side = dot_gamma(k, acc_u, 32) * (mag + 2 * offs)
    return 2 * u_out * ref.double().abs() + ref_side + kernel_side + 2 * torch.finfo(out_dtype).tiny
