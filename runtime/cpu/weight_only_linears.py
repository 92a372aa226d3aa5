"""Weight-only quantized linears that stay packed on CPU: PyTorch's own int4pack / int8pack kernels.

The runtime module swap for W4A16-style (integer codes of at most 4 bits) and W8A16 (8-bit codes,
one scale per output channel) weights when the model runs in bfloat16. A dense dequantized copy
would make the quantized artifact as large and as slow as the float model; these keep the codes:

- `Int4PackLinear`: codes in `_convert_weight_to_int4pack_for_cpu`'s layout (blocks of output
  channels whose width depends on the CPU capability, see `int4_layout`: half a byte a weight)
  plus one (scale, zero) pair in bf16 per group and channel.
  The kernel computes w = (u - 8) * scale + zero with u in [0, 15]; compressed-tensors' signed codes
  q and zero points zp map onto it as u = q + 8, zero = -zp * scale. Channel/tensor scales become
  groups of the largest size the kernel takes (32, 64, 128, 256) that divides K, the scale repeated;
  GPTQ act-order (g_idx) becomes a K permutation applied to the codes once here and to the input
  of every call (as compile folds it for the GPU).
- `Int8PackLinear`: int8 codes [N, K] and per-channel scales for `_weight_int8pack_mm`; an
  asymmetric zero point is the exact correction y -= (zp * s) * sum_k x_k.

- `CProductLinear`: at the serving swap, where the CPU has AVX-512 BF16, both modules' codes move
  into the layout of our C products (`lmfoundry.runtime.cpu.native.int4_gemm`, `int8_gemm`), which widen
  16 channels' codes once per block of 8 rows instead of once per row; q/k/v and gate/up become one
  product each. Above a crossover timed on the serving machine (`runtime.cpu.crossover`: on AMX
  CPUs a long prompt chunk is faster as one dequantization plus an AMX GEMM) it dequantizes.

PyTorch's eager kernels cost a fixed time per input row (a GEMV each), so from `dense_from` rows on
(prefill, perplexity windows) the layer is dequantized from the same packed codes into a transient
bf16 matrix for one AMX/AVX512 GEMM instead. Serving times that crossover on its own machine for
every quantized linear it keeps, C product or not (`runtime.cpu.crossover`); other callers take
`DEQUANT_ROWS`, a default (benchmarks/cpu_packed.py prints both paths). Nothing dense is kept
between calls. Traced for
`compile --arch cpu`, the op stays whole: one GEMM serves every size (with AMX Inductor's C++ WOQ
template where autotuning picks it, else ATen's int4 kernel: `compile.cpu_step.gemm_backends`).

`packed_linear` returns the module or the reason the codes do not fit a kernel (the caller then
keeps the dequantized dense linear and says so).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lmfoundry.model.config import FUSED_LINEARS
from lmfoundry.quantformat.quantized_weight import QuantizedWeight
from lmfoundry.runtime.cpu.dense_linears import PrepackedPart
from lmfoundry.runtime.cpu.features import onednn_bf16
from lmfoundry.runtime.cpu.native.int4_gemm import Int4Gemm, Int4Weight, load_int4_gemm
from lmfoundry.runtime.cpu.native.int4_gemm import fits as int4_gemm_fits
from lmfoundry.runtime.cpu.native.int4_gemm import pack as pack_int4
from lmfoundry.runtime.cpu.native.int8_gemm import Int8Gemm, Int8Weight, load_int8_gemm
from lmfoundry.runtime.cpu.native.int8_gemm import dequantize as int8_dequantize
from lmfoundry.runtime.cpu.native.int8_gemm import fits as int8_gemm_fits
from lmfoundry.runtime.cpu.native.int8_gemm import pack as pack_int8

INT4_GROUPS = (256, 128, 64, 32)  # the group sizes _weight_int4pack_mm_for_cpu accepts
DEQUANT_ROWS = 128  # dense_from where no crossover was measured (serving measures its own)
COMPUTE_DTYPE = torch.bfloat16  # the kernels' vectorized paths (their fp32 paths are scalar)


@lru_cache(maxsize=1)
def int4_layout() -> tuple[int, bool]:
    """(output channels per block, whether a byte pairs neighbouring channels) of this machine's
    int4pack layout. PyTorch packs for the CPU capability it dispatches to: [N/w, K, w/2] bytes,
    byte j of a block row holding channels j and j + w/2 (w = 64 on AVX-512, 32 on AVX2), or
    channels 2j and 2j + 1 (w = 32, the portable kernel). Probed once on a tiny matrix rather than
    inferred from flags, so a capability forced by ATEN_CPU_CAPABILITY or a layout PyTorch changes
    cannot silently scramble the dequantized weight."""
    n, k = 128, 2
    codes = (torch.arange(n * k, dtype=torch.int32) * 7 % 16).reshape(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1).reshape(-1)
    for width in (64, 32, 16, 8, 4, 2):
        v = packed.view(n // width, k, width // 2)
        nibbles = torch.stack([v & 15, v >> 4], -1).int()  # [N/w, K, w/2, (low, high)]
        for paired in (False, True):
            blocked = (nibbles if paired else nibbles.transpose(-1, -2)).reshape(n // width, k, width)
            if torch.equal(blocked.permute(0, 2, 1).reshape(n, k), codes):
                return width, paired
    raise RuntimeError("unknown int4pack layout of this PyTorch build")


def _nibble_lut() -> torch.Tensor:
    """[256, 2] bf16: the two codes (low nibble, high nibble) of a packed byte, minus 8."""
    b = torch.arange(256)
    return (torch.stack([b & 15, b >> 4], -1) - 8).to(COMPUTE_DTYPE)


_LUT = _nibble_lut()


def _dequantize_first(x: torch.Tensor, rows: int | None = DEQUANT_ROWS) -> bool:
    """Eager: whether this many rows run faster as dequantize-then-GEMM (never with `rows` None:
    the deterministic mode keeps every row on the per-row kernel, whose result for a row does not
    depend on the rows beside it). Traced (`compile --arch cpu`): never, the op stays one node
    that one GEMM of the package serves at every size."""
    return rows is not None and not torch.compiler.is_compiling() and x.shape[0] >= rows


def _gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w for the dequantize-then-GEMM path, bf16 in and out: oneDNN's bf16 GEMM where the CPU
    has bf16 arithmetic, else float32 BLAS on widened copies (oneDNN emulates bf16 several times
    slower there; widening is exact, and both accumulate in float32 and round once)."""
    if onednn_bf16():
        return torch.matmul(x, w)
    return torch.matmul(x.float(), w.float()).to(x.dtype)


def _kernel_group(k: int, group: int | None) -> int | None:
    """The kernel group size serving a stored group of `group` columns (None: one per channel)."""
    if group is None:
        return next((g for g in INT4_GROUPS if k % g == 0), None)
    if k % group:
        return None
    return next((g for g in INT4_GROUPS if group % g == 0), None)


def _act_order_perm(g_idx: torch.Tensor, group: int, k: int) -> torch.Tensor | str | None:
    """The K order that makes act-order groups contiguous (None: already in order)."""
    counts = torch.bincount(g_idx, minlength=k // group)
    if counts.numel() != k // group or bool((counts != group).any()):
        return "g_idx does not assign exactly group_size columns to every group"
    perm = torch.argsort(g_idx, stable=True)
    return None if bool((perm == torch.arange(k)).all()) else perm


class Int4PackLinear(nn.Module):
    """A linear whose weight is 4-bit codes in PyTorch's CPU int4pack layout (see module doc)."""

    packed: torch.Tensor
    scale_zeros: torch.Tensor
    perm: torch.Tensor | None
    bias: torch.Tensor | None
    # from this many rows the product is dequantize-then-GEMM; None: always the per-row kernel
    # (`make_batch_invariant`). Serving sets it from a crossover measured on its machine
    # (`runtime.cpu.crossover`); DEQUANT_ROWS elsewhere (perplexity windows, calibration).
    dense_from: int | None = DEQUANT_ROWS

    def __init__(self, packed: torch.Tensor, scale_zeros: torch.Tensor, group: int, in_features: int,
                 out_features: int, perm: torch.Tensor | None, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.register_buffer("packed", packed)  # uint8 [N, K/2]
        self.register_buffer("scale_zeros", scale_zeros)  # bf16 [K/group, N, 2]
        self.register_buffer("perm", perm)  # int64 [K] or None
        self.register_buffer("bias", bias)

    @classmethod
    def from_quantized(cls, qw: QuantizedWeight, bias: torch.Tensor | None) -> "Int4PackLinear | str":
        args = qw.args
        n, k = qw.q.shape
        if args.type != "int" or args.num_bits > 4:
            return f"int4pack holds integer codes of at most 4 bits, not {args.describe()}"
        if n % 16:
            return f"int4pack needs a multiple of 16 output channels, got {n}"
        stored_group = args.group_size if args.strategy == "group" else None
        group = _kernel_group(k, stored_group)
        if group is None:
            return f"no int4pack group size (32/64/128/256) fits {args.describe()} over {k} input features"
        codes, scale, zp = qw.q, qw.scale.float(), qw.zero_point
        perm = None
        if qw.g_idx is not None and stored_group is not None:
            got = _act_order_perm(qw.g_idx.long(), stored_group, k)
            if isinstance(got, str):
                return got
            perm = got
        elif qw.g_idx is not None:
            return "g_idx without group quantization"
        if perm is not None:
            codes = codes[:, perm]
        groups = k // group
        scale = scale.reshape(n if scale.numel() > 1 else 1, -1).expand(n, -1)
        scale = scale.repeat_interleave(groups // scale.shape[1], dim=1)  # [N, K/group]
        zero = torch.zeros_like(scale)
        if zp is not None:
            zpf = zp.float().reshape(n if zp.numel() > 1 else 1, -1).expand(n, -1)
            zero = -zpf.repeat_interleave(groups // zpf.shape[1], dim=1) * scale
        unsigned = (codes.to(torch.int32) + 8).contiguous()
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, 1)
        scale_zeros = torch.stack([scale.t(), zero.t()], -1).to(COMPUTE_DTYPE).contiguous()
        return cls(packed, scale_zeros, group, k, n, perm,
                   None if bias is None else bias.to(COMPUTE_DTYPE))

    @property
    def shape(self) -> tuple[str, int, int, int, bool]:
        """(kind, out_features, in_features, group, act-order): what the crossover is measured for."""
        return "int4pack", self.out_features, self.in_features, self.group, self.perm is not None

    def dequantized_weight(self) -> torch.Tensor:
        """The bf16 weight [N, K] in the input order of the stored checkpoint."""
        w = self._blocked_weight().permute(1, 0, 2).reshape(self.in_features, self.out_features).t()
        if self.perm is not None:
            w = w[:, torch.argsort(self.perm)]
        return w.contiguous()

    def _blocked_weight(self) -> torch.Tensor:
        """bf16 [N/w, K, w] from the packed codes (w from `int4_layout()`): block b, column j holds
        channel w b + j."""
        n, k, g = self.out_features, self.in_features, self.group
        width, paired = int4_layout()
        codes = F.embedding(self.packed.view(n // width, k, width // 2).int(), _LUT)  # [N/w, K, w/2, 2]
        codes = (codes if paired else codes.transpose(-1, -2)).reshape(n // width, k // g, g, width)
        sz = self.scale_zeros.view(k // g, n // width, width, 2).permute(1, 0, 2, 3)
        w = torch.addcmul(sz[..., 1].unsqueeze(2), codes, sz[..., 0].unsqueeze(2))
        return w.reshape(n // width, k, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape[:-1], x.dtype
        x2 = x.reshape(-1, self.in_features)
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        x2 = x2.to(COMPUTE_DTYPE)
        if _dequantize_first(x2, self.dense_from) and self.out_features % int4_layout()[0] == 0:
            y = _gemm(x2, self._blocked_weight()).transpose(0, 1).reshape(-1, self.out_features)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.contiguous(), self.packed, self.group,
                                                           self.scale_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.to(dtype).reshape(*shape, self.out_features)

    def extra_repr(self) -> str:
        act = ", act-order" if self.perm is not None else ""
        return f"in={self.in_features}, out={self.out_features}, int4pack g{self.group}{act}"


class Int8PackLinear(nn.Module):
    """A linear whose weight is int8 codes with one scale per output channel (see module doc)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero_scaled: torch.Tensor | None
    bias: torch.Tensor | None
    dense_from: int | None = DEQUANT_ROWS  # as Int4PackLinear's

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero_scaled: torch.Tensor | None,
                 bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.register_buffer("codes", codes)  # int8 [N, K]
        self.register_buffer("scale", scale)  # bf16 [N]
        self.register_buffer("zero_scaled", zero_scaled)  # fp32 [N]: zp * s, or None
        self.register_buffer("bias", bias)

    @classmethod
    def from_quantized(cls, qw: QuantizedWeight, bias: torch.Tensor | None) -> "Int8PackLinear | str":
        args = qw.args
        n = qw.q.shape[0]
        if args.type != "int" or args.strategy not in ("channel", "tensor"):
            return f"int8pack takes one scale per output channel, not {args.describe()}"
        if qw.g_idx is not None:
            return "g_idx without group quantization"
        scale = qw.scale.float().reshape(-1).expand(n)
        zero_scaled = None
        if qw.zero_point is not None:
            zero_scaled = (qw.zero_point.float().reshape(-1).expand(n) * scale).contiguous()
        return cls(qw.q.to(torch.int8).contiguous(), scale.to(COMPUTE_DTYPE).contiguous(), zero_scaled,
                   None if bias is None else bias.to(COMPUTE_DTYPE))

    @property
    def shape(self) -> tuple[str, int, int, int, bool]:
        """(kind, out_features, in_features, group, asymmetric): what the crossover is measured for."""
        return "int8pack", self.out_features, self.in_features, self.in_features, self.zero_scaled is not None

    def dequantized_weight(self) -> torch.Tensor:
        w = self.codes.float() * self.scale.float()[:, None]
        if self.zero_scaled is not None:
            w = w - self.zero_scaled[:, None]
        return w.to(COMPUTE_DTYPE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape[:-1], x.dtype
        x2 = x.reshape(-1, self.in_features).to(COMPUTE_DTYPE)
        if _dequantize_first(x2, self.dense_from):
            y = _gemm(x2, (self.codes.to(COMPUTE_DTYPE) * self.scale[:, None]).t())
        else:
            y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.codes, self.scale)
        if self.zero_scaled is not None:
            y = (y.float() - x2.float().sum(-1, keepdim=True) * self.zero_scaled).to(COMPUTE_DTYPE)
        if self.bias is not None:
            y = y + self.bias
        return y.to(dtype).reshape(*shape, self.out_features)

    def extra_repr(self) -> str:
        zp = ", zero points" if self.zero_scaled is not None else ""
        return f"in={self.in_features}, out={self.out_features}, int8pack per-channel{zp}"


class CProductLinear(nn.Module):
    """A weight-only quantized linear served by one of our C products (CPUs with AVX-512 BF16):
    `int4_gemm` for 4-bit codes, `int8_gemm` for per-channel int8. PyTorch's int4pack / int8pack
    kernels read the whole weight once per input row; ours widen 16 channels' codes to bf16 once per
    block of 8 rows, so a step of many rows costs little more than a step of one, and no dense copy
    is kept. Every row's result is the same whatever the number of rows, so a token computes alike
    in a prompt chunk and in a decode step.

    Built from `Int4PackLinear`s or `Int8PackLinear`s (one, or several concatenated along the
    outputs: q/k/v and gate/up, whose parts `parts` hands back) at the serving-time swap
    (`prepack_c_products`); the traced `compile --arch cpu` step keeps PyTorch's ops. From
    `dense_from` rows on (set by the runtime from a crossover measured on the serving machine,
    `runtime.cpu.crossover`; None: never) a step dequantizes and runs the CPU's own GEMM instead."""

    perm: torch.Tensor | None
    bias: torch.Tensor | None
    dense_from: int | None = None

    def __init__(self, linears: Sequence[Int4PackLinear | Int8PackLinear]) -> None:
        super().__init__()
        first = linears[0]
        self.in_features: int = first.in_features
        self.sizes: list[int] = [lin.out_features for lin in linears]
        self.out_features = sum(self.sizes)
        self.gemm: Int4Gemm | Int8Gemm
        self.weight_c: Int4Weight | Int8Weight
        fours = [lin for lin in linears if isinstance(lin, Int4PackLinear)]
        eights = [lin for lin in linears if isinstance(lin, Int8PackLinear)]
        perm = None
        if fours:
            gemm4 = load_int4_gemm()
            assert gemm4 is not None and len(fours) == len(linears)
            self.kind, self.group, self.gemm = "int4", fours[0].group, gemm4
            codes, scale, zero = zip(*(_int4pack_codes(lin) for lin in fours), strict=True)
            self.weight_c = pack_int4(torch.cat(codes), torch.cat(scale), _zeros_or_none(zero, scale), self.group)
            perm = fours[0].perm
        else:
            gemm8 = load_int8_gemm()
            assert gemm8 is not None and len(eights) == len(linears)
            self.kind, self.group, self.gemm = "int8", self.in_features, gemm8
            scales = [lin.scale.float() for lin in eights]
            self.weight_c = pack_int8(torch.cat([lin.codes for lin in eights]), torch.cat(scales),
                                      _zeros_or_none([lin.zero_scaled for lin in eights], scales))
        self.register_buffer("perm", perm)
        biases = [(lin.bias, lin.out_features) for lin in linears]
        self.register_buffer("bias", None if first.bias is None else torch.cat(
            [b if b is not None else torch.zeros(n, dtype=COMPUTE_DTYPE) for b, n in biases]))

    @staticmethod
    def fits(linears: Sequence[object]) -> bool:
        """Whether these linears can be one C product: all int4pack over one input (same size, group
        and act-order permutation) or all per-channel int8pack over one input, each with a bias or
        none with one, and the product built here."""
        fours = [lin for lin in linears if isinstance(lin, Int4PackLinear)]
        eights = [lin for lin in linears if isinstance(lin, Int8PackLinear)]
        if fours and len(fours) == len(linears):
            a = fours[0]
            return load_int4_gemm() is not None and all(
                # the codes are read back from whole int4pack blocks (`_int4pack_codes`)
                int4_gemm_fits(lin.out_features, lin.in_features, lin.group) and lin.out_features % int4_layout()[0] == 0
                and (lin.in_features, lin.group, lin.bias is None) == (a.in_features, a.group, a.bias is None)
                and (lin.perm is None if a.perm is None else lin.perm is not None and torch.equal(lin.perm, a.perm))
                for lin in fours)
        if eights and len(eights) == len(linears):
            b = eights[0]
            return load_int8_gemm() is not None and all(
                int8_gemm_fits(lin.out_features, lin.in_features)
                and (lin.in_features, lin.bias is None) == (b.in_features, b.bias is None) for lin in eights)
        return False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape[:-1], x.dtype
        rows = x.reshape(-1, self.in_features)
        if self.perm is not None:
            rows = rows.index_select(1, self.perm)
        rows = rows.to(COMPUTE_DTYPE)
        rows = rows if rows.stride(1) == 1 else rows.contiguous()
        if self.dense_from is not None and rows.shape[0] >= self.dense_from:
            out = F.linear(rows, self._dense_weight(), self.bias)
        else:
            out = rows.new_empty(rows.shape[0], self.out_features)
            self.gemm(rows, self.weight_c, self.bias, out)  # type: ignore[arg-type]
        return out.to(dtype).view(*shape, self.out_features)

    def _dense_weight(self) -> torch.Tensor:
        """The bf16 weight [N, K] in the product's K order (transient: dropped after the step)."""
        if isinstance(self.weight_c, Int4Weight):
            return self.gemm.dequantize(self.weight_c)  # type: ignore[union-attr]
        return int8_dequantize(self.weight_c).to(COMPUTE_DTYPE)

    def parts(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each fused linear's output [..., out_i]: views of the one product."""
        return self(x).split(self.sizes, dim=-1)

    @property
    def shape(self) -> tuple[str, int, int, int, bool]:
        """(kind, out_features, in_features, group, asymmetric): what the crossover is measured for."""
        zero = self.weight_c.zero if isinstance(self.weight_c, Int4Weight) else self.weight_c.zero_scaled
        return self.kind, self.out_features, self.in_features, self.group, zero is not None

    def dequantized_weight(self) -> torch.Tensor:
        """The bf16 weight [N, K] in the stored checkpoint's input order."""
        w = self._dense_weight()
        return w if self.perm is None else w[:, torch.argsort(self.perm)].contiguous()

    @property
    def weight(self) -> torch.Tensor:
        return self.dequantized_weight()

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # the packed weight is plain tensors outside the buffer registry: move them along
        w = self.weight_c
        for name in ("codes", "scale", "zero", "zero_scaled"):
            if getattr(w, name, None) is not None:
                setattr(w, name, fn(getattr(w, name)))
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        act = ", act-order" if self.perm is not None else ""
        fused = f", fused {self.sizes}" if len(self.sizes) > 1 else ""
        scheme = f"int4 g{self.group}" if self.kind == "int4" else "int8 per-channel"
        return f"in={self.in_features}, out={self.out_features}, {scheme} C product{act}{fused}"


def _zeros_or_none(zeros: Sequence[torch.Tensor | None], like: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The fused linears' zero terms concatenated (zeros where a linear has none), or None when none has."""
    if all(z is None for z in zeros):
        return None
    return torch.cat([torch.zeros_like(s) if z is None else z.float() for z, s in zip(zeros, like, strict=True)])


def _int4pack_codes(lin: Int4PackLinear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(unsigned codes [N, K] in the linear's K order, scale [N, K/g], zero [N, K/g] or None for
    symmetric codes) read back from PyTorch's int4pack layout (exact: bf16 scales widen exactly)."""
    n, k = lin.out_features, lin.in_features
    width, paired = int4_layout()
    v = lin.packed.view(n // width, k, width // 2)
    nibbles = torch.stack([v & 15, v >> 4], -1)  # [N/w, K, w/2, 2]
    blocked = (nibbles if paired else nibbles.transpose(-1, -2)).reshape(n // width, k, width)
    codes = blocked.permute(0, 2, 1).reshape(n, k)
    scale = lin.scale_zeros[..., 0].t().float().contiguous()
    zero = lin.scale_zeros[..., 1].t().float().contiguous()
    return codes, scale, None if not bool(zero.any()) else zero


def prepack_c_products(model: nn.Module, fuse: bool = False) -> int:
    """Swap every `Int4PackLinear` / `Int8PackLinear` of a CPU model for a `CProductLinear` where
    our C product is built (the runtime module swap for serving; PyTorch's packed buffers are
    dropped); returns how many. With `fuse`, q/k/v and gate/up become one product each where they
    fit (`CProductLinear.fits`), their linears left in place as parts. Nothing happens where the
    products are not built (no AVX-512 BF16, no compiler, native kernels off)."""
    swapped = 0
    if fuse:
        for parent in list(model.modules()):
            for group, members in FUSED_LINEARS.items():
                attr, names = group.rsplit(".", 1)[-1], [m.rsplit(".", 1)[-1] for m in members]
                if not hasattr(parent, attr) or getattr(parent, attr) is not None:
                    continue
                linears = [getattr(parent, name, None) for name in names]
                if not CProductLinear.fits(linears):
                    continue
                whole = CProductLinear(linears)  # type: ignore[arg-type]
                setattr(parent, attr, whole)
                for i, name in enumerate(names):
                    setattr(parent, name, PrepackedPart(whole, i))  # type: ignore[arg-type]
                swapped += len(names)
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if isinstance(child, (Int4PackLinear, Int8PackLinear)) and CProductLinear.fits([child])]
    for parent, name, child in swaps:
        setattr(parent, name, CProductLinear([child]))
    return swapped + len(swaps)


def packed_linear(qw: QuantizedWeight, bias: torch.Tensor | None) -> nn.Module | str:
    """The packed CPU module of a weight-only integer linear, or why its codes fit no kernel."""
    if qw.args.type != "int":
        return f"{qw.args.describe()} weights have no packed weight-only CPU kernel"
    if qw.args.num_bits <= 4:
        return Int4PackLinear.from_quantized(qw, bias)
    return Int8PackLinear.from_quantized(qw, bias)
