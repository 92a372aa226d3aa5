"""The gathered LoRA products on CPU (`lora.c`): what `lmfoundry.kernels.lora` defines (and its
references compute) for bfloat16 or float32 activations, in two calls per linear site whatever
adapters a step mixes."""

from __future__ import annotations

import ctypes

import torch

from lmfoundry.runtime.cpu.native.build import bound

_c_i64, _c_int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


class LoRAKernels:
    """The built kernels with their C signatures; each checks what the C side cannot and raises
    ValueError for inputs it does not take (the caller then runs the reference)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._shrink, self._expand, self._apply = {}, {}, {}
        for dtype, suffix in SUFFIX.items():
            fn = getattr(lib, f"lmf_lora_apply_{suffix}")
            fn.restype = None
            fn.argtypes = [_ptr, _c_i64, _ptr, _ptr, _ptr, _ptr, _c_int, _c_int, _c_int, _c_int, _ptr, _ptr, _c_i64,
                           _c_i64, _c_int]
            self._apply[dtype] = fn
            fn = getattr(lib, f"lmf_lora_shrink_{suffix}")
            fn.restype = None
            fn.argtypes = [_ptr, _c_i64, _ptr, _ptr, _ptr, _c_i64, _c_i64, _c_int, _c_int, _c_int]
            self._shrink[dtype] = fn
            fn = getattr(lib, f"lmf_lora_expand_{suffix}")
            fn.restype = None
            fn.argtypes = [_ptr, _c_i64, _ptr, _ptr, _ptr, _c_int, _c_int, _c_int, _ptr, _c_i64, _c_i64, _c_int]
            self._expand[dtype] = fn

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        return dtype in SUFFIX

    def shrink(self, x: torch.Tensor, a: torch.Tensor, rows: torch.Tensor, out: torch.Tensor,
               threads: int | None = None) -> torch.Tensor:
        """out [T, S] float32 = each row's x [T, K] times its adapter's A (0 for base rows)."""
        t, k = x.shape
        if x.dtype not in SUFFIX or a.dtype != x.dtype or x.stride(1) != 1 or not a.is_contiguous() \
                or a.shape[2] != k or rows.dtype != torch.int32 or rows.shape != (t,) or not rows.is_contiguous() \
                or out.dtype != torch.float32 or out.shape != (t, a.shape[1]) or out.stride(1) != 1:
            raise ValueError(f"lora shrink: x {tuple(x.shape)} {x.dtype}, a {tuple(a.shape)} {a.dtype}, "
                             f"out {tuple(out.shape)} {out.dtype}")
        self._shrink[x.dtype](x.data_ptr(), x.stride(0), a.data_ptr(), rows.data_ptr(), out.data_ptr(),
                              out.stride(0), t, k, a.shape[1], threads or torch.get_num_threads())
        return out

    def expand(self, s: torch.Tensor, bt: torch.Tensor, rows: torch.Tensor, ends: torch.Tensor, y: torch.Tensor,
               threads: int | None = None) -> torch.Tensor:
        """y [T, N] += each row's delta, in place (base rows untouched); returns y."""
        t, n = y.shape
        parts, r = ends.shape[0], bt.shape[1]
        if y.dtype not in SUFFIX or bt.dtype != y.dtype or not bt.is_contiguous() or bt.shape[2] != n \
                or s.dtype != torch.float32 or s.shape != (t, parts * r) or s.stride(1) != 1 or y.stride(1) != 1 \
                or rows.dtype != torch.int32 or rows.shape != (t,) or not rows.is_contiguous() \
                or ends.dtype != torch.int32 or not ends.is_contiguous() or int(ends[-1]) != n:
            raise ValueError(f"lora expand: s {tuple(s.shape)}, bt {tuple(bt.shape)} {bt.dtype}, "
                             f"y {tuple(y.shape)} {y.dtype}, {parts} parts")
        self._expand[y.dtype](s.data_ptr(), s.stride(0), bt.data_ptr(), rows.data_ptr(), ends.data_ptr(), parts, r,
                              n, y.data_ptr(), y.stride(0), t, threads or torch.get_num_threads())
        return y


    def check_stack(self, a: torch.Tensor, bt: torch.Tensor, ends: torch.Tensor) -> None:
        """Refuse a site's stacked weights `apply` cannot read (checked once, when a stack is made)."""
        parts, r = ends.shape[0], bt.shape[1]
        if a.dtype not in SUFFIX or bt.dtype != a.dtype or not a.is_contiguous() or not bt.is_contiguous() \
                or a.shape[1] != parts * r or ends.dtype != torch.int32 or not ends.is_contiguous() \
                or int(ends[-1]) != bt.shape[2] or a.device.type != "cpu":
            raise ValueError(f"lora stack: a {tuple(a.shape)} {a.dtype}, bt {tuple(bt.shape)} {bt.dtype}, {parts} parts")

    def apply(self, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, rows: torch.Tensor, ends: torch.Tensor,
              y: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        """y += each row's delta (shrink, then expand) in one call: the serving path, per step and
        site. The stacked weights are the ones `check_stack` passed; only what changes per call is
        checked here."""
        t, k = x.shape
        n = y.shape[1]
        if x.dtype != a.dtype or y.dtype != a.dtype or x.stride(1) != 1 or y.stride(1) != 1 or k != a.shape[2] \
                or n != bt.shape[2] or y.shape[0] != t or rows.shape != (t,) or rows.dtype != torch.int32 \
                or not rows.is_contiguous():
            raise ValueError(f"lora apply: x {tuple(x.shape)} {x.dtype}, y {tuple(y.shape)} {y.dtype}, "
                             f"rows {tuple(rows.shape)} {rows.dtype}")
        scratch = torch.empty(t, a.shape[1])
        self._apply[a.dtype](x.data_ptr(), x.stride(0), a.data_ptr(), bt.data_ptr(), rows.data_ptr(), ends.data_ptr(),
                             ends.shape[0], bt.shape[1], k, n, scratch.data_ptr(), y.data_ptr(), y.stride(0), t,
                             threads or torch.get_num_threads())
        return y


def load_lora_kernels() -> LoRAKernels | None:
    """The kernels, built on first use; None where they cannot be built or are turned off."""
    return bound("lora", LoRAKernels)
