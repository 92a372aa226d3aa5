"""The tiled W4A16 / W8A16 kernel (`w4a16_tiled`): what an engine bundle runs, on the layout of
`tiled_layout.py` that `lmfoundry compile` writes.

Why a second layout: on an H200 the compressed-tensors layout's kernels (`w4a16.py`) stayed far
below dense bf16 cuBLAS at M <= 256 (benchmarks/results/gpu_kernels_h200.md), where a 4-bit weight
should make decode several times faster. Everything the kernel would otherwise do per element is
done once, offline, in the layout; here:
  * one shift and mask of a panel word gives a *pair* of codes in the two 16-bit halves — for plane
    p, the consecutive k pair (2w, 2w+1) that one register of a tensor-core A fragment holds. OR-ing
    the bf16 (fp16) exponent pattern 0x4300 (0x6400) into both halves makes the register hold
    bf16(128 + q) (fp16(1024 + q)) exactly: int4 -> 16-bit float with no int->float conversion.
    Triton then loads the words straight into fragment order with ldmatrix (checked in the SASS);
  * act-order activations are permuted once per GEMM, or never where compile folds the
    permutation into the producer's output rows (gate/up for down_proj); the kernel never sees g_idx.
The kernel computes out^T = W x^T ("swap AB"): the 128-row weight tile is the MMA's M operand,
so Hopper's 64-row wgmma runs from registers for M = 1..16 tokens (BLOCK_M 16 is its N), and the
scale is applied once per group to the fp32 partial product instead of to every weight:
out = sum_g s_g * (sum_k x_k (B + q_k) - (B + z_g) * sum_k x_k) for bf16 (B = 128), and
sum_g s_g * sum_k x_k (q_k - z_g) for fp16 (the 16-bit subtraction is exact). Both are exact
integer weights times bf16/fp16 activations accumulated in fp32 — more exact than the reference,
which rounds each dequantized weight to the activation dtype (the tests bound the difference).
Split-K (SPLIT_K programs over K per output tile) fills the SMs at small M; partial tiles are
reduced serially in split order through a fp32 workspace and a per-tile counter (deterministic,
one launch, no memset), see `w4a16_tiled_kernel`.
"""

from __future__ import annotations

from typing import Mapping

import torch
import triton
import triton.language as tl

from lmfoundry.kernels import splitk
from lmfoundry.kernels.dispatch import Launcher, resolve
from lmfoundry.kernels.spec import KernelCall, KernelDef, Param, TileConfig, triton_type
from lmfoundry.kernels.tiled_layout import TILE_N, TILE_WORDS, TiledLinear, pad_to, panel_k, tiled_dequantize
from lmfoundry.kernels.w4a16 import SUPPORT

SPLIT_MAX_M = splitk.SPLIT_MAX_M  # rows up to which the op provides a split-K workspace

_TILE_N = tl.constexpr(TILE_N)
_TILE_WORDS = tl.constexpr(TILE_WORDS)



@triton.jit
def _pair_operand(words, p: tl.constexpr, BITS: tl.constexpr, F16: tl.constexpr):
    """Plane p of a [BN, TILE_WORDS] word tile as a [BN, 2 * TILE_WORDS] MMA operand in the activation
    dtype: column 2w + h is code p + h * PACK/2 of word w (k = 32p + 2w + h of the panel).

    bf16: 128 + q, fp16: 1024 + q (exact: the code is OR-ed into the mantissa of 0x4300 / 0x6400, two
    codes per 32-bit operation). 8-bit codes do not fit bf16's 7-bit mantissa: they go through
    fp32's 0x4B000000 (2^23 + q) and are rounded to bf16 exactly (q <= 255)."""
    if BITS == 4:
        t = (words >> (4 * p)) & 0x000F000F
    else:
        t = (words >> (8 * p)) & 0x00FF00FF
    if F16:
        t = t | 0x64006400
        lo = t.to(tl.int16).to(tl.float16, bitcast=True)
        hi = (t >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    elif BITS == 4:
        t = t | 0x43004300
        lo = t.to(tl.int16).to(tl.bfloat16, bitcast=True)
        hi = (t >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        lo = (((t & 0xFFFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0).to(tl.bfloat16)
        hi = (((t >> 16) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0).to(tl.bfloat16)
    return tl.reshape(tl.join(lo, hi), (words.shape[0], 2 * words.shape[1]))


@triton.jit
def _zero_code(zp_ptr, g, stride_sg, rn, BITS: tl.constexpr, HAS_ZP: tl.constexpr, BLOCK_N: tl.constexpr):
    """Unsigned zero-point code of group g for columns rn, as fp32 [BLOCK_N]."""
    if HAS_ZP:
        return tl.load(zp_ptr + g * stride_sg + rn).to(tl.float32) + (1 << (BITS - 1))
    else:
        return tl.full((BLOCK_N,), 1 << (BITS - 1), tl.float32)


@triton.jit
def _group_epilogue(acc, part, rs, scale_ptr, zp_ptr, g, stride_sg, rn, BITS: tl.constexpr, HAS_ZP: tl.constexpr,
                    F16: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc + s_g * (exact integer-weight partial of group g), see `_pair_operand` for the offsets."""
    s = tl.load(scale_ptr + g * stride_sg + rn).to(tl.float32)
    if F16:
        return acc + s[:, None] * part
    else:
        base: tl.constexpr = 128.0 if BITS == 4 else 0.0
        z = _zero_code(zp_ptr, g, stride_sg, rn, BITS, HAS_ZP, BLOCK_N)
        return acc + s[:, None] * (part - (z + base)[:, None] * rs[None, :])


@triton.jit
def _store_out(acc, out_ptrs, out_mask, bias_ptr, rn, mask_n, HAS_BIAS: tl.constexpr):
    """Round the finished fp32 tile (+ bias) to the output dtype; acc is [BLOCK_N, BLOCK_M]."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptrs, acc.to(out_ptrs.dtype.element_ty), mask=out_mask)


@triton.jit
def w4a16_tiled_kernel(
    x_ptr, qw_ptr, scale_ptr, zp_ptr, bias_ptr, out_ptr, ws_ptr, lock_ptr,
    M, N, K, stride_xm, stride_qn, stride_sg, stride_om,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
):
    """out[M, N] = x[M, K] @ W^T for the tiled layout; program (m-tile, n-tile, split).

    The loop steps over `PPI` panels (one group when a group is longer than a panel), each panel
    over its PACK/2 planes of 32 k: one [BLOCK_N, 32] weight operand and one [BLOCK_M, 32] slice
    of x per MMA. Groups are applied as they complete (GROUP_SIZE >= 32 is a multiple of a plane).

    Split-K (`kernels.splitk`): split s takes a contiguous range of iterations; the splits of an
    output tile add their fp32 partials up in split order and the last writes `out`. Above
    SPLIT_MAX_M rows the op passes no workspace: split 0 does all of K and the others exit.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    PACK: tl.constexpr = 32 // BITS
    NPAIR: tl.constexpr = PACK // 2
    PANEL_K: tl.constexpr = _TILE_WORDS * PACK
    F16: tl.constexpr = x_ptr.dtype.element_ty == tl.float16
    PPI: tl.constexpr = GROUP_SIZE // PANEL_K if GROUP_SIZE > PANEL_K else 1  # panels per iteration
    DPG: tl.constexpr = GROUP_SIZE // 32  # planes per group (0: per channel)
    tl.static_assert(GROUP_SIZE % 32 == 0)
    tl.static_assert(_TILE_N % BLOCK_N == 0)
    splits = splitk.split_count(M, SPLIT_K)
    if pid_s < splits:
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # < N padded to TILE_N: no weight masks
        mask_m = rm < M
        r32 = tl.arange(0, 32)
        w_ptrs = (qw_ptr + ((rn // _TILE_N) * stride_qn + (rn % _TILE_N) * _TILE_WORDS)[:, None]
                  + tl.arange(0, _TILE_WORDS)[None, :])
        x_ptrs = x_ptr + rm[:, None] * stride_xm + r32[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        rs = tl.zeros((BLOCK_M,), dtype=tl.float32)
        n_it = tl.cdiv(K, PPI * PANEL_K)
        per_split = tl.cdiv(n_it, splits)
        it_lo = pid_s * per_split
        it_hi = tl.minimum(it_lo + per_split, n_it)
        if F16:
            zc = (_zero_code(zp_ptr, 0, stride_sg, rn, BITS, HAS_ZP, BLOCK_N) + 1024.0).to(tl.float16)
        for it in range(it_lo, it_hi):
            for pp in tl.static_range(PPI):
                panel = it * PPI + pp
                words = tl.load(w_ptrs + panel * (_TILE_N * _TILE_WORDS))
                for p in tl.static_range(NPAIR):
                    k0 = panel * PANEL_K + p * 32
                    kk = k0 + r32
                    x = tl.load(x_ptrs + k0, mask=mask_m[:, None] & (kk < K)[None, :], other=0.0)
                    w = _pair_operand(words, p, BITS, F16)
                    if F16:
                        if GROUP_SIZE > 0 and HAS_ZP:
                            if (pp * NPAIR + p) % DPG == 0:
                                zc = (_zero_code(zp_ptr, k0 // GROUP_SIZE, stride_sg, rn, BITS, HAS_ZP, BLOCK_N)
                                      + 1024.0).to(tl.float16)
                        w = w - zc[:, None]  # q - z, exact in fp16
                    else:
                        rs += tl.sum(x.to(tl.float32), axis=1)
                    part = tl.dot(w, tl.trans(x), part)
                    if GROUP_SIZE > 0:
                        if (pp * NPAIR + p + 1) % DPG == 0:
                            acc = _group_epilogue(acc, part, rs, scale_ptr, zp_ptr, k0 // GROUP_SIZE, stride_sg, rn,
                                                  BITS, HAS_ZP, F16, BLOCK_N)
                            part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                            rs = tl.zeros((BLOCK_M,), dtype=tl.float32)
        if GROUP_SIZE == 0:
            acc = _group_epilogue(acc, part, rs, scale_ptr, zp_ptr, 0, stride_sg, rn, BITS, HAS_ZP, F16, BLOCK_N)
        mask_n = rn < N
        out_mask = mask_n[:, None] & mask_m[None, :]
        out_ptrs = out_ptr + rm[None, :] * stride_om + rn[:, None]
        if SPLIT_K == 1:
            _store_out(acc, out_ptrs, out_mask, bias_ptr, rn, mask_n, HAS_BIAS)
        elif splits == 1:
            _store_out(acc, out_ptrs, out_mask, bias_ptr, rn, mask_n, HAS_BIAS)
        else:
            acc = splitk.serial_split_k(acc, ws_ptr + rm[None, :] * N + rn[:, None], out_mask,
                                        lock_ptr + pid_m * tl.num_programs(1) + pid_n, pid_s, splits)
            if pid_s == splits - 1:
                _store_out(acc, out_ptrs, out_mask, bias_ptr, rn, mask_n, HAS_BIAS)


# ---- reference, kernel definition and op ---------------------------------------------------------


def tiled_reference(x: torch.Tensor, w: TiledLinear) -> torch.Tensor:
    """x [M, K] (original feature order, or `perm` order when `w.input_permuted`) @ dequantized W^T,
    fp32 accumulation, output in x's dtype and in stored row order: the dequantize-then-matmul
    definition the kernel is tested against."""
    if w.perm is not None and not w.input_permuted:
        x = x.index_select(-1, w.perm.long())
    wd = w.dequantize().to(x.dtype).float()
    acc = x.float() @ wd.t()
    if w.bias is not None:
        acc = acc + w.bias.float()
    return acc.to(x.dtype)


def _tiled_reference_call(call: KernelCall) -> None:
    a, s = call.args, call.semantics
    m, n, k = a["M"], a["N"], a["K"]
    x = torch.as_strided(a["x_ptr"], (m, k), (a["stride_xm"], 1))
    out = torch.as_strided(a["out_ptr"], (m, n), (a["stride_om"], 1))
    wd = tiled_dequantize(a["qw_ptr"], a["scale_ptr"], a["zp_ptr"] if s["HAS_ZP"] else None, s["BITS"],
                          s["GROUP_SIZE"], n, k)
    acc = x.float() @ wd.to(x.dtype).float().t()
    if s["HAS_BIAS"]:
        acc = acc + a["bias_ptr"].float()
    out.copy_(acc.to(out.dtype))


_TILED_PARAMS = (
    Param("x_ptr", "*{act}"),
    Param("qw_ptr", "*i32"),
    Param("scale_ptr", "*{scale}"),
    Param("zp_ptr", "*i8"),
    Param("bias_ptr", "*{act}"),
    Param("out_ptr", "*{act}"),
    Param("ws_ptr", "*fp32"),
    Param("lock_ptr", "*i32"),
    Param("M", "i32"),
    Param("N", "i32", aligned=True),
    Param("K", "i32", aligned=True),
    Param("stride_xm", "i32", aligned=True),
    Param("stride_qn", "i32", aligned=True),
    Param("stride_sg", "i32", aligned=True),
    Param("stride_om", "i32", aligned=True),
)


def _tiled_shape_ints(shape: Mapping[str, int]) -> dict[str, int]:
    n, k, bits = shape["N"], shape["K"], shape["bits"]
    return {"N": n, "K": k, "stride_xm": k, "stride_qn": pad_to(k, panel_k(bits)) * TILE_N // (32 // bits),
            "stride_sg": pad_to(n, TILE_N), "stride_om": n}


def _tiled_default(shape: Mapping[str, int]) -> TileConfig:
    m = shape.get("M", 64)
    return TileConfig.make(num_warps=4, num_stages=3, BLOCK_M=16 if m <= 16 else 64, BLOCK_N=64, SPLIT_K=1)


def _tiled_sass(arch: int, cfg: TileConfig, types: Mapping[str, str], sem: Mapping[str, object]) -> tuple[str, ...]:
    # The weight tile is the MMA's M operand: Hopper's wgmma needs 64 rows of it per warpgroup.
    if arch >= 90 and cfg["BLOCK_N"] >= 64 and cfg.num_warps >= 4:
        return ("HGMMA",)
    return ("HMMA",)


TILED = KernelDef(
    name="w4a16_tiled",
    fn=w4a16_tiled_kernel,
    params=_TILED_PARAMS,
    grid=("cdiv(M, BLOCK_M)", "cdiv(N, BLOCK_N)", "SPLIT_K"),
    type_vars=("act", "scale"),
    semantics=("BITS", "GROUP_SIZE", "HAS_ZP", "HAS_BIAS"),
    tiles=("BLOCK_M", "BLOCK_N", "SPLIT_K"),
    reference=_tiled_reference_call,
    default_config=_tiled_default,
    expect_sass=_tiled_sass,
    shape_ints=_tiled_shape_ints,
    static_shape=("N", "K", "bits", "group"),
    rows="M",
)

def split_locks(device: torch.device, count: int) -> torch.Tensor:
    """The split-K tile counters of `device` (see `kernels.splitk.split_counters`)."""
    return splitk.split_counters(device, count)


def make_tiled_call(x: torch.Tensor, w: TiledLinear, out: torch.Tensor) -> KernelCall:
    """The kernel call computing out = x @ W^T (+ bias) for 2-D x [M, K] already in stored column order."""
    m, k = x.shape
    n = w.out_features
    if k != w.in_features:
        raise ValueError(f"x has {k} features, the weight expects {w.in_features}")
    if x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("x and out must be contiguous along the feature dim")
    if not SUPPORT.supports(bits=w.bits, group_size=w.group_size):
        raise ValueError(f"unsupported W{w.bits} group size {w.group_size}: {SUPPORT.values}")
    ws, locks = splitk.workspace(m, n, torch.float32, x.device, w.qweight)
    return KernelCall(
        kernel=TILED,
        args={
            "x_ptr": x, "qw_ptr": w.qweight, "scale_ptr": w.scale,
            "zp_ptr": w.zero if w.zero is not None else w.qweight,
            "bias_ptr": w.bias if w.bias is not None else out, "out_ptr": out, "ws_ptr": ws, "lock_ptr": locks,
            "M": m, "N": n, "K": k,
            "stride_xm": x.stride(0), "stride_qn": w.qweight.stride(0), "stride_sg": w.scale.stride(0),
            "stride_om": out.stride(0),
        },
        types={"act": triton_type(x.dtype), "scale": triton_type(w.scale.dtype)},
        semantics={"BITS": w.bits, "GROUP_SIZE": w.group_size, "HAS_ZP": w.zero is not None,
                   "HAS_BIAS": w.bias is not None},
        shape={"M": m, "N": n, "K": k, "bits": w.bits, "group": w.group_size},
    )


def w4a16_tiled_linear(
    x: torch.Tensor, w: TiledLinear, out: torch.Tensor | None = None, launcher: Launcher | None = None
) -> torch.Tensor:
    """y = x @ dequant(W)^T (+ bias) for x [..., K] in original feature order (or in `perm` order
    when `w.input_permuted`); returns [..., N] in stored row order, in x's dtype.

    An act-order weight whose permutation was not folded into the producer gets its input gathered
    once here (one index_select of M x K activations, shared by every member of a fused GEMM)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if w.perm is not None and not w.input_permuted:
        x2 = x2.index_select(1, w.perm.long())
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out is None:
        out = torch.empty((x2.shape[0], w.out_features), dtype=x.dtype, device=x.device)
    resolve(launcher, x).run(make_tiled_call(x2, w, out))
    return out.reshape(*lead, w.out_features)


def tiled_error_terms(w: TiledLinear, act_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(w_exact, offset_abs, weight_u) of `checks.exact_weight_bound` for this weight and activation
    dtype, in stored order: (q - z) s in float64, |s| (B + 2^b) for the offset B the bf16 path
    cancels (128 for 4-bit bf16, 0 for 8-bit bf16; fp16 subtracts z exactly, no offset), and the
    reference's weight rounding u_s + u_a + u_s u_a."""
    from lmfoundry.kernels.error_bounds import unit_roundoff

    w = w.to("cpu")
    n, k, bits = w.out_features, w.in_features, w.bits
    q = w.codes().double()
    grp = torch.arange(k) // w.group_size if w.group_size else torch.zeros(k, dtype=torch.long)
    s = w.scale[:, :n].t().double()[:, grp]
    z = (w.zero[:, :n].t().double()[:, grp] + (1 << (bits - 1))) if w.zero is not None else float(1 << (bits - 1))
    exact = (q - z) * s
    if act_dtype == torch.float16:
        offset = torch.zeros_like(exact)
    else:
        offset = s.abs() * ((128.0 if bits == 4 else 0.0) + (1 << bits))
    us, ua = unit_roundoff(w.scale.dtype), unit_roundoff(act_dtype)
    return exact, offset, us + ua + us * ua
