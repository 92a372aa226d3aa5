"""8-bit weight products on CPU (`int8_gemm.c`): y = x W^T (+ bias) for any number of rows, W held
as int8 codes with one float32 scale per output channel (and zero x scale for asymmetric codes);
the reference is `reference` (the weight dequantized in float32, then `F.linear`)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lmfoundry.runtime.cpu.native.build import bound
from lmfoundry.runtime.cpu.native.int4_gemm import check_args

TILE_N = 16  # output channels widened together (one dword lane each)

_c_i64, _c_int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


@dataclass
class Int8Weight:
    """A weight in the kernel's layout: codes int8 [N/16, K/2, 32] (channel j's codes of inputs 2p,
    2p + 1 at bytes 2j, 2j + 1 of pair p), scale (and zero_scaled) float32 [N/16, 16];
    w[n, k] = code[n, k] * scale[n] - zero_scaled[n]."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero_scaled: torch.Tensor | None
    out_features: int
    in_features: int


def fits(out_features: int, in_features: int) -> bool:
    return out_features % TILE_N == 0 and in_features % 2 == 0


def pack(codes: torch.Tensor, scale: torch.Tensor, zero_scaled: torch.Tensor | None) -> Int8Weight:
    """int8 codes [N, K], scale [N] (and zero x scale [N]) -> the kernel's layout."""
    n, k = codes.shape
    if not fits(n, k) or scale.shape != (n,) or (zero_scaled is not None and zero_scaled.shape != (n,)):
        raise ValueError(f"int8_gemm: codes {tuple(codes.shape)}, scale {tuple(scale.shape)}")
    tiled = codes.to(torch.int8).reshape(n // TILE_N, TILE_N, k // 2, 2).permute(0, 2, 1, 3)
    return Int8Weight(tiled.reshape(n // TILE_N, k // 2, 2 * TILE_N).contiguous(), scale.float().contiguous(),
                      None if zero_scaled is None else zero_scaled.float().contiguous(), n, k)


def dequantize(w: Int8Weight) -> torch.Tensor:
    """float32 [N, K] of a packed weight."""
    n, k = w.out_features, w.in_features
    codes = w.codes.reshape(n // TILE_N, k // 2, TILE_N, 2).permute(0, 2, 1, 3).reshape(n, k).float()
    out = codes * w.scale[:, None]
    return out if w.zero_scaled is None else out - w.zero_scaled[:, None]


def reference(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """The product in float32 on the exactly dequantized weight, rounded once to bf16."""
    return F.linear(x.float(), dequantize(w), None if bias is None else bias.float()).to(torch.bfloat16)


class Int8Gemm:
    """The built product with its C signature; `__call__` checks what the C side cannot."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.lmf_int8_gemm
        fn.restype = None
        fn.argtypes = [_ptr, _c_i64, _ptr, _ptr, _ptr, _ptr, _ptr, _c_i64, _ptr, _c_int, _c_int, _c_int, _c_int]
        self._fn = fn
        self.supported = bool(lib.lmf_int8_gemm_supported())  # built without AVX-512 BF16: no product

    def __call__(self, x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None, out: torch.Tensor,
                 threads: int | None = None) -> None:
        """out [M, N] = x [M, K] @ W^T + bias; bf16 activations, bias and output."""
        m, k = x.shape
        check_args("int8_gemm", x, w.out_features, w.in_features, bias, out)
        xsum = torch.empty(m if w.zero_scaled is not None else 1, dtype=torch.float32)
        self._fn(x.data_ptr(), x.stride(0), w.codes.data_ptr(), w.scale.data_ptr(),
                 None if w.zero_scaled is None else w.zero_scaled.data_ptr(), None if bias is None else bias.data_ptr(),
                 out.data_ptr(), out.stride(0), xsum.data_ptr(), m, w.out_features, k,
                 threads or torch.get_num_threads())


def load_int8_gemm() -> Int8Gemm | None:
    """The product, built on first use; None where it cannot be built, the CPU has no AVX-512
    BF16, or native kernels are turned off."""
    gemm = bound("int8_gemm", Int8Gemm)
    return gemm if gemm is not None and gemm.supported else None
