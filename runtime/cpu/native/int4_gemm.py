"""4-bit weight products on CPU (`int4_gemm.c`): y = x W^T (+ bias) for any number of rows, W held
as 4-bit codes with float32 group scales (and zeros); the reference is `reference` (the weight
dequantized in float32, then `F.linear`)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lmfoundry.runtime.cpu.native.build import bound

TILE_N = 16  # output channels decoded together (one dword lane each)

_c_i64, _c_int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


@dataclass
class Int4Weight:
    """A weight in the kernel's layout: codes uint8 [N/16, K/2, 16], scale (and zero) float32
    [N/16, K/g, 16]; w[n, k] = (u[n, k] - 8) * scale[n, k/g] + zero[n, k/g]."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    group: int
    out_features: int
    in_features: int


def fits(out_features: int, in_features: int, group: int) -> bool:
    return out_features % TILE_N == 0 and group % 2 == 0 and in_features % group == 0


def pack(unsigned: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int) -> Int4Weight:
    """unsigned codes [N, K] in 0..15 and per-group scale (zero) [N, K/group] -> the kernel's layout."""
    n, k = unsigned.shape
    if not fits(n, k, group) or scale.shape != (n, k // group) or (zero is not None and zero.shape != scale.shape):
        raise ValueError(f"int4_gemm: codes {tuple(unsigned.shape)}, scale {tuple(scale.shape)}, group {group}")
    u = unsigned.to(torch.uint8).reshape(n // TILE_N, TILE_N, k // 2, 2)
    codes = (u[..., 0] | (u[..., 1] << 4)).permute(0, 2, 1).contiguous()  # [N/16, K/2, 16]

    def tiles(t: torch.Tensor) -> torch.Tensor:
        return t.float().reshape(n // TILE_N, TILE_N, k // group).permute(0, 2, 1).contiguous()

    return Int4Weight(codes, tiles(scale), None if zero is None else tiles(zero), group, n, k)


def dequantize(w: Int4Weight) -> torch.Tensor:
    """float32 [N, K] of a packed weight (exactly what the codes and scales say)."""
    n, k, g = w.out_features, w.in_features, w.group
    c = w.codes.permute(0, 2, 1).reshape(n, k // 2).int()
    u = torch.stack([c & 15, c >> 4], -1).reshape(n, k).float()
    scale = w.scale.permute(0, 2, 1).reshape(n, k // g).repeat_interleave(g, 1)
    out = (u - 8) * scale
    if w.zero is not None:
        out = out + w.zero.permute(0, 2, 1).reshape(n, k // g).repeat_interleave(g, 1)
    return out


def reference(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """The product in float32 on the exactly dequantized weight, rounded once to bf16."""
    y = F.linear(x.float(), dequantize(w), None if bias is None else bias.float())
    return y.to(torch.bfloat16)


def check_args(name: str, x: torch.Tensor, n: int, k: int, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """Refuse what a C product cannot take: bf16 rows x [M, K] and out [M, N] with unit column
    stride, and a contiguous bf16 bias [N] or None."""
    m = x.shape[0]
    if x.dtype != torch.bfloat16 or out.dtype != torch.bfloat16 or x.shape[1] != k or out.shape != (m, n) \
            or x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError(f"{name}: x {tuple(x.shape)} {x.dtype}, weight {n}x{k}, out {tuple(out.shape)} {out.dtype}")
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"{name}: bias {tuple(bias.shape)} {bias.dtype}, expected ({n},) bfloat16")


class Int4Gemm:
    """The built product with its C signature; `__call__` checks what the C side cannot."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.lmf_int4_gemm
        fn.restype = None
        fn.argtypes = [_ptr, _c_i64, _ptr, _ptr, _ptr, _ptr, _ptr, _c_i64, _ptr, _c_int, _c_int, _c_int, _c_int,
                       _c_int]
        self._fn = fn
        dq = lib.lmf_int4_dequant
        dq.restype = None
        dq.argtypes = [_ptr, _ptr, _ptr, _ptr, _c_int, _c_int, _c_int, _c_int]
        self._dequant = dq
        self.supported = bool(lib.lmf_int4_gemm_supported())  # built without AVX-512 BF16: no product

    def __call__(self, x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None, out: torch.Tensor,
                 threads: int | None = None) -> None:
        """out [M, N] = x [M, K] @ W^T + bias; bf16 activations, bias and output."""
        m, k = x.shape
        check_args("int4_gemm", x, w.out_features, w.in_features, bias, out)
        xsum = torch.empty(m * (k // w.group) if w.zero is not None else 1, dtype=torch.float32)
        self._fn(x.data_ptr(), x.stride(0), w.codes.data_ptr(), w.scale.data_ptr(),
                 None if w.zero is None else w.zero.data_ptr(), None if bias is None else bias.data_ptr(),
                 out.data_ptr(), out.stride(0), xsum.data_ptr(), m, w.out_features, k, w.group, threads or torch.get_num_threads())


    def dequantize(self, w: Int4Weight, out: torch.Tensor | None = None, threads: int | None = None) -> torch.Tensor:
        """The bf16 weight [N, K] (into `out` when given): each element (u - 8) * scale + zero
        in fp32, rounded once, as `dequantize(w).to(torch.bfloat16)`."""
        n, k = w.out_features, w.in_features
        if out is None:
            out = torch.empty(n, k, dtype=torch.bfloat16)
        if out.shape != (n, k) or out.dtype != torch.bfloat16 or not out.is_contiguous():
            raise ValueError(f"int4_gemm: dequantize into {tuple(out.shape)} {out.dtype}, expected ({n}, {k}) bf16")
        self._dequant(w.codes.data_ptr(), w.scale.data_ptr(), None if w.zero is None else w.zero.data_ptr(),
                      out.data_ptr(), n, k, w.group, threads or torch.get_num_threads())
        return out


def load_int4_gemm() -> Int4Gemm | None:
    """The product, built on first use; None where it cannot be built, the CPU has no AVX-512
    BF16, or native kernels are turned off."""
    gemm = bound("int4_gemm", Int4Gemm)
    return gemm if gemm is not None and gemm.supported else None
