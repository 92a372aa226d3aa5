"""The tiled W4A16 / W8A16 layout (`TiledLinear`): how `lmfoundry compile` repacks a
compressed-tensors `PackedLinear` for the tiled kernel (`w4a16_tiled.py`), and back.

Kept apart from the kernel so that the code that writes the layout (compile), the code that reads
it on a CPU (the runtime's un-tiling of a GPU bundle) and the kernel share one definition, with no
Triton in the way of either. The layout:
  * codes are stored in panels of 128 rows x (16 int32 words) — 128 k for 4 bits, 64 for 8 — so a
    program's tile of one panel is one contiguous 8 KiB block, and a split-K range is a sequential
    stream; N is padded to 128 and K to the panel, so weight loads need no masks;
  * inside a panel row, word w holds k = 32p + 2w + h in its code p + h*(PACK/2) (p < PACK/2, h < 2):
    one shift and mask of a word gives a *pair* of codes in the two 16-bit halves (see the kernel);
  * act-order (`weight_g_idx`) is resolved here: K is permuted so groups are contiguous (`perm`);
  * scales [groups, N] and zero points (int8, z - 2^(b-1)) are stored N-contiguous per group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from lmfoundry.kernels.w4a16 import SUPPORT, PackedLinear
from lmfoundry.quantformat.int32_packing import unsigned_codes

TILE_N = 128  # rows per panel; N is padded to a multiple (BLOCK_N must divide it)
TILE_WORDS = 16  # int32 words per row of a panel: 128 k of 4-bit codes, 64 k of 8-bit codes
PLANE_K = 32  # k per MMA operand plane (one shift of a panel's words)
TILED_FORMAT = 1  # version of the layout, stored in `tiled_meta`


def panel_k(bits: int) -> int:
    """k covered by one panel row of TILE_WORDS words."""
    return TILE_WORDS * (32 // bits)


def pack_codes(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of `quantformat.int32_packing.unsigned_codes`: unsigned codes packed 32/bits per
    int32 along `dim` (compressed-tensors' order: element i of a word at bit (i % per) * bits, the
    last word zero-padded)."""
    per = 32 // bits
    c = (codes if dim == 1 else codes.t()).to(torch.int64)
    pad = (-c.shape[1]) % per
    c = torch.nn.functional.pad(c, (0, pad)).reshape(c.shape[0], -1, per)
    words = (c << (torch.arange(per, device=c.device, dtype=torch.int64) * bits)).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words if dim == 1 else words.t().contiguous()


@dataclass
class TiledLinear:
    """One weight-only linear in the tiled layout (see the module docstring), tensors on one device.

    Stored order: column j of the weight is input feature `perm[j]` (act-order; None: identity),
    row i is output feature `out_perm[i]` (None: identity; set when compile folded a consumer's
    act-order into this producer). `input_permuted`: the producer already emits this linear's input
    in `perm` order, so the op does not permute it. `bias` is in stored (row) order.
    """

    qweight: torch.Tensor  # int32 [N_pad/128, K_pad/panel_k, 128, 16]
    scale: torch.Tensor  # [groups_pad, N_pad] in the checkpoint's scale dtype
    bits: int
    group_size: int  # 0 = per channel
    in_features: int
    out_features: int
    zero: torch.Tensor | None = None  # int8 [groups_pad, N_pad]: zero code - 2^(bits-1)
    perm: torch.Tensor | None = None  # int32 [K]
    out_perm: torch.Tensor | None = None  # int32 [N]
    input_permuted: bool = False
    bias: torch.Tensor | None = None

    SUFFIXES = ("tiled_weight", "tiled_scale", "tiled_zero", "tiled_perm", "tiled_out_perm", "tiled_bias", "tiled_meta")

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors a bundle stores for this linear (suffix -> tensor)."""
        meta = [TILED_FORMAT, self.bits, self.group_size, self.in_features, self.out_features, int(self.input_permuted)]
        out = {"tiled_weight": self.qweight, "tiled_scale": self.scale,
               "tiled_meta": torch.tensor(meta, dtype=torch.int64)}
        for key, t in (("tiled_zero", self.zero), ("tiled_perm", self.perm), ("tiled_out_perm", self.out_perm),
                       ("tiled_bias", self.bias)):
            if t is not None:
                out[key] = t
        return out

    @classmethod
    def from_tensors(cls, t: Mapping[str, torch.Tensor]) -> "TiledLinear":
        fmt, bits, group, k, n, permuted = (int(v) for v in t["tiled_meta"].tolist())
        if fmt != TILED_FORMAT:
            raise ValueError(f"tiled layout version {fmt}, this lmfoundry reads {TILED_FORMAT}: rebuild the bundle")
        return cls(t["tiled_weight"], t["tiled_scale"], bits, group, k, n, t.get("tiled_zero"), t.get("tiled_perm"),
                   t.get("tiled_out_perm"), bool(permuted), t.get("tiled_bias"))

    def to(self, device: torch.device | str) -> "TiledLinear":
        def move(v: torch.Tensor) -> torch.Tensor:
            return v.to(device).contiguous()

        def maybe(v: torch.Tensor | None) -> torch.Tensor | None:
            return None if v is None else move(v)

        return TiledLinear(move(self.qweight), move(self.scale), self.bits, self.group_size, self.in_features,
                           self.out_features, maybe(self.zero), maybe(self.perm), maybe(self.out_perm),
                           self.input_permuted, maybe(self.bias))

    def nbytes(self) -> int:
        parts = (self.qweight, self.scale, self.zero, self.perm, self.out_perm, self.bias)
        return sum(v.numel() * v.element_size() for v in parts if v is not None)

    def codes(self) -> torch.Tensor:
        """Unsigned codes [N, K] in stored order (int32)."""
        return tiled_codes(self.qweight, self.bits, self.out_features, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """[N, K] weight in stored order, in the scale dtype: (q - zp) * scale, as the checkpoint defines it."""
        return tiled_dequantize(self.qweight, self.scale, self.zero, self.bits, self.group_size, self.out_features,
                                self.in_features)


def act_order_perm(g_idx: torch.Tensor, group_size: int) -> torch.Tensor:
    """The column order that makes act-order groups contiguous: a stable sort of g_idx (int32 [K]).

    Refused (ValueError) unless every group then spans exactly `group_size` consecutive columns,
    as GPTQ's act-order writes it (the group of a column is its rank in activation order // g)."""
    k = g_idx.numel()
    perm = torch.sort(g_idx.to(torch.int64), stable=True).indices
    expect = torch.arange(k, device=g_idx.device) // (group_size or k)
    if not torch.equal(g_idx.to(torch.int64)[perm], expect):
        raise ValueError(f"weight_g_idx does not split K={k} into equal groups of {group_size or k}: the tiled "
                         "layout needs GPTQ-style act-order (group = rank in activation order // group size)")
    return perm.to(torch.int32)


def pad_to(n: int, m: int) -> int:
    return -(-n // m) * m


def repack_tiled(w: PackedLinear, out_perm: torch.Tensor | None = None, input_permuted: bool = False) -> TiledLinear:
    """The tiled layout of a compressed-tensors linear (exact: `unrepack_tiled` gives `w` back).

    `out_perm`: reorder the output rows (row i <- output feature out_perm[i]); `input_permuted`: the
    producer of this linear's input applies its act-order permutation (see `TiledLinear`)."""
    bits, n, k = w.bits, w.out_features, w.in_features
    group = w.group_size
    if not SUPPORT.supports(bits=bits, group_size=group) or (group and k % group):
        raise ValueError(f"W{bits} group size {group} with K={k}: the tiled layout takes 4 or 8 bits and group "
                         "sizes 32/64/128 dividing K, or per channel")
    codes = unsigned_codes(w.weight_packed, bits, k, dim=1)  # [N, K] unsigned
    ngroups = k // group if group else 1
    scale = w.weight_scale.reshape(n, -1)
    if scale.shape[1] != ngroups:
        raise ValueError(f"weight_scale has {scale.shape[1]} groups, expected {ngroups} for K={k}, group {group}")
    zero = unsigned_codes(w.weight_zero_point, bits, n, dim=0)[:, :ngroups] if w.weight_zero_point is not None else None
    perm = None
    if w.weight_g_idx is not None:
        perm = act_order_perm(w.weight_g_idx, group)
        codes = codes[:, perm.long()]
    elif input_permuted:
        raise ValueError("input_permuted without act-order (weight_g_idx)")
    bias = w.bias
    if out_perm is not None:
        rows = out_perm.long()
        codes, scale, bias = codes[rows], scale[rows], None if bias is None else bias[rows]
        zero = None if zero is None else zero[rows]
    n_pad, k_pad = pad_to(n, TILE_N), pad_to(k, panel_k(bits))
    codes = torch.nn.functional.pad(codes, (0, k_pad - k, 0, n_pad - n))
    npair = 16 // bits
    # [N_pad, panels, p, w, h] -> word[n, panel, w] = sum over (p, h) of code << bits * (p + npair * h)
    c = codes.to(torch.int64).reshape(n_pad, k_pad // panel_k(bits), npair, TILE_WORDS, 2)
    shift = (torch.arange(npair, device=c.device)[:, None] + npair * torch.arange(2, device=c.device)[None, :]) * bits
    words = (c << shift[:, None, :]).sum(dim=(2, 4))  # [N_pad, panels, 16]
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    qweight = words.reshape(n_pad // TILE_N, TILE_N, -1, TILE_WORDS).permute(0, 2, 1, 3).contiguous()
    g_pad = k_pad // group if group else 1
    scale_t = torch.zeros(g_pad, n_pad, dtype=scale.dtype, device=scale.device)
    scale_t[:ngroups, :n] = scale.t()
    zero_t = None
    if zero is not None:
        zero_t = torch.zeros(g_pad, n_pad, dtype=torch.int8, device=zero.device)
        zero_t[:ngroups, :n] = (zero - (1 << (bits - 1))).t().to(torch.int8)
    return TiledLinear(qweight, scale_t, bits, group, k, n, zero_t, perm,
                       None if out_perm is None else out_perm.to(torch.int32).contiguous(), input_permuted,
                       None if bias is None else bias.contiguous())


def tiled_codes(qweight: torch.Tensor, bits: int, n: int, k: int) -> torch.Tensor:
    """Unsigned codes [n, k] (int32) of a tiled weight, in stored order."""
    npair = 16 // bits
    words = qweight.permute(0, 2, 1, 3).reshape(qweight.shape[0] * TILE_N, -1, TILE_WORDS).to(torch.int64)
    shift = (torch.arange(npair, device=words.device)[:, None] + npair * torch.arange(2, device=words.device)[None, :]) * bits
    codes = (words[:, :, None, :, None] >> shift[None, None, :, None, :]) & ((1 << bits) - 1)  # [N, panels, p, w, h]
    return codes.reshape(words.shape[0], -1)[:n, :k].to(torch.int32)


def tiled_dequantize(qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int,
                     group_size: int, n: int, k: int) -> torch.Tensor:
    """[n, k] weight of the tiled layout in the scale dtype, (q - zp) * scale (stored order)."""
    q = tiled_codes(qweight, bits, n, k)
    grp = torch.arange(k, device=q.device) // group_size if group_size else torch.zeros(k, dtype=torch.long, device=q.device)
    s = scale[:, :n].t()[:, grp]
    z = (zero[:, :n].t()[:, grp].to(torch.int32) + (1 << (bits - 1))) if zero is not None else 1 << (bits - 1)
    return (q - z).to(scale.dtype) * s


def unrepack_tiled(t: TiledLinear) -> PackedLinear:
    """The compressed-tensors linear a tiled one was made from, bit for bit (original row and
    column order, packed codes and zero points, g_idx rebuilt from the permutation)."""
    n, k, bits, group = t.out_features, t.in_features, t.bits, t.group_size
    codes = t.codes()
    ngroups = k // group if group else 1
    scale = t.scale[:ngroups, :n].t()
    zero = None if t.zero is None else (t.zero[:ngroups, :n].t().to(torch.int32) + (1 << (bits - 1)))
    bias = t.bias
    if t.out_perm is not None:
        inv = torch.empty_like(t.out_perm, dtype=torch.long)
        inv[t.out_perm.long()] = torch.arange(n, device=inv.device)
        codes, scale, bias = codes[inv], scale[inv], None if bias is None else bias[inv]
        zero = None if zero is None else zero[inv]
    g_idx = None
    if t.perm is not None:
        inv = torch.empty(k, dtype=torch.long, device=codes.device)
        inv[t.perm.long()] = torch.arange(k, device=codes.device)
        codes = codes[:, inv]
        g_idx = torch.empty(k, dtype=torch.int32, device=codes.device)
        g_idx[t.perm.long()] = (torch.arange(k, device=codes.device) // (group or k)).to(torch.int32)
    return PackedLinear(pack_codes(codes, bits, dim=1), scale.contiguous(), bits, group, k,
                        None if zero is None else pack_codes(zero, bits, dim=0), g_idx,
                        None if bias is None else bias.contiguous())
