"""Batched LoRA products gathered per row (BGMV, as Punica, S-LoRA and vLLM): every row of a step
carries the slot of its adapter (-1: the base alone), and one pair of kernels adds each row's own
delta to the base linear's output, whatever adapters the batch mixes.

The adapters of one linear site (a linear, or the fused q/k/v or gate/up product of P linears)
are stacked, zero padded to the largest rank R:
- `a` [L, P * R, K]: the A matrices of the P parts, one after another (part p: rows p R ..);
- `bt` [L, R, N]: the B matrices transposed, their columns side by side as the base's output
  lays them out (part p: columns ends[p - 1] .. ends[p]), so a column reads its rank vector from
  one row of every r;
- `ends` [P] int32: each part's last column + 1.
A scale (alpha / r, rsLoRA's alpha / sqrt(r)) is folded into `bt` when the adapter is stacked.

shrink: s[t, j] = sum_k x[t, k] a[rows[t], j, k]  (float32; 0 where rows[t] < 0)
expand: y[t, n] <- y[t, n] + sum_r s[t, p(n) R + r] bt[rows[t], r, n]  (accumulated in float32,
        rounded once to y's dtype; rows with rows[t] < 0 are left as they are)

Both accumulate in float32 in any order, so a kernel and its reference differ within the
γ_K / γ_R bounds of `error_bounds.dot_bound`. The CPU serving path runs the C kernels of
`runtime/cpu/native/lora.c` (same definitions); the references here are one pass per adapter.
"""

from __future__ import annotations

from typing import Mapping

import torch
import triton
import triton.language as tl

from lmfoundry.kernels.dispatch import Launcher, resolve
from lmfoundry.kernels.spec import KernelCall, KernelDef, Param, Support, TileConfig, next_pow2, triton_type

SUPPORT = Support({"dtype": ("float16", "bfloat16", "float32"), "arch": (80, 86, 89, 90)})
MAX_PARTS = 3  # q/k/v


@triton.jit
def lora_shrink_kernel(x_ptr, a_ptr, rows_ptr, s_ptr, K, S, stride_x, stride_al, stride_s,
                       BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    j = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    slot = tl.load(rows_ptr + t)
    live = slot >= 0
    base = a_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_al
    acc = tl.zeros((BLOCK_S,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(x_ptr + t * stride_x + k, mask=(k < K) & live, other=0.0).to(tl.float32)
        tile = tl.load(base + j[:, None] * K + k[None, :], mask=(j < S)[:, None] & (k < K)[None, :] & live,
                       other=0.0).to(tl.float32)
        acc += tl.sum(tile * xk[None, :], axis=1)
    tl.store(s_ptr + t * stride_s + j, acc, mask=j < S)


@triton.jit
def lora_expand_kernel(s_ptr, bt_ptr, rows_ptr, ends_ptr, y_ptr, N, R, stride_s, stride_bl, stride_y,
                       PARTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_R)
    slot = tl.load(rows_ptr + t)
    live = slot >= 0
    part = tl.zeros((BLOCK_N,), dtype=tl.int32)
    for p in tl.static_range(PARTS - 1):
        part += (n >= tl.load(ends_ptr + p)).to(tl.int32)
    cols = (n < N) & live
    mask = (r < R)[:, None] & cols[None, :]
    sv = tl.load(s_ptr + t * stride_s + part[None, :] * R + r[:, None], mask=mask, other=0.0)
    bv = tl.load(bt_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_bl + r[:, None] * N + n[None, :], mask=mask,
                 other=0.0).to(tl.float32)
    delta = tl.sum(sv * bv, axis=0)
    y = tl.load(y_ptr + t * stride_y + n, mask=cols, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * stride_y + n, (y + delta).to(y_ptr.dtype.element_ty), mask=cols)


# ---- PyTorch references ----------------------------------------------------------------------------


def shrink_reference(x: torch.Tensor, a: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """s [T, S] float32 (see module doc), one product per adapter present."""
    s = torch.zeros((x.shape[0], a.shape[1]), dtype=torch.float32, device=x.device)
    for slot in rows.unique().tolist():
        if slot < 0:
            continue
        idx = (rows == slot).nonzero().flatten()
        s[idx] = x[idx].float() @ a[slot].float().t()
    return s


def expand_reference(s: torch.Tensor, bt: torch.Tensor, rows: torch.Tensor, ends: torch.Tensor,
                     y: torch.Tensor) -> None:
    """y += the rows' deltas (see module doc), in place, one product per adapter and part."""
    r = bt.shape[1]
    bounds = [0, *ends.tolist()]
    for slot in rows.unique().tolist():
        if slot < 0:
            continue
        idx = (rows == slot).nonzero().flatten()
        for p in range(len(bounds) - 1):
            lo, hi = bounds[p], bounds[p + 1]
            delta = s[idx, p * r : (p + 1) * r] @ bt[slot, :, lo:hi].float()
            y[idx, lo:hi] = (y[idx, lo:hi].float() + delta).to(y.dtype)


def _shrink_call(call: KernelCall) -> None:
    a = call.args
    t, k, s_cols = call.shape["T"], a["K"], a["S"]
    x = torch.as_strided(a["x_ptr"], (t, k), (a["stride_x"], 1))
    stack = torch.as_strided(a["a_ptr"], (a["a_ptr"].numel() // a["stride_al"], s_cols, k), (a["stride_al"], k, 1))
    out = torch.as_strided(a["s_ptr"], (t, s_cols), (a["stride_s"], 1))
    out.copy_(shrink_reference(x, stack, a["rows_ptr"][:t]))


def _expand_call(call: KernelCall) -> None:
    a = call.args
    t, n, r = call.shape["T"], a["N"], a["R"]
    parts = call.semantics["PARTS"]
    s = torch.as_strided(a["s_ptr"], (t, parts * r), (a["stride_s"], 1))
    bt = torch.as_strided(a["bt_ptr"], (a["bt_ptr"].numel() // a["stride_bl"], r, n), (a["stride_bl"], n, 1))
    y = torch.as_strided(a["y_ptr"], (t, n), (a["stride_y"], 1))
    expand_reference(s, bt, a["rows_ptr"][:t], a["ends_ptr"][:parts], y)


def _shrink_config(shape: Mapping[str, int]) -> TileConfig:
    return TileConfig.make(num_warps=4, num_stages=1, BLOCK_S=min(64, next_pow2(shape["S"])),
                           BLOCK_K=min(128, next_pow2(shape["K"])))


def _expand_config(shape: Mapping[str, int]) -> TileConfig:
    return TileConfig.make(num_warps=4, num_stages=1, BLOCK_N=min(128, next_pow2(shape["N"])),
                           BLOCK_R=next_pow2(shape["R"]))


SHRINK = KernelDef(
    name="lora_shrink",
    fn=lora_shrink_kernel,
    params=(
        Param("x_ptr", "*{act}"), Param("a_ptr", "*{act}"), Param("rows_ptr", "*i32"), Param("s_ptr", "*fp32"),
        Param("K", "i32", aligned=True), Param("S", "i32"), Param("stride_x", "i32", aligned=True),
        Param("stride_al", "i32", aligned=True), Param("stride_s", "i32"),
    ),
    grid=("T", "cdiv(S, BLOCK_S)", "1"),
    type_vars=("act",),
    semantics=(),
    tiles=("BLOCK_S", "BLOCK_K"),
    reference=_shrink_call,
    default_config=_shrink_config,
    shape_ints=lambda shape: {"K": shape["K"], "stride_x": shape["K"], "stride_al": shape["S"] * shape["K"]},
    static_shape=("K", "S"),
    rows="T",
)

EXPAND = KernelDef(
    name="lora_expand",
    fn=lora_expand_kernel,
    params=(
        Param("s_ptr", "*fp32"), Param("bt_ptr", "*{act}"), Param("rows_ptr", "*i32"), Param("ends_ptr", "*i32"),
        Param("y_ptr", "*{act}"), Param("N", "i32", aligned=True), Param("R", "i32"), Param("stride_s", "i32"),
        Param("stride_bl", "i32", aligned=True), Param("stride_y", "i32", aligned=True),
    ),
    grid=("T", "cdiv(N, BLOCK_N)", "1"),
    type_vars=("act",),
    semantics=("PARTS",),
    tiles=("BLOCK_N", "BLOCK_R"),
    reference=_expand_call,
    default_config=_expand_config,
    shape_ints=lambda shape: {"N": shape["N"], "stride_bl": shape["R"] * shape["N"], "stride_y": shape["N"]},
    static_shape=("N", "R"),
    rows="T",
)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, rows: torch.Tensor, out: torch.Tensor | None = None,
                launcher: Launcher | None = None) -> torch.Tensor:
    """s [T, S] float32 for x [T, K], the stack a [L, S, K] and the rows' slots [T] int32."""
    t, k = x.shape
    if x.stride(1) != 1 or not a.is_contiguous() or a.shape[2] != k or rows.shape != (t,):
        raise ValueError(f"lora_shrink: x [T, {k}] with unit column stride, a [L, S, {k}] contiguous, rows [T]")
    s_cols = a.shape[1]
    out = torch.empty((t, s_cols), dtype=torch.float32, device=x.device) if out is None else out
    call = KernelCall(
        kernel=SHRINK,
        args={"x_ptr": x, "a_ptr": a, "rows_ptr": rows, "s_ptr": out, "K": k, "S": s_cols, "stride_x": x.stride(0),
              "stride_al": a.stride(0), "stride_s": out.stride(0)},
        types={"act": triton_type(x.dtype)},
        semantics={},
        shape={"T": t, "K": k, "S": s_cols},
    )
    resolve(launcher, x).run(call)
    return out


def lora_expand(s: torch.Tensor, bt: torch.Tensor, rows: torch.Tensor, ends: torch.Tensor, y: torch.Tensor,
                launcher: Launcher | None = None) -> torch.Tensor:
    """y [T, N] += each row's delta (in place; see module doc); returns y."""
    t, n = y.shape
    parts = ends.shape[0]
    r = bt.shape[1]
    if not 1 <= parts <= MAX_PARTS or s.shape != (t, parts * r) or bt.shape[2] != n or not bt.is_contiguous() \
            or y.stride(1) != 1 or s.stride(1) != 1:
        raise ValueError(f"lora_expand: s [T, P*R], bt [L, R, {n}] contiguous, y [T, {n}], 1 <= P <= {MAX_PARTS}")
    call = KernelCall(
        kernel=EXPAND,
        args={"s_ptr": s, "bt_ptr": bt, "rows_ptr": rows, "ends_ptr": ends, "y_ptr": y, "N": n, "R": r,
              "stride_s": s.stride(0), "stride_bl": bt.stride(0), "stride_y": y.stride(0)},
        types={"act": triton_type(y.dtype)},
        semantics={"PARTS": parts},
        shape={"T": t, "N": n, "R": r},
    )
    resolve(launcher, y).run(call)
    return y
