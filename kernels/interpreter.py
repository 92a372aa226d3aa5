"""Corrections to Triton 3.7's CPU interpreter for bf16 and fp8, applied by the kernel tests.

The interpreter stores bf16 and fp8 as raw integers and gets three things wrong that GPUs get
right (measured; upstream triton-lang/triton#11584 covers the dot):
  - fp32 -> bf16 truncates instead of rounding to nearest even, and int -> bf16 reinterprets the
    integer as a bit pattern;
  - fp32 -> fp8 e4m3 flushes small values to zero and rounds ties/mantissa overflow wrongly;
  - `tl.dot` on bf16 multiplies the raw bit patterns.
`patch_interpreter()` reroutes conversions that involve bf16 or fp8 through torch (round to nearest
even; fp8 saturating at the format's max like `cvt.rn.satfinite`) and runs dots on those types
in fp32. The kernels never do arithmetic directly in bf16 (they compute in fp32 and round), which
the interpreter cannot model either. Nothing here changes compiled (GPU) behaviour.
"""

from __future__ import annotations

import numpy as np
import torch

_patched = False


def _tables() -> tuple[dict, set]:
    import triton.language as tl

    torch_of = {
        tl.bfloat16: torch.bfloat16,
        tl.float8e4nv: torch.float8_e4m3fn,
        tl.float8e5: torch.float8_e5m2,
        tl.float16: torch.float16,
        tl.float32: torch.float32,
        tl.float64: torch.float64,
        tl.int8: torch.int8,
        tl.uint8: torch.uint8,
        tl.int16: torch.int16,
        tl.int32: torch.int32,
        tl.int64: torch.int64,
    }
    special = {tl.bfloat16, tl.float8e4nv, tl.float8e5}
    return torch_of, special


def _to_torch(data: np.ndarray, ty, torch_of: dict) -> torch.Tensor:
    import triton.language as tl

    arr = np.ascontiguousarray(data)
    if ty == tl.bfloat16:
        return torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16)
    if ty in (tl.float8e4nv, tl.float8e5):
        return torch.from_numpy(arr.view(np.uint8).copy()).view(torch_of[ty])
    return torch.from_numpy(arr.copy())


def _from_torch(t: torch.Tensor, ty) -> np.ndarray:
    import triton.language as tl

    if ty == tl.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    if ty in (tl.float8e4nv, tl.float8e5):
        return t.view(torch.uint8).numpy()
    return t.numpy()


def patch_interpreter() -> None:
    """Install the corrected conversions and dot into Triton's interpreter (idempotent)."""
    global _patched
    if _patched:
        return
    import triton.language as tl
    from triton.runtime import interpreter as interp

    torch_of, special = _tables()
    builder_cls = interp.InterpreterBuilder
    original_cast = builder_cls.cast_impl
    original_dot = builder_cls.create_dot

    def convert(src, dst_type):
        src_ty, dst_ty = src.dtype.scalar, dst_type.scalar
        x = _to_torch(src.data, src_ty, torch_of)
        if dst_ty in (tl.float8e4nv, tl.float8e5) and x.dtype.is_floating_point:
            fmax = torch.finfo(torch_of[dst_ty]).max
            x = x.float().clamp(-fmax, fmax)
        y = x.to(torch_of[dst_ty])
        return interp.TensorHandle(_from_torch(y, dst_ty).reshape(np.shape(src.data)), dst_ty)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar in special or dst_type.scalar in special:
            return convert(src, dst_type)
        return original_cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        return convert(src, dst_type)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar in special or b.dtype.scalar in special:
            a32 = _to_torch(a.data, a.dtype.scalar, torch_of).float().numpy()
            b32 = _to_torch(b.data, b.dtype.scalar, torch_of).float().numpy()
            return interp.TensorHandle(np.matmul(a32, b32, dtype=d.data.dtype) + d.data, d.dtype.scalar)
        return original_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder_cls.cast_impl = cast_impl
    for name in ("create_si_to_fp", "create_ui_to_fp", "create_fp_to_si", "create_fp_to_ui", "create_fp_ext",
                 "create_fp_trunc"):
        setattr(builder_cls, name, lambda self, src, dst_type: self.cast_impl(src, dst_type))
    builder_cls.create_int_cast = lambda self, src, dst_type, is_signed: self.cast_impl(src, dst_type)
    builder_cls.create_fp_to_fp = create_fp_to_fp
    builder_cls.create_dot = create_dot
    _patched = True
