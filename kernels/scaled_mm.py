"""The Triton kernel shared by the W8A8 (int8) and FP8 (e4m3) GEMM families.

out[m, n] = (sum_k a[m, k] * b[n, k]) * a_scale[m or 0] * b_scale[n or 0] (+ bias[n])

Both operands are 8-bit and row-major along K (compressed-tensors stores weights as [N, K]); int8
accumulates exactly in int32, fp8 in fp32. The scale epilogue runs in fp32 and rounds once to the
output dtype. On Hopper, fp8 wgmma accumulates in reduced precision, so each K tile is promoted to
the fp32 accumulator (`max_num_imprecise_acc=BLOCK_K`), the usual fix for long K.

Small M (decode): two tile options the per-arch tables use. SWAP_AB computes out^T = b a^T, so the
weight tile (BLOCK_N rows) is the MMA's M side and a Hopper wgmma (64 rows per warpgroup) runs
with BLOCK_M = 16 tokens as its N side instead of padding 1-16 tokens to 64 rows. SPLIT_K splits
K over programs per output tile (serially reduced in split order, `kernels.splitk`) so a few
output tiles still fill the SMs; int8 partials stay int32 (exact), fp8 partials fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

import torch
import triton
import triton.language as tl

from lmfoundry.kernels import splitk
from lmfoundry.kernels.error_bounds import U32, TiledAccumulation
from lmfoundry.kernels.spec import KernelCall, KernelDef, Param, TileConfig, triton_type
from lmfoundry.kernels.w8a8_reference import scaled_mm_reference as reference

if TYPE_CHECKING:
    from lmfoundry.kernels.dispatch import Launcher


@triton.jit
def scaled_mm_kernel(
    a_ptr, b_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, out_ptr, ws_ptr, lock_ptr,
    M, N, K, stride_am, stride_bn, stride_om,
    A_PER_TOKEN: tl.constexpr, B_PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, ACC_INT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    splits = splitk.split_count(M, SPLIT_K)
    if pid_s < splits:
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        mask_m = rm < M
        mask_n = rn < N
        ACC: tl.constexpr = tl.int32 if ACC_INT else tl.float32
        if SWAP_AB:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=ACC)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
        k_tiles = tl.cdiv(K, BLOCK_K)
        per_split = tl.cdiv(k_tiles, splits)
        t_lo = pid_s * per_split
        t_hi = tl.minimum(t_lo + per_split, k_tiles)
        for t in range(t_lo, t_hi):
            kk = t * BLOCK_K + rk
            mask_k = kk < K
            a = tl.load(a_ptr + rm[:, None] * stride_am + kk[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            if SWAP_AB:  # acc^T += b a^T: the weight rows are the MMA's M side
                b = tl.load(b_ptr + rn[:, None] * stride_bn + kk[None, :], mask=mask_n[:, None] & mask_k[None, :],
                            other=0.0)
                if ACC_INT:
                    acc = tl.dot(b, tl.trans(a), acc, out_dtype=tl.int32)
                else:
                    acc = tl.dot(b, tl.trans(a), acc, max_num_imprecise_acc=BLOCK_K)
            else:
                b = tl.load(b_ptr + rn[None, :] * stride_bn + kk[:, None], mask=mask_n[None, :] & mask_k[:, None],
                            other=0.0)
                if ACC_INT:
                    acc = tl.dot(a, b, acc, out_dtype=tl.int32)
                else:
                    acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
        if SWAP_AB:
            acc = tl.trans(acc)
        out_mask = mask_m[:, None] & mask_n[None, :]
        if SPLIT_K > 1:
            if splits > 1:
                acc = splitk.serial_split_k(acc, ws_ptr + rm[:, None] * N + rn[None, :], out_mask,
                                            lock_ptr + pid_m * tl.num_programs(1) + pid_n, pid_s, splits)
        if pid_s == splits - 1:
            if A_PER_TOKEN:
                a_s = tl.load(a_scale_ptr + rm, mask=mask_m, other=0.0).to(tl.float32)
            else:
                a_s = tl.load(a_scale_ptr + rm * 0).to(tl.float32)
            if B_PER_CHANNEL:
                b_s = tl.load(b_scale_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)
            else:
                b_s = tl.load(b_scale_ptr + rn * 0).to(tl.float32)
            out = acc.to(tl.float32) * a_s[:, None] * b_s[None, :]
            if HAS_BIAS:
                out += tl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], out.to(out_ptr.dtype.element_ty), mask=out_mask)


PARAMS = (
    Param("a_ptr", "*{a}"),
    Param("b_ptr", "*{a}"),
    Param("a_scale_ptr", "*fp32"),
    Param("b_scale_ptr", "*{bscale}"),
    Param("bias_ptr", "*{out}"),
    Param("out_ptr", "*{out}"),
    Param("ws_ptr", "*{acc}"),  # split-K partial sums [M, N] (int32 for int8, fp32 for fp8)
    Param("lock_ptr", "*i32"),
    Param("M", "i32"),
    Param("N", "i32", aligned=True),
    Param("K", "i32", aligned=True),
    Param("stride_am", "i32", aligned=True),
    Param("stride_bn", "i32", aligned=True),
    Param("stride_om", "i32", aligned=True),
)
SEMANTICS = ("A_PER_TOKEN", "B_PER_CHANNEL", "HAS_BIAS", "ACC_INT")
TILES = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "SWAP_AB")
GRID = ("cdiv(M, BLOCK_M)", "cdiv(N, BLOCK_N)", "SPLIT_K")


def shape_ints(shape: Mapping[str, int]) -> dict[str, int]:
    n, k = shape["N"], shape["K"]
    return {"N": n, "K": k, "stride_am": k, "stride_bn": k, "stride_om": n}


def default_config(shape: Mapping[str, int]) -> TileConfig:
    m = shape.get("M", 64)
    return TileConfig.make(num_warps=4, num_stages=2, BLOCK_M=64 if m > 16 else 16, BLOCK_N=64, BLOCK_K=64,
                           SPLIT_K=1, SWAP_AB=0)


# Hopper's fp8 wgmma keeps about 14 significant bits while it accumulates (DeepSeek-V3 report, §3.3.2):
# truncating, that is a unit roundoff of 2^-13 inside the tensor core, whatever the fp32 declared
# for its accumulator registers.
FP8_MMA_U = 2.0**-13


def fp8_accumulation(config: TileConfig) -> TiledAccumulation:
    """How the kernel sums an fp8 dot product with this tile config: every `tl.dot` above passes
    `max_num_imprecise_acc=BLOCK_K`, so the tensor core sums one BLOCK_K tile from zero in its own
    precision and Triton adds that tile sum to the fp32 accumulator (`acc`); split-K partials meet
    in fp32 (`splitk.serial_split_k`). On Ada (mma.sync, no wgmma) each 32-wide instruction is
    added in fp32, a finer promotion than this bound assumes."""
    return TiledAccumulation(tile_k=config["BLOCK_K"], tile_u=FP8_MMA_U, acc_u=U32, splits=config["SPLIT_K"])


def reference_call(call: KernelCall) -> None:
    a, s = call.args, call.semantics
    m, n, k = a["M"], a["N"], a["K"]
    x = torch.as_strided(a["a_ptr"], (m, k), (a["stride_am"], 1))
    w = torch.as_strided(a["b_ptr"], (n, k), (a["stride_bn"], 1))
    xs = a["a_scale_ptr"].reshape(-1)[: m if s["A_PER_TOKEN"] else 1]
    ws = a["b_scale_ptr"].reshape(-1)[: n if s["B_PER_CHANNEL"] else 1]
    out = torch.as_strided(a["out_ptr"], (m, n), (a["stride_om"], 1))
    out.copy_(reference(x, w, xs, ws, a["bias_ptr"] if s["HAS_BIAS"] else None, out.dtype))


def make_call(
    kernel: KernelDef,
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    *,
    a_per_token: bool,
    b_per_channel: bool,
) -> KernelCall:
    """Scale granularity is stated by the caller (from the scheme), not guessed from sizes: with
    M == 1 a per-token scale has one element too, and must still select the per-token variant."""
    m, k = a.shape
    n = b.shape[0]
    if b.shape[1] != k:
        raise ValueError(f"activation has {k} features, the weight {b.shape[1]}")
    if a.stride(1) != 1 or b.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("operands must be contiguous along K / N")
    a_scale = a_scale.reshape(-1).float().contiguous()
    b_scale = b_scale.reshape(-1).contiguous()
    if a_scale.numel() != (m if a_per_token else 1):
        raise ValueError(f"activation scale has {a_scale.numel()} values for {m} tokens (per_token={a_per_token})")
    if b_scale.numel() != (n if b_per_channel else 1):
        raise ValueError(f"weight scale has {b_scale.numel()} values for {n} channels (per_channel={b_per_channel})")
    acc_dtype = torch.int32 if a.dtype == torch.int8 else torch.float32
    ws, locks = splitk.workspace(m, n, acc_dtype, a.device, b)
    return KernelCall(
        kernel=kernel,
        args={
            "a_ptr": a, "b_ptr": b, "a_scale_ptr": a_scale, "b_scale_ptr": b_scale,
            "bias_ptr": bias if bias is not None else out, "out_ptr": out, "ws_ptr": ws, "lock_ptr": locks,
            "M": m, "N": n, "K": k,
            "stride_am": a.stride(0), "stride_bn": b.stride(0), "stride_om": out.stride(0),
        },
        types={"a": triton_type(a.dtype), "bscale": triton_type(b_scale.dtype), "out": triton_type(out.dtype),
               "acc": triton_type(acc_dtype)},
        semantics={
            "A_PER_TOKEN": a_per_token,
            "B_PER_CHANNEL": b_per_channel,
            "HAS_BIAS": bias is not None,
            "ACC_INT": a.dtype == torch.int8,
        },
        shape={"M": m, "N": n, "K": k},
    )


@dataclass
class ScaledLinear:
    """An 8-bit linear as stored by compressed-tensors (`int-quantized` / `float-quantized`).

    weight [N, K] int8 or float8_e4m3fn; weight_scale [N, 1] (per channel) or [1] (per tensor);
    input_scale: the static per-tensor activation scale, None for dynamic per-token quantization.
    """

    weight: torch.Tensor
    weight_scale: torch.Tensor
    input_scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def per_channel(self) -> bool:
        return self.weight_scale.numel() != 1 or self.out_features == 1


def run_gemm(
    kernel: KernelDef,
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    w: "ScaledLinear",
    out_dtype: torch.dtype,
    out: torch.Tensor | None,
    launcher: "Launcher | None",
) -> torch.Tensor:
    from lmfoundry.kernels.dispatch import resolve

    if out is None:
        out = torch.empty((xq.shape[0], w.out_features), dtype=out_dtype, device=xq.device)
    call = make_call(
        kernel, xq, x_scale, w.weight, w.weight_scale, w.bias, out,
        a_per_token=w.input_scale is None, b_per_channel=w.per_channel,
    )
    resolve(launcher, xq).run(call)
    return out


def run_linear(
    kernel: KernelDef, x: torch.Tensor, w: "ScaledLinear", quant_dtype: torch.dtype, launcher: "Launcher | None"
) -> torch.Tensor:
    """Quantize x per token (or with the static scale), then the scaled GEMM; x [..., K]."""
    from lmfoundry.kernels.norm_quant import rmsnorm_quant

    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    xq, x_scale, _ = rmsnorm_quant(x2, None, quant_dtype=quant_dtype, static_scale=w.input_scale, launcher=launcher)
    assert x_scale is not None, "quantizing returns its scales"
    out = run_gemm(kernel, xq, x_scale, w, x.dtype, None, launcher)
    return out.reshape(*lead, w.out_features)


def gemm_kernel(name: str, hopper_mma: str, mma: str) -> KernelDef:
    """The KernelDef of a scaled GEMM family (W8A8 int8, FP8): one Triton kernel, and the
    tensor-core instruction the SASS check expects — wgmma (`hopper_mma`) when a Hopper tile is
    large enough for a warpgroup, else `mma`."""

    def expect_sass(arch: int, cfg: TileConfig, types: object, sem: object) -> tuple[str, ...]:
        mma_rows = cfg["BLOCK_N"] if dict(cfg.constexprs).get("SWAP_AB") else cfg["BLOCK_M"]
        if arch >= 90 and mma_rows >= 64 and cfg.num_warps >= 4:
            return (hopper_mma,)
        return (mma,)

    return KernelDef(
        name=name,
        fn=scaled_mm_kernel,
        params=PARAMS,
        grid=GRID,
        type_vars=("a", "bscale", "out", "acc"),
        semantics=SEMANTICS,
        tiles=TILES,
        reference=reference_call,
        default_config=default_config,
        expect_sass=expect_sass,
        shape_ints=shape_ints,
        static_shape=("N", "K"),
        rows="M",
    )


class CodeFamily:
    """One 8-bit code type's entry points over the shared kernel (W8A8: int8, FP8: e4m3): the
    GEMM on codes already quantized, the linear that quantizes x first, and the reference. The
    families differ only in their code dtype, kernel name and tensor-core instructions."""

    def __init__(self, kernel: KernelDef, code: torch.dtype) -> None:
        self.kernel = kernel
        self.code = code

    def reference(self, xq: torch.Tensor, x_scale: torch.Tensor, w: ScaledLinear,
                  out_dtype: torch.dtype) -> torch.Tensor:
        """Exact dot products of the codes (int32 for int8, float64 for e4m3), then
        acc * x_scale[m] * w_scale[n] (+ bias) in fp32."""
        return reference(xq, w.weight, x_scale, w.weight_scale, w.bias, out_dtype)

    def gemm(self, xq: torch.Tensor, x_scale: torch.Tensor, w: ScaledLinear, out_dtype: torch.dtype,
             out: torch.Tensor | None = None, launcher: "Launcher | None" = None) -> torch.Tensor:
        """out [M, N] from codes xq [M, K] and fp32 scales ([M] per token, or [1] when w is static)."""
        if xq.dtype != self.code or w.weight.dtype != self.code:
            raise TypeError(f"{self.kernel.name} takes {str(self.code).replace('torch.', '')} activations "
                            "and weights")
        return run_gemm(self.kernel, xq, x_scale, w, out_dtype, out, launcher)

    def linear(self, x: torch.Tensor, w: ScaledLinear, launcher: "Launcher | None" = None) -> torch.Tensor:
        """Quantize x [..., K] to the codes per token (or with w.input_scale) and multiply by w."""
        return run_linear(self.kernel, x, w, self.code, launcher)
