"""Rotary position embedding of q and k in bfloat16 on CPU, one call for both (`rope.c`); the
reference is `lmfoundry.model.attention_math.apply_rotary`, which it reproduces bit for bit."""

from __future__ import annotations

import ctypes

import torch

from lmfoundry.runtime.cpu.native.build import bound

_c_i64, _c_int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


class RopeQK:
    """The built kernel with its C signature. `__call__` returns None where its inputs do not fit
    (not bfloat16, not [T, heads, D] with contiguous heads, tables of another width): the caller
    then runs the reference."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.lmf_rope_qk_bf16
        fn.restype = None
        fn.argtypes = [_ptr, _c_i64, _c_i64, _c_int, _ptr, _c_i64, _c_i64, _c_int, _ptr, _ptr, _ptr, _ptr, _c_i64,
                       _c_i64, _c_int, _c_int]
        self._fn = fn

    def __call__(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(q, k) rotated: q [T, Hq, D], k [T, Hk, D] bf16 (each head's D contiguous), cos/sin
        [T, D] bf16 in the cat(freqs, freqs) layout; new contiguous tensors."""
        if q.dim() != 3 or k.dim() != 3 or cos.dim() != 2:
            return None
        t, hq, d = q.shape
        if not (q.dtype == k.dtype == cos.dtype == sin.dtype == torch.bfloat16) or k.shape[0] != t \
                or k.shape[2] != d or cos.shape != (t, d) or sin.shape != (t, d) or d % 2 \
                or q.stride(2) != 1 or k.stride(2) != 1 or cos.stride(1) != 1 or sin.stride() != cos.stride():
            return None
        q_out, k_out = torch.empty(q.shape, dtype=q.dtype), torch.empty(k.shape, dtype=k.dtype)
        self._fn(q.data_ptr(), q.stride(0), q.stride(1), hq, k.data_ptr(), k.stride(0), k.stride(1), k.shape[1],
                 q_out.data_ptr(), k_out.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.stride(0), t, d,
                 threads or torch.get_num_threads())
        return q_out, k_out


def load_rope() -> RopeQK | None:
    """The kernel, built on first use; None where it cannot be built or is turned off."""
    return bound("rope", RopeQK)
