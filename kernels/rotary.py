"""Rotary position embedding (Llama/NeoX "rotate half" convention) applied to q and k together.

q [T, Hq, D] and k [T, Hkv, D] may be strided views of the fused qkv GEMM output; results go to
q_out / k_out, which may alias q / k for in-place use. cos/sin come from fp32 tables [P, D/2]
indexed by each token's position (the tables carry the rope type's attention scaling), built once
by `rope_tables` from the model's inverse frequencies — on-device cos/sin of large arguments is
not accurate enough. The rotation runs in fp32 and rounds once to the model dtype.
"""

from __future__ import annotations

from typing import Mapping

import torch
import triton
import triton.language as tl

from lmfoundry.kernels.dispatch import Launcher, resolve
from lmfoundry.kernels.spec import KernelCall, KernelDef, Param, Support, TileConfig, next_pow2, triton_type

SUPPORT = Support({"dtype": ("float16", "bfloat16", "float32"), "head_dim": (64, 80, 96, 128, 256), "arch": (80, 86, 89, 90)})


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, t, stride_t, stride_h, stride_dt, stride_dh, cos, sin,
                  NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < NUM_HEADS)[:, None] & (d < HALF)[None, :]
    src = src_ptr + t * stride_t + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    dst = dst_ptr + t * stride_dt + h[:, None] * stride_dh + d[None, :]
    tl.store(dst, o1.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, o2.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh, stride_cos,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    d = tl.arange(0, BLOCK_D)
    cos = tl.load(cos_ptr + pos * stride_cos + d, mask=d < HALF, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cos + d, mask=d < HALF, other=0.0)[None, :]
    _rotate_heads(q_ptr, q_out_ptr, t, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin,
                  NUM_Q_HEADS, HALF, BLOCK_H, BLOCK_D)
    _rotate_heads(k_ptr, k_out_ptr, t, stride_kt, stride_kh, stride_kot, stride_koh, cos, sin,
                  NUM_KV_HEADS, HALF, BLOCK_H, BLOCK_D)


def rope_tables(inv_freq: torch.Tensor, max_positions: int, attention_scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin tables [max_positions, D/2], computed like Hugging Face (fp32 outer product)."""
    freqs = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)[:, None] * inv_freq.float()[None, :]
    return (freqs.cos() * attention_scaling).contiguous(), (freqs.sin() * attention_scaling).contiguous()


def reference(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by the tables' rows at `positions`, fp32 math, x's dtype out."""
    half = x.shape[-1] // 2
    c = cos[positions.long()][:, None, :]
    s = sin[positions.long()][:, None, :]
    x1, x2 = x.float()[..., :half], x.float()[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def _reference_call(call: KernelCall) -> None:
    a, s = call.args, call.semantics
    t, d = call.shape["T"], s["HEAD_DIM"]
    half = d // 2
    positions = a["pos_ptr"][:t]
    cos = torch.as_strided(a["cos_ptr"], (a["cos_ptr"].numel() // a["stride_cos"], half), (a["stride_cos"], 1))
    sin = torch.as_strided(a["sin_ptr"], cos.shape, (a["stride_cos"], 1))
    for src, dst, heads, st, sh, sdt, sdh in (
        ("q_ptr", "q_out_ptr", s["NUM_Q_HEADS"], "stride_qt", "stride_qh", "stride_qot", "stride_qoh"),
        ("k_ptr", "k_out_ptr", s["NUM_KV_HEADS"], "stride_kt", "stride_kh", "stride_kot", "stride_koh"),
    ):
        x = torch.as_strided(a[src], (t, heads, d), (a[st], a[sh], 1))
        y = reference(x, positions, cos, sin)
        torch.as_strided(a[dst], (t, heads, d), (a[sdt], a[sdh], 1)).copy_(y)


def _default_config(shape: Mapping[str, int]) -> TileConfig:
    return TileConfig.make(
        num_warps=4, num_stages=1, BLOCK_H=next_pow2(max(shape["Hq"], shape["Hkv"])), BLOCK_D=next_pow2(shape["D"] // 2)
    )


KERNEL = KernelDef(
    name="rotary",
    fn=rotary_kernel,
    params=(
        Param("q_ptr", "*{act}"),
        Param("k_ptr", "*{act}"),
        Param("q_out_ptr", "*{act}"),
        Param("k_out_ptr", "*{act}"),
        Param("pos_ptr", "*i32"),
        Param("cos_ptr", "*fp32"),
        Param("sin_ptr", "*fp32"),
        Param("stride_qt", "i32", aligned=True),
        Param("stride_qh", "i32", aligned=True),
        Param("stride_kt", "i32", aligned=True),
        Param("stride_kh", "i32", aligned=True),
        Param("stride_qot", "i32", aligned=True),
        Param("stride_qoh", "i32", aligned=True),
        Param("stride_kot", "i32", aligned=True),
        Param("stride_koh", "i32", aligned=True),
        Param("stride_cos", "i32", aligned=True),
    ),
    grid=("T", "1", "1"),
    type_vars=("act",),
    semantics=("NUM_Q_HEADS", "NUM_KV_HEADS", "HEAD_DIM"),
    tiles=("BLOCK_H", "BLOCK_D"),
    reference=_reference_call,
    default_config=_default_config,
    # Token strides of the q/k inputs (views into a fused qkv output, or separate tensors); the
    # outputs are assumed in place (same strides).
    shape_ints=lambda shape: {
        "stride_qt": shape["q_stride"], "stride_qh": shape["D"], "stride_kt": shape["k_stride"],
        "stride_kh": shape["D"], "stride_qot": shape["q_stride"], "stride_qoh": shape["D"],
        "stride_kot": shape["k_stride"], "stride_koh": shape["D"], "stride_cos": shape["D"] // 2,
    },
    static_shape=("Hq", "Hkv", "D"),
)


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_out: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
    launcher: Launcher | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] (in place when q_out/k_out are q/k)."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    if q.stride(-1) != 1 or k.stride(-1) != 1 or k.shape[0] != t or k.shape[2] != d:
        raise ValueError("q/k must be [T, H, D] with contiguous head dim and matching T, D")
    if cos.shape[1] * 2 != d or cos.stride(1) != 1 or sin.stride() != cos.stride():
        raise ValueError(f"cos/sin tables must be [P, {d // 2}] with matching strides")
    q_out = torch.empty_like(q) if q_out is None else q_out
    k_out = torch.empty_like(k) if k_out is None else k_out
    pos = positions.to(device=q.device, dtype=torch.int32).contiguous()
    call = KernelCall(
        kernel=KERNEL,
        args={
            "q_ptr": q, "k_ptr": k, "q_out_ptr": q_out, "k_out_ptr": k_out, "pos_ptr": pos,
            "cos_ptr": cos, "sin_ptr": sin,
            "stride_qt": q.stride(0), "stride_qh": q.stride(1), "stride_kt": k.stride(0), "stride_kh": k.stride(1),
            "stride_qot": q_out.stride(0), "stride_qoh": q_out.stride(1),
            "stride_kot": k_out.stride(0), "stride_koh": k_out.stride(1), "stride_cos": cos.stride(0),
        },
        types={"act": triton_type(q.dtype)},
        semantics={"NUM_Q_HEADS": hq, "NUM_KV_HEADS": hkv, "HEAD_DIM": d},
        shape={"T": t, "Hq": hq, "Hkv": hkv, "D": d},
    )
    resolve(launcher, q).run(call)
    return q_out, k_out
