"""Weight-only integer GEMMs (W4A16, W8A16): the compressed-tensors layout and the tiled layout.

Two layouts, two sets of kernels:

- `pack-quantized` as stored by compressed-tensors (`PackedLinear`): `weight_packed` int32
  [N, ceil(K*b/32)], element k of row n in word k // (32/b) at bit (k % (32/b)) * b, stored as
  unsigned q + 2^(b-1); `weight_scale` [N, K/g]; `weight_zero_point` packed along dim 0; optional
  `weight_g_idx` [K]. Dequantization is `(q - zp) * scale` in the scale dtype. `w4a16_gemm` /
  `w4a16_gemv` read it directly (a shift per element, scales gathered through g_idx); they serve
  checkpoints executed without a compile step and are the baseline of the tiled kernel.
- the tiled layout (`TiledLinear`), written by `lmfoundry compile` (compile/repack.py) and read by
  `w4a16_tiled`, the kernel an engine bundle runs. Why a second layout: on an H200 the kernels above
  reached 0.15-0.6x of dense bf16 cuBLAS at M <= 256, where a 4-bit weight should make decode 3-4x
  faster. Everything the kernel would otherwise do per element is done once, offline:
    * codes are stored in panels of 128 rows x (16 int32 words) — 128 k for 4 bits, 64 for 8 — so a
      program's tile of one panel is one contiguous 8 KiB block, and a split-K range is a sequential
      stream; N is padded to 128 and K to the panel, so weight loads need no masks;
    * inside a panel row, word w holds k = 32p + 2w + h in its code p + h*(PACK/2) (p < PACK/2, h < 2):
      one shift and mask of a word gives a *pair* of codes in the two 16-bit halves — for plane p,
      the consecutive k pair (2w, 2w+1) that one register of a tensor-core A fragment holds. OR-ing
      the bf16 (fp16) exponent pattern 0x4300 (0x6400) into both halves makes the register hold
      bf16(128 + q) (fp16(1024 + q)) exactly: int4 -> 16-bit float with no int->float conversion.
      Triton then loads the words straight into fragment order with ldmatrix (checked in the SASS);
    * act-order (`weight_g_idx`) is resolved at compile time: K is permuted so groups are contiguous
      (`perm`); activations are permuted once per GEMM, or never where compile folds the
      permutation into the producer's output rows (gate/up for down_proj); the kernel never sees g_idx;
    * scales [groups, N] and zero points (int8, z - 2^(b-1)) are stored N-contiguous per group.
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

from dataclasses import dataclass
from typing import Mapping

import torch
import triton
import triton.language as tl

from lmfoundry.kernels import splitk
from lmfoundry.kernels.dispatch import Executor, resolve
from lmfoundry.kernels.spec import KernelCall, KernelDef, Param, Support, TileConfig, triton_type

GEMV_MAX_M = 4

SUPPORT = Support(
    {
        "bits": (4, 8),
        "group_size": (0, 32, 64, 128),  # 0 = per channel
        "symmetric": (True, False),
        "actorder": (False, True),
        "dtype": ("float16", "bfloat16"),
        "arch": (80, 86, 89, 90),
    },
    note="group sizes must divide K; per-channel is group_size 0",
)


@triton.jit
def _dequant_tile(
    qw_ptr, scale_ptr, zp_ptr, gidx_ptr, rn, kk, mask_n, mask_k, k0, K,
    stride_qn, stride_sn, stride_zn,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_ZP: tl.constexpr, HAS_GIDX: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Dequantized weight tile [BLOCK_K, BLOCK_N] in the scale dtype (rows: k, columns: n).

    Each packed word is loaded once ([BLOCK_K / PACK, BLOCK_N] words) and unpacked in registers
    by a broadcast shift; loading one word per element instead costs PACK times the load
    instructions, and on an H200 left the W4A16 GEMM at ~3% of the tensor-core rate.
    """
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    KW: tl.constexpr = BLOCK_K // PACK
    kw = k0 // PACK + tl.arange(0, KW)
    wmask = ((kw * PACK) < K)[:, None] & mask_n[None, :]
    words = tl.load(qw_ptr + rn[None, :] * stride_qn + kw[:, None], mask=wmask, other=0)
    shifts = tl.arange(0, PACK) * BITS
    q = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & MASK, (BLOCK_K, words.shape[1]))
    mask = mask_k[:, None] & mask_n[None, :]
    if HAS_GIDX:
        grp = tl.load(gidx_ptr + kk, mask=mask_k, other=0)
        scale = tl.load(scale_ptr + rn[None, :] * stride_sn + grp[:, None], mask=mask, other=0.0)
    elif GROUP_SIZE == 0 or GROUP_SIZE % BLOCK_K == 0:
        # One group spans the whole k-tile: load one scale per column.
        if GROUP_SIZE == 0:
            g0 = 0
        else:
            g0 = k0 // GROUP_SIZE
        scale = tl.load(scale_ptr + rn * stride_sn + g0, mask=mask_n, other=0.0)[None, :]
        grp = kk * 0 + g0
    else:
        grp = kk // GROUP_SIZE
        scale = tl.load(scale_ptr + rn[None, :] * stride_sn + grp[:, None], mask=mask, other=0.0)
    if HAS_ZP:
        zw = tl.load(zp_ptr + (rn // PACK)[None, :] * stride_zn + grp[:, None], mask=mask, other=0)
        zero = (zw >> ((rn % PACK) * BITS)[None, :]) & MASK
    else:
        zero = 1 << (BITS - 1)
    # Arithmetic in fp32, one rounding to the scale dtype: the same value as a multiply in that
    # dtype (the exact product fits in fp32), and correct under the interpreter, whose bf16
    # arithmetic is not.
    return ((q - zero).to(tl.float32) * scale.to(tl.float32)).to(scale.dtype)


@triton.jit
def w4a16_gemm_kernel(
    x_ptr, qw_ptr, scale_ptr, zp_ptr, gidx_ptr, bias_ptr, out_ptr,
    M, N, K, stride_xm, stride_qn, stride_sn, stride_zn, stride_om,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_ZP: tl.constexpr, HAS_GIDX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mask_m = rm < M
    mask_n = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        mask_k = kk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = _dequant_tile(qw_ptr, scale_ptr, zp_ptr, gidx_ptr, rn, kk, mask_n, mask_k, k0, K,
                          stride_qn, stride_sn, stride_zn, BITS, GROUP_SIZE, HAS_ZP, HAS_GIDX, BLOCK_K)
        acc = tl.dot(x, w.to(x.dtype), acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_mask = mask_m[:, None] & mask_n[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def w4a16_gemv_kernel(
    x_ptr, qw_ptr, scale_ptr, zp_ptr, gidx_ptr, bias_ptr, out_ptr,
    M, N, K, stride_xm, stride_qn, stride_sn, stride_zn, stride_om,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_ZP: tl.constexpr, HAS_GIDX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """BLOCK_M rows per program, so a weight tile is read and dequantized once for all of them
    (one program per row read it M times: M=4 cost 3.7x M=1 on an H200). Products accumulate
    element-wise and are reduced over k once at the end (a reduction per k-tile made M=1 2x
    slower there)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mask_m = rm < M
    mask_n = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_K, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        mask_k = kk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = _dequant_tile(qw_ptr, scale_ptr, zp_ptr, gidx_ptr, rn, kk, mask_n, mask_k, k0, K,
                          stride_qn, stride_sn, stride_zn, BITS, GROUP_SIZE, HAS_ZP, HAS_GIDX, BLOCK_K)
        # Round the dequantized weight to the activation dtype exactly as the GEMM does.
        acc += x.to(tl.float32)[:, :, None] * w.to(x.dtype).to(tl.float32)[None, :, :]
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        out += tl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_mask = mask_m[:, None] & mask_n[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], out.to(out_ptr.dtype.element_ty), mask=out_mask)


# ---- reference ----------------------------------------------------------------------------------


def unpack_codes(packed: torch.Tensor, bits: int, n: int, dim: int) -> torch.Tensor:
    """Unsigned codes (q + 2^(b-1)) as int32, unpacked along `dim` to length `n`."""
    per = 32 // bits
    p = packed if dim == 1 else packed.t()
    shifts = torch.arange(per, device=p.device, dtype=torch.int32) * bits
    codes = (p.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    codes = codes.reshape(p.shape[0], -1)[:, :n]
    return codes if dim == 1 else codes.t()


def dequantize(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None,
    weight_g_idx: torch.Tensor | None,
    bits: int,
    group_size: int,
    in_features: int,
) -> torch.Tensor:
    """[N, K] weight in the scale dtype: (q - zp) * scale, the compressed-tensors definition."""
    n = weight_packed.shape[0]
    q = unpack_codes(weight_packed, bits, in_features, dim=1)
    if weight_g_idx is not None:
        grp = weight_g_idx.long()
    elif group_size == 0:
        grp = torch.zeros(in_features, dtype=torch.long, device=q.device)
    else:
        grp = torch.arange(in_features, device=q.device) // group_size
    scale = weight_scale[:, grp]
    if weight_zero_point is not None:
        zero = unpack_codes(weight_zero_point, bits, n, dim=0)[:, grp]
    else:
        zero = 1 << (bits - 1)
    return (q - zero).to(weight_scale.dtype) * scale


def reference(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None,
    weight_g_idx: torch.Tensor | None,
    bias: torch.Tensor | None,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    """x [M, K] @ dequantized W^T, fp32 accumulation, output in x's dtype."""
    w = dequantize(weight_packed, weight_scale, weight_zero_point, weight_g_idx, bits, group_size, x.shape[-1])
    acc = x.float() @ w.to(x.dtype).float().t()
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype)


def _reference_call(call: KernelCall) -> None:
    a, s = call.args, call.semantics
    m, k = a["M"], a["K"]
    x = torch.as_strided(a["x_ptr"], (m, k), (a["stride_xm"], 1))
    out = torch.as_strided(a["out_ptr"], (m, a["N"]), (a["stride_om"], 1))
    out.copy_(
        reference(
            x,
            a["qw_ptr"],
            a["scale_ptr"],
            a["zp_ptr"] if s["HAS_ZP"] else None,
            a["gidx_ptr"] if s["HAS_GIDX"] else None,
            a["bias_ptr"] if s["HAS_BIAS"] else None,
            s["BITS"],
            s["GROUP_SIZE"],
        )
    )


# ---- kernel definitions -------------------------------------------------------------------------

_PARAMS = (
    Param("x_ptr", "*{act}"),
    Param("qw_ptr", "*i32"),
    Param("scale_ptr", "*{scale}"),
    Param("zp_ptr", "*i32"),
    Param("gidx_ptr", "*i32"),
    Param("bias_ptr", "*{act}"),
    Param("out_ptr", "*{act}"),
    Param("M", "i32"),
    Param("N", "i32", aligned=True),
    Param("K", "i32", aligned=True),
    Param("stride_xm", "i32", aligned=True),
    Param("stride_qn", "i32", aligned=True),
    Param("stride_sn", "i32"),
    Param("stride_zn", "i32"),
    Param("stride_om", "i32", aligned=True),
)
_SEMANTICS = ("BITS", "GROUP_SIZE", "HAS_ZP", "HAS_GIDX", "HAS_BIAS")


def _shape_ints(shape: Mapping[str, int]) -> dict[str, int]:
    n, k, bits = shape["N"], shape["K"], shape["bits"]
    return {"N": n, "K": k, "stride_xm": k, "stride_qn": -(-k * bits // 32), "stride_om": n}


def _gemm_default(shape: Mapping[str, int]) -> TileConfig:
    m = shape.get("M", 64)
    return TileConfig.make(num_warps=4, num_stages=2, BLOCK_M=64 if m > 16 else 16, BLOCK_N=64, BLOCK_K=64)


def _gemv_default(shape: Mapping[str, int]) -> TileConfig:
    return TileConfig.make(num_warps=4, num_stages=2, BLOCK_M=1 if shape.get("M", 1) == 1 else GEMV_MAX_M,
                           BLOCK_N=8, BLOCK_K=256)


def _gemm_sass(arch: int, cfg: TileConfig, types: Mapping[str, str], sem: Mapping[str, object]) -> tuple[str, ...]:
    # Hopper's wgmma needs a 64-row warpgroup tile; smaller M tiles use the sm_80 mma.
    if arch >= 90 and cfg["BLOCK_M"] >= 64 and cfg.num_warps >= 4:
        return ("HGMMA",)
    return ("HMMA",)


def _kernel_def(name: str, fn, default_config, **extra) -> KernelDef:
    """The GEMM and the GEMV share parameters, grid rule, tiles and reference: only the kernel
    body, its default tiles and the expected tensor-core instruction differ."""
    return KernelDef(
        name=name,
        fn=fn,
        params=_PARAMS,
        grid=("cdiv(M, BLOCK_M)", "cdiv(N, BLOCK_N)", "1"),
        type_vars=("act", "scale"),
        semantics=_SEMANTICS,
        tiles=("BLOCK_M", "BLOCK_N", "BLOCK_K"),
        reference=_reference_call,
        default_config=default_config,
        shape_ints=_shape_ints,
        static_shape=("N", "K", "bits"),
        rows="M",
        **extra,
    )


GEMM = _kernel_def("w4a16_gemm", w4a16_gemm_kernel, _gemm_default, expect_sass=_gemm_sass)
GEMV = _kernel_def("w4a16_gemv", w4a16_gemv_kernel, _gemv_default)


# ---- op -----------------------------------------------------------------------------------------


@dataclass
class PackedLinear:
    """One `pack-quantized` linear as stored by compressed-tensors (tensors on the target device)."""

    weight_packed: torch.Tensor
    weight_scale: torch.Tensor
    bits: int
    group_size: int  # 0 = per channel
    in_features: int
    weight_zero_point: torch.Tensor | None = None
    weight_g_idx: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.weight_packed.shape[0]

    def dequantize(self) -> torch.Tensor:
        return dequantize(
            self.weight_packed, self.weight_scale, self.weight_zero_point, self.weight_g_idx,
            self.bits, self.group_size, self.in_features,
        )


def make_call(x: torch.Tensor, w: PackedLinear, out: torch.Tensor) -> KernelCall:
    """The kernel call computing out = x @ W^T (+ bias) for 2-D x [M, K] and out [M, N]."""
    m, k = x.shape
    n = w.out_features
    if k != w.in_features:
        raise ValueError(f"x has {k} features, the weight expects {w.in_features}")
    if x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("x and out must be contiguous along the feature dim")
    if not SUPPORT.supports(bits=w.bits, group_size=w.group_size):
        raise ValueError(f"unsupported W{w.bits} group size {w.group_size}: {SUPPORT.values}")
    qw = w.weight_packed.contiguous()
    scale = w.weight_scale.contiguous()
    zp = w.weight_zero_point.contiguous() if w.weight_zero_point is not None else qw
    gidx = w.weight_g_idx.to(torch.int32).contiguous() if w.weight_g_idx is not None else qw
    bias = w.bias if w.bias is not None else out
    kernel = GEMV if m <= GEMV_MAX_M else GEMM
    return KernelCall(
        kernel=kernel,
        args={
            "x_ptr": x, "qw_ptr": qw, "scale_ptr": scale, "zp_ptr": zp, "gidx_ptr": gidx,
            "bias_ptr": bias, "out_ptr": out,
            "M": m, "N": n, "K": k,
            "stride_xm": x.stride(0), "stride_qn": qw.stride(0), "stride_sn": scale.stride(0),
            "stride_zn": zp.stride(0), "stride_om": out.stride(0),
        },
        types={"act": triton_type(x.dtype), "scale": triton_type(scale.dtype)},
        semantics={
            "BITS": w.bits,
            "GROUP_SIZE": w.group_size,
            "HAS_ZP": w.weight_zero_point is not None,
            "HAS_GIDX": w.weight_g_idx is not None,
            "HAS_BIAS": w.bias is not None,
        },
        shape={"M": m, "N": n, "K": k, "bits": w.bits},
    )


def w4a16_linear(
    x: torch.Tensor, w: PackedLinear, out: torch.Tensor | None = None, executor: Executor | None = None
) -> torch.Tensor:
    """y = x @ dequant(W)^T (+ bias) for x [..., K]; returns [..., N] in x's dtype."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out is None:
        out = torch.empty((x2.shape[0], w.out_features), dtype=x.dtype, device=x.device)
    resolve(executor, x).run(make_call(x2, w, out))
    return out.reshape(*lead, w.out_features)


# ==== tiled layout (written at compile time) ======================================================

TILE_N = 128  # rows per panel; N is padded to a multiple (BLOCK_N must divide it)
TILE_WORDS = 16  # int32 words per row of a panel: 128 k of 4-bit codes, 64 k of 8-bit codes
PLANE_K = 32  # k per MMA operand plane (one shift of a panel's words)
SPLIT_MAX_M = splitk.SPLIT_MAX_M  # rows up to which the op provides a split-K workspace
TILED_FORMAT = 1  # version of the layout, stored in `tiled_meta`

_TILE_N = tl.constexpr(TILE_N)
_TILE_WORDS = tl.constexpr(TILE_WORDS)


def panel_k(bits: int) -> int:
    """k covered by one panel row of TILE_WORDS words."""
    return TILE_WORDS * (32 // bits)


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


# ---- the layout: repack, unrepack, dequantize ----------------------------------------------------


def pack_codes(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of `unpack_codes`: unsigned codes packed 32/bits per int32 along `dim` (compressed-
    tensors' order: element i of a word at bit (i % per) * bits, the last word zero-padded)."""
    per = 32 // bits
    c = (codes if dim == 1 else codes.t()).to(torch.int64)
    pad = (-c.shape[1]) % per
    c = torch.nn.functional.pad(c, (0, pad)).reshape(c.shape[0], -1, per)
    words = (c << (torch.arange(per, device=c.device, dtype=torch.int64) * bits)).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words if dim == 1 else words.t().contiguous()


@dataclass
class TiledLinear:
    """One weight-only linear in the tiled layout (see the module docstring), tensors on one device.

    Stored order: column j of the weight is input feature `perm[j]` (act-order; None: identity),
    row i is output feature `out_perm[i]` (None: identity; set when compile folded a consumer's
    act-order into this producer). `input_permuted`: the producer already emits this linear's input
    in `perm` order, so the op does not permute it. `bias` is in stored (row) order.
    """

    qweight: torch.Tensor  # int32 [N_pad/128, K_pad/panel_k, 128, 16]
    scale: torch.Tensor  # [groups_pad, N_pad] in the checkpoint's scale dtype
    bits: int
    group_size: int  # 0 = per channel
    in_features: int
    out_features: int
    zero: torch.Tensor | None = None  # int8 [groups_pad, N_pad]: zero code - 2^(bits-1)
    perm: torch.Tensor | None = None  # int32 [K]
    out_perm: torch.Tensor | None = None  # int32 [N]
    input_permuted: bool = False
    bias: torch.Tensor | None = None

    SUFFIXES = ("tiled_weight", "tiled_scale", "tiled_zero", "tiled_perm", "tiled_out_perm", "tiled_bias", "tiled_meta")

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors a bundle stores for this linear (suffix -> tensor)."""
        meta = [TILED_FORMAT, self.bits, self.group_size, self.in_features, self.out_features, int(self.input_permuted)]
        out = {"tiled_weight": self.qweight, "tiled_scale": self.scale,
               "tiled_meta": torch.tensor(meta, dtype=torch.int64)}
        for key, t in (("tiled_zero", self.zero), ("tiled_perm", self.perm), ("tiled_out_perm", self.out_perm),
                       ("tiled_bias", self.bias)):
            if t is not None:
                out[key] = t
        return out

    @classmethod
    def from_tensors(cls, t: Mapping[str, torch.Tensor]) -> "TiledLinear":
        fmt, bits, group, k, n, permuted = (int(v) for v in t["tiled_meta"].tolist())
        if fmt != TILED_FORMAT:
            raise ValueError(f"tiled layout version {fmt}, this lmfoundry reads {TILED_FORMAT}: rebuild the bundle")
        return cls(t["tiled_weight"], t["tiled_scale"], bits, group, k, n, t.get("tiled_zero"), t.get("tiled_perm"),
                   t.get("tiled_out_perm"), bool(permuted), t.get("tiled_bias"))

    def to(self, device: torch.device | str) -> "TiledLinear":
        move = lambda v: None if v is None else v.to(device).contiguous()  # noqa: E731
        return TiledLinear(move(self.qweight), move(self.scale), self.bits, self.group_size, self.in_features,
                           self.out_features, move(self.zero), move(self.perm), move(self.out_perm),
                           self.input_permuted, move(self.bias))

    def nbytes(self) -> int:
        parts = (self.qweight, self.scale, self.zero, self.perm, self.out_perm, self.bias)
        return sum(v.numel() * v.element_size() for v in parts if v is not None)

    def codes(self) -> torch.Tensor:
        """Unsigned codes [N, K] in stored order (int32)."""
        return tiled_codes(self.qweight, self.bits, self.out_features, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """[N, K] weight in stored order, in the scale dtype: (q - zp) * scale, as the checkpoint defines it."""
        return tiled_dequantize(self.qweight, self.scale, self.zero, self.bits, self.group_size, self.out_features,
                                self.in_features)


def act_order_perm(g_idx: torch.Tensor, group_size: int) -> torch.Tensor:
    """The column order that makes act-order groups contiguous: a stable sort of g_idx (int32 [K]).

    Refused (ValueError) unless every group then spans exactly `group_size` consecutive columns,
    as GPTQ's act-order writes it (the group of a column is its rank in activation order // g)."""
    k = g_idx.numel()
    perm = torch.sort(g_idx.to(torch.int64), stable=True).indices
    expect = torch.arange(k, device=g_idx.device) // (group_size or k)
    if not torch.equal(g_idx.to(torch.int64)[perm], expect):
        raise ValueError(f"weight_g_idx does not split K={k} into equal groups of {group_size or k}: the tiled "
                         "layout needs GPTQ-style act-order (group = rank in activation order // group size)")
    return perm.to(torch.int32)


def _pad_to(n: int, m: int) -> int:
    return -(-n // m) * m


def repack_tiled(w: PackedLinear, out_perm: torch.Tensor | None = None, input_permuted: bool = False) -> TiledLinear:
    """The tiled layout of a compressed-tensors linear (exact: `unrepack_tiled` gives `w` back).

    `out_perm`: reorder the output rows (row i <- output feature out_perm[i]); `input_permuted`: the
    producer of this linear's input applies its act-order permutation (see `TiledLinear`)."""
    bits, n, k = w.bits, w.out_features, w.in_features
    group = w.group_size
    if not SUPPORT.supports(bits=bits, group_size=group) or (group and k % group):
        raise ValueError(f"W{bits} group size {group} with K={k}: the tiled layout takes 4 or 8 bits and group "
                         "sizes 32/64/128 dividing K, or per channel")
    codes = unpack_codes(w.weight_packed, bits, k, dim=1)  # [N, K] unsigned
    ngroups = k // group if group else 1
    scale = w.weight_scale.reshape(n, -1)
    if scale.shape[1] != ngroups:
        raise ValueError(f"weight_scale has {scale.shape[1]} groups, expected {ngroups} for K={k}, group {group}")
    zero = unpack_codes(w.weight_zero_point, bits, n, dim=0)[:, :ngroups] if w.weight_zero_point is not None else None
    perm = None
    if w.weight_g_idx is not None:
        perm = act_order_perm(w.weight_g_idx, group)
        codes = codes[:, perm.long()]
    elif input_permuted:
        raise ValueError("input_permuted without act-order (weight_g_idx)")
    bias = w.bias
    if out_perm is not None:
        rows = out_perm.long()
        codes, scale, bias = codes[rows], scale[rows], None if bias is None else bias[rows]
        zero = None if zero is None else zero[rows]
    n_pad, k_pad = _pad_to(n, TILE_N), _pad_to(k, panel_k(bits))
    codes = torch.nn.functional.pad(codes, (0, k_pad - k, 0, n_pad - n))
    npair = 16 // bits
    # [N_pad, panels, p, w, h] -> word[n, panel, w] = sum over (p, h) of code << bits * (p + npair * h)
    c = codes.to(torch.int64).reshape(n_pad, k_pad // panel_k(bits), npair, TILE_WORDS, 2)
    shift = (torch.arange(npair, device=c.device)[:, None] + npair * torch.arange(2, device=c.device)[None, :]) * bits
    words = (c << shift[:, None, :]).sum(dim=(2, 4))  # [N_pad, panels, 16]
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    qweight = words.reshape(n_pad // TILE_N, TILE_N, -1, TILE_WORDS).permute(0, 2, 1, 3).contiguous()
    g_pad = k_pad // group if group else 1
    scale_t = torch.zeros(g_pad, n_pad, dtype=scale.dtype, device=scale.device)
    scale_t[:ngroups, :n] = scale.t()
    zero_t = None
    if zero is not None:
        zero_t = torch.zeros(g_pad, n_pad, dtype=torch.int8, device=zero.device)
        zero_t[:ngroups, :n] = (zero - (1 << (bits - 1))).t().to(torch.int8)
    return TiledLinear(qweight, scale_t, bits, group, k, n, zero_t, perm,
                       None if out_perm is None else out_perm.to(torch.int32).contiguous(), input_permuted,
                       None if bias is None else bias.contiguous())


def tiled_codes(qweight: torch.Tensor, bits: int, n: int, k: int) -> torch.Tensor:
    """Unsigned codes [n, k] (int32) of a tiled weight, in stored order."""
    npair = 16 // bits
    words = qweight.permute(0, 2, 1, 3).reshape(qweight.shape[0] * TILE_N, -1, TILE_WORDS).to(torch.int64)
    shift = (torch.arange(npair, device=words.device)[:, None] + npair * torch.arange(2, device=words.device)[None, :]) * bits
    codes = (words[:, :, None, :, None] >> shift[None, None, :, None, :]) & ((1 << bits) - 1)  # [N, panels, p, w, h]
    return codes.reshape(words.shape[0], -1)[:n, :k].to(torch.int32)


def tiled_dequantize(qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int,
                     group_size: int, n: int, k: int) -> torch.Tensor:
    """[n, k] weight of the tiled layout in the scale dtype, (q - zp) * scale (stored order)."""
    q = tiled_codes(qweight, bits, n, k)
    grp = torch.arange(k, device=q.device) // group_size if group_size else torch.zeros(k, dtype=torch.long, device=q.device)
    s = scale[:, :n].t()[:, grp]
    z = (zero[:, :n].t()[:, grp].to(torch.int32) + (1 << (bits - 1))) if zero is not None else 1 << (bits - 1)
    return (q - z).to(scale.dtype) * s


def unrepack_tiled(t: TiledLinear) -> PackedLinear:
    """The compressed-tensors linear a tiled one was made from, bit for bit (original row and
    column order, packed codes and zero points, g_idx rebuilt from the permutation)."""
    n, k, bits, group = t.out_features, t.in_features, t.bits, t.group_size
    codes = t.codes()
    ngroups = k // group if group else 1
    scale = t.scale[:ngroups, :n].t()
    zero = None if t.zero is None else (t.zero[:ngroups, :n].t().to(torch.int32) + (1 << (bits - 1)))
    bias = t.bias
    if t.out_perm is not None:
        inv = torch.empty_like(t.out_perm, dtype=torch.long)
        inv[t.out_perm.long()] = torch.arange(n, device=inv.device)
        codes, scale, bias = codes[inv], scale[inv], None if bias is None else bias[inv]
        zero = None if zero is None else zero[inv]
    g_idx = None
    if t.perm is not None:
        inv = torch.empty(k, dtype=torch.long, device=codes.device)
        inv[t.perm.long()] = torch.arange(k, device=codes.device)
        codes = codes[:, inv]
        g_idx = torch.empty(k, dtype=torch.int32, device=codes.device)
        g_idx[t.perm.long()] = (torch.arange(k, device=codes.device) // (group or k)).to(torch.int32)
    return PackedLinear(pack_codes(codes, bits, dim=1), scale.contiguous(), bits, group, k,
                        None if zero is None else pack_codes(zero, bits, dim=0), g_idx,
                        None if bias is None else bias.contiguous())


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
    return {"N": n, "K": k, "stride_xm": k, "stride_qn": _pad_to(k, panel_k(bits)) * TILE_N // (32 // bits),
            "stride_sg": _pad_to(n, TILE_N), "stride_om": n}


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
    x: torch.Tensor, w: TiledLinear, out: torch.Tensor | None = None, executor: Executor | None = None
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
    resolve(executor, x).run(make_tiled_call(x2, w, out))
    return out.reshape(*lead, w.out_features)


def tiled_error_terms(w: TiledLinear, act_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(w_exact, offset_abs, weight_u) of `checks.exact_weight_bound` for this weight and activation
    dtype, in stored order: (q - z) s in float64, |s| (B + 2^b) for the offset B the bf16 path
    cancels (128 for 4-bit bf16, 0 for 8-bit bf16; fp16 subtracts z exactly, no offset), and the
    reference's weight rounding u_s + u_a + u_s u_a."""
    from lmfoundry.kernels.checks import unit_roundoff

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
