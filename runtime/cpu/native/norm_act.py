"""A Llama layer's RMSNorm and SiLU(gate) * up in bfloat16 on CPU, one pass each (`norm_act.c`).
The RMSNorm's reference is `lmfoundry.kernels.norm_quant.rmsnorm_reference` (the reference
model's bf16 arithmetic); SiLU-mul's is `silu_mul_reference` below, the model's in-place ops
(`kernels.activation.reference` rounds once where the model rounds twice)."""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from lmfoundry.runtime.cpu.native.build import bound

_c_i64, _c_int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


def _rows(t: torch.Tensor, width: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor | None:
    """t as [rows, width] with unit column stride, without copying; None where that needs a copy."""
    if t.dtype != dtype or t.shape[-1] != width or t.stride(-1) != 1:
        return None
    try:
        return t.view(-1, width)
    except RuntimeError:
        return None


class NormAct:
    """The built kernels with their C signatures. Each call returns None where its inputs do not
    fit (not bfloat16, strided columns): the caller then runs the reference."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._norm = lib.lmf_rms_norm_bf16
        self._norm.restype = None
        self._norm.argtypes = [_ptr, _c_i64, _ptr, _ptr, _c_i64, _c_i64, _c_int, ctypes.c_float, _c_int]
        self._silu_mul = lib.lmf_silu_mul_bf16
        self._silu_mul.restype = None
        self._silu_mul.argtypes = [_ptr, _c_i64, _ptr, _c_i64, _ptr, _c_i64, _c_i64, _c_int, _c_int]
        self._silu_mul_f32 = lib.lmf_silu_mul_f32
        self._silu_mul_f32.restype = None
        self._silu_mul_f32.argtypes = self._silu_mul.argtypes

    def rms_norm(self, x: torch.Tensor, gain: torch.Tensor, eps: float,
                 threads: int | None = None) -> torch.Tensor | None:
        """gain * bf16(x / sqrt(mean(x^2) + eps)) over the last dimension; x [..., dim] bf16."""
        dim = gain.shape[0]
        rows = _rows(x, dim)
        if rows is None or gain.dtype != torch.bfloat16 or gain.dim() != 1 or not gain.is_contiguous():
            return None
        out = torch.empty(x.shape, dtype=torch.bfloat16)
        self._norm(rows.data_ptr(), rows.stride(0), gain.data_ptr(), out.data_ptr(), dim, rows.shape[0], dim, eps,
                   threads or torch.get_num_threads())
        return out

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor, threads: int | None = None) -> torch.Tensor | None:
        """bf16(silu(gate)) * up, elementwise; gate and up [..., n] bf16 (views of one fused
        product allowed), the result contiguous. Float32 inputs get silu(gate) * up in float32,
        every element with the same arithmetic (the deterministic mode's activation)."""
        n, dtype = gate.shape[-1], gate.dtype
        if dtype not in (torch.bfloat16, torch.float32):
            return None
        g, u = _rows(gate, n, dtype), _rows(up, n, dtype)
        if g is None or u is None or gate.shape != up.shape:
            return None
        out = torch.empty(gate.shape, dtype=dtype)
        fn = self._silu_mul if dtype == torch.bfloat16 else self._silu_mul_f32
        fn(g.data_ptr(), g.stride(0), u.data_ptr(), u.stride(0), out.data_ptr(), n, g.shape[0], n,
           threads or torch.get_num_threads())
        return out


def load_norm_act() -> NormAct | None:
    """The kernels, built on first use; None where they cannot be built or are turned off."""
    return bound("norm_act", NormAct)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`lmfoundry.model.reference.MLP.hidden`'s SiLU(gate) * up in the inputs' dtype."""
    return F.silu(gate).mul_(up)
