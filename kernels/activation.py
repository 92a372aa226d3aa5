"""SiLU-and-multiply: out = silu(gate) * up for the fused gate/up GEMM output [M, 2I] -> [M, I].

Computed in fp32 and rounded once to the model dtype (Hugging Face rounds after the SiLU and again
after the product; the single rounding is at least as accurate and is what the reference does).
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from lmfoundry.kernels.dispatch import Launcher, resolve
from lmfoundry.kernels.spec import KernelCall, KernelDef, Param, Support, TileConfig, next_pow2, triton_type

SUPPORT = Support({"dtype": ("float16", "bfloat16", "float32"), "arch": (80, 86, 89, 90)})


@triton.jit
def silu_mul_kernel(x_ptr, out_ptr, INTER, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def reference(x: torch.Tensor) -> torch.Tensor:
    """x [M, 2I] (gate then up) -> silu(gate) * up in fp32, rounded to x's dtype."""
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def _reference_call(call: KernelCall) -> None:
    a = call.args
    rows, inter = call.shape["M"], a["INTER"]
    x = torch.as_strided(a["x_ptr"], (rows, 2 * inter), (a["stride_x"], 1))
    torch.as_strided(a["out_ptr"], (rows, inter), (a["stride_o"], 1)).copy_(reference(x))


def _default_config(shape: Mapping[str, int]) -> TileConfig:
    return TileConfig.make(num_warps=4, num_stages=1, BLOCK=min(1024, next_pow2(shape["I"])))


KERNEL = KernelDef(
    name="silu_mul",
    fn=silu_mul_kernel,
    params=(
        Param("x_ptr", "*{act}"),
        Param("out_ptr", "*{act}"),
        Param("INTER", "i32", aligned=True),
        Param("stride_x", "i32", aligned=True),
        Param("stride_o", "i32", aligned=True),
    ),
    grid=("M", "cdiv(INTER, BLOCK)", "1"),
    type_vars=("act",),
    semantics=(),
    tiles=("BLOCK",),
    reference=_reference_call,
    default_config=_default_config,
    shape_ints=lambda shape: {"INTER": shape["I"], "stride_x": 2 * shape["I"], "stride_o": shape["I"]},
    static_shape=("I",),
)


def silu_mul(x: torch.Tensor, out: torch.Tensor | None = None, launcher: Launcher | None = None) -> torch.Tensor:
    """silu(x[..., :I]) * x[..., I:] for x [..., 2I]; returns [..., I] in x's dtype."""
    lead, width = x.shape[:-1], x.shape[-1]
    if width % 2:
        raise ValueError(f"last dim {width} is not gate+up (even)")
    x2 = x.reshape(-1, width)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    inter = width // 2
    if out is None:
        out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    call = KernelCall(
        kernel=KERNEL,
        args={"x_ptr": x2, "out_ptr": out, "INTER": inter, "stride_x": x2.stride(0), "stride_o": out.stride(0)},
        types={"act": triton_type(x.dtype)},
        semantics={},
        shape={"M": x2.shape[0], "I": inter},
    )
    resolve(launcher, x).run(call)
    return out.reshape(*lead, inter)
