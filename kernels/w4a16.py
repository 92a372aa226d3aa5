"""Weight-only integer GEMMs (W4A16, W8A16) on the compressed-tensors layout; the family's support.

Two layouts, two sets of kernels:

- `pack-quantized` as stored by compressed-tensors (`PackedLinear`): `weight_packed` int32
  [N, ceil(K*b/32)], element k of row n in word k // (32/b) at bit (k % (32/b)) * b, stored as
  unsigned q + 2^(b-1); `weight_scale` [N, K/g]; `weight_zero_point` packed along dim 0; optional
  `weight_g_idx` [K]. Dequantization is `(q - zp) * scale` in the scale dtype. `w4a16_gemm` /
  `w4a16_gemv` read it directly (a shift per element, scales gathered through g_idx); they serve
  checkpoints executed without a compile step and are the baseline of the tiled kernel.
- the tiled layout (`TiledLinear`, `w4a16_tiled.py`), written by `lmfoundry compile` and read by
  the kernel an engine bundle runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
import triton
import triton.language as tl

from lmfoundry.kernels.dispatch import Launcher, resolve
from lmfoundry.kernels.spec import KernelCall, KernelDef, Param, Support, TileConfig, triton_type
from lmfoundry.quantformat.int32_packing import unsigned_codes

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
    q = unsigned_codes(weight_packed, bits, in_features, dim=1)
    if weight_g_idx is not None:
        grp = weight_g_idx.long()
    elif group_size == 0:
        grp = torch.zeros(in_features, dtype=torch.long, device=q.device)
    else:
        grp = torch.arange(in_features, device=q.device) // group_size
    scale = weight_scale[:, grp]
    zero: torch.Tensor | int = 1 << (bits - 1)  # symmetric: the unsigned codes' midpoint
    if weight_zero_point is not None:
        zero = unsigned_codes(weight_zero_point, bits, n, dim=0)[:, grp]
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
    x: torch.Tensor, w: PackedLinear, out: torch.Tensor | None = None, launcher: Launcher | None = None
) -> torch.Tensor:
    """y = x @ dequant(W)^T (+ bias) for x [..., K]; returns [..., N] in x's dtype."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out is None:
        out = torch.empty((x2.shape[0], w.out_features), dtype=x.dtype, device=x.device)
    resolve(launcher, x).run(make_call(x2, w, out))
    return out.reshape(*lead, w.out_features)
