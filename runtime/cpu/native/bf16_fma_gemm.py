"""bf16 products on CPUs without bf16 arithmetic (`bf16_fma_gemm.c`): y = x W^T (+ bias) for any
number of rows, the weight widened to float32 in registers; the reference is
`torch.nn.functional.linear` in float32 on the same bf16 values, rounded to bf16 once.
`F32FmaGemm` is the same product in float32 throughout (the engine's batch-invariant float32
linear); its reference is `torch.nn.functional.linear` in float64."""

from __future__ import annotations

import ctypes

import torch

from lmfoundry.runtime.cpu.native.build import bound

# Every row count: from one row (a weight stream) to prompt chunks (FMA-bound) the C product keeps
# up with float32 BLAS on a float32 copy of the weight and beats the emulated bf16 GEMM
# (benchmarks/cpu_gemv.py measures the paths per row count on this machine).
MAX_ROWS = 2**31 - 1
TILE_N = 16  # output channels of one panel (a 32-byte line of bf16 weights per input)

_c_i64, _c_int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


class Bf16FmaGemm:
    """The built product with its C signature; `__call__` checks what the C side cannot. Its
    interface is `bf16_gemv.Bf16Gemv`'s (`block`, `max_rows`, call), so a linear can hold either;
    it takes any shape (the last panel is padded)."""

    max_rows = MAX_ROWS
    dtype = torch.bfloat16  # of x, the weight panels, the bias and the output
    symbol = "lmf_bf16_fma_gemm"

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = getattr(lib, self.symbol)
        fn.restype = _c_int
        fn.argtypes = [_ptr, _c_i64, _ptr, _ptr, _ptr, _c_i64, _c_int, _c_int, _c_int, _c_int]
        self._fn = fn
        self.supported = bool(lib.lmf_bf16_fma_gemm_supported())  # built without AVX2 + FMA: no product

    @classmethod
    def block(cls, weight: torch.Tensor) -> torch.Tensor:
        """[N, K] -> [ceil(N/16), K, 16] in the product's dtype: panels of 16 output channels, one
        line per input, the last panel padded with zero channels."""
        n, k = weight.shape
        w = weight.detach().to(cls.dtype)
        if n % TILE_N:
            w = torch.cat([w, w.new_zeros(TILE_N - n % TILE_N, k)])
        return w.reshape(-1, TILE_N, k).transpose(1, 2).contiguous()

    @staticmethod
    def unblock(panels: torch.Tensor, out_features: int) -> torch.Tensor:
        """The plain [N, K] weight of `block`'s panels (a view; `.contiguous()` copies)."""
        nb, k, _ = panels.shape
        return panels.transpose(1, 2).reshape(nb * TILE_N, k)[:out_features]

    def __call__(self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                 threads: int | None = None) -> None:
        """out [M, N] = x [M, K] @ W^T + bias, W given as panels (`block`); all in `dtype`."""
        m, k = x.shape
        n = out.shape[-1]
        name = self.symbol.removeprefix("lmf_")
        if not (x.dtype == out.dtype == panels.dtype == self.dtype) or panels.shape[1:] != (k, TILE_N) \
                or out.dim() != 2 or out.shape[0] != m or panels.shape[0] != -(-n // TILE_N) or x.stride(1) != 1 or out.stride(1) != 1 or not panels.is_contiguous():
            raise ValueError(f"{name}: x {tuple(x.shape)} {x.dtype}, weight panels {tuple(panels.shape)}, "
                             f"out {tuple(out.shape)} {out.dtype}")
        if bias is not None and (bias.dtype != self.dtype or bias.shape != (n,) or not bias.is_contiguous()):
            raise ValueError(f"{name}: bias {tuple(bias.shape)} {bias.dtype}, expected ({n},) {self.dtype}")
        if m == 0:
            return
        if self._fn(x.data_ptr(), x.stride(0), panels.data_ptr(), None if bias is None else bias.data_ptr(),
                    out.data_ptr(), out.stride(0), m, n, k, threads or torch.get_num_threads()):
            raise MemoryError(f"{name}: no memory for a float32 copy of x {tuple(x.shape)}")


class F32FmaGemm(Bf16FmaGemm):
    """The float32 product of the same library: x, panels, bias and output in float32."""

    dtype = torch.float32
    symbol = "lmf_f32_fma_gemm"


def load_bf16_fma_gemm() -> Bf16FmaGemm | None:
    """The product, built on first use; None where it cannot be built, the CPU has no AVX2 and FMA,
    or native kernels are turned off."""
    gemm = bound("bf16_fma_gemm", Bf16FmaGemm)
    return gemm if gemm is not None and gemm.supported else None


def load_f32_fma_gemm() -> F32FmaGemm | None:
    """The float32 product, where `load_bf16_fma_gemm` finds the library."""
    gemm = bound("bf16_fma_gemm", F32FmaGemm)
    return gemm if gemm is not None and gemm.supported else None
