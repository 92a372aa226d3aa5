"""Few-row bf16 products on CPU (`bf16_gemv.c`): y = x W^T (+ bias) for decode-sized inputs, with
the weight stored blocked; the reference is `torch.nn.functional.linear`."""

from __future__ import annotations

import ctypes

import torch

from lmfoundry.runtime.cpu.native.build import bound

# Up to here a product is a weight stream (decode) and the C product is clearly faster; from about 6
# rows oneDNN's GEMM is level with it, from 12 faster (benchmarks/cpu_gemv.py, weights streamed from
# memory as in a step). Any row count routed here routes prompt chunks that short too, whose K/V
# then round differently from the same tokens computed in a long chunk (a prefix-cached request's
# greedy text can differ from the cold one's): another reason to keep it small.
MAX_ROWS = 4
TILE_N, TILE_K = 16, 32  # output rows x inputs of one blocked tile (a cache line per row)

_c_i64, _c_int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


class Bf16Gemv:
    """The built product with its C signature; `__call__` checks what the C side cannot."""

    max_rows = MAX_ROWS  # inputs of more rows go to oneDNN

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.lmf_bf16_gemv
        fn.restype = None
        fn.argtypes = [_ptr, _c_i64, _ptr, _ptr, _ptr, _c_i64, _c_int, _c_int, _c_int, _c_int]
        self._fn = fn
        self.supported = bool(lib.lmf_bf16_gemv_supported())  # built without AVX-512 BF16: no product

    @staticmethod
    def fits(out_features: int, in_features: int) -> bool:
        return out_features % TILE_N == 0 and in_features % TILE_K == 0

    @staticmethod
    def block(weight: torch.Tensor) -> torch.Tensor:
        """[N, K] bf16 -> [N/16, K/32, 16, 32]: the layout the product streams."""
        n, k = weight.shape
        return weight.detach().to(torch.bfloat16).reshape(n // TILE_N, TILE_N, k // TILE_K, TILE_K) \
            .permute(0, 2, 1, 3).contiguous()

    @staticmethod
    def unblock(blocked: torch.Tensor, out_features: int) -> torch.Tensor:
        """The plain [N, K] weight of `block`'s layout (a copy)."""
        nb, kb = blocked.shape[:2]
        return blocked.permute(0, 2, 1, 3).reshape(nb * TILE_N, kb * TILE_K)[:out_features]

    def __call__(self, x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                 threads: int | None = None) -> None:
        """out [M, N] = x [M, K] @ W^T + bias, W given blocked (`block`); bf16 throughout."""
        m, k = x.shape
        n = blocked.shape[0] * TILE_N
        if not (x.dtype == out.dtype == blocked.dtype == torch.bfloat16) or blocked.shape[1] * TILE_K != k \
                or out.shape != (m, n) or x.stride(1) != 1 or out.stride(1) != 1 or not blocked.is_contiguous():
            raise ValueError(f"bf16_gemv: x {tuple(x.shape)} {x.dtype}, weight blocks {tuple(blocked.shape)}, "
                             f"out {tuple(out.shape)} {out.dtype}")
        if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (n,) or not bias.is_contiguous()):
            raise ValueError(f"bf16_gemv: bias {tuple(bias.shape)} {bias.dtype}, expected ({n},) bfloat16")
        self._fn(x.data_ptr(), x.stride(0), blocked.data_ptr(), None if bias is None else bias.data_ptr(),
                 out.data_ptr(), out.stride(0), m, n, k, threads or torch.get_num_threads())


def load_bf16_gemv() -> Bf16Gemv | None:
    """The product, built on first use; None where it cannot be built, the CPU has no AVX-512
    BF16, or native kernels are turned off."""
    gemv = bound("bf16_gemv", Bf16Gemv)
    return gemv if gemv is not None and gemv.supported else None
