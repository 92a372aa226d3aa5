"""The weights of an engine bundle: the fused and tiled layout the kernels read.

Compile writes it (`lmfoundry.compile.repack`) and the runtime reads it back (a GPU bundle's
`KernelModel`, fusing and tiling copied weights at load; a GPU bundle served on a CPU, un-tiled
and un-fused again): both sides take the layout from here, so neither imports the other.
  - fusion (`fuse_members`): q/k/v (and gate/up) tensors are concatenated along the output
    dimension into `...self_attn.qkv_proj.*` (`...mlp.gate_up_proj.*`), so the runtime loads one
    weight per fused GEMM. Concatenation is valid for every stored form because each is row-major
    in the output dim: packed weights (packed along K), scales, packed zero points (whole int32
    rows per member, checked when the fusion was decided), and biases. Per-tensor scales are
    expanded to per-channel.
  - tiling (`tile_layer`): every W4A16/W8A16 linear (fused or not) is rewritten into the tiled
    layout of `lmfoundry.kernels.tiled_layout` (`*.tiled_weight`, `*.tiled_scale`, ...): panels
    of fragment-ordered codes, scales and zero points N-contiguous per group, act-order resolved
    into a K permutation. Where compile decided it (fusion `ACT_ORDER_FOLD`), down_proj's
    permutation is applied to the output rows of gate/up, so its input arrives already permuted.
`unrepack_bundle` inverts both exactly (tested), so a bundle keeps the checkpoint's information
bit for bit.
"""

from __future__ import annotations

from typing import Callable

import torch

from lmfoundry.checkpoint.folder import split_fused_tensor
from lmfoundry.kernels.tiled_layout import TiledLinear, act_order_perm, repack_tiled, unrepack_tiled
from lmfoundry.kernels.w4a16 import PackedLinear
from lmfoundry.model.config import FUSED_LINEARS

# the fusion that moves down_proj's act-order permutation into gate/up's rows (a KernelBuild fusion name)
ACT_ORDER_FOLD = "mlp.down_proj.input_perm"
_CONCAT = ("weight_packed", "weight", "weight_scale", "weight_zero_point", "bias")
_SHARED = ("weight_g_idx", "input_scale")  # identical across members when fused (checked)


def fuse_members(
    members: list[str], rows: list[int], get: Callable[[str], torch.Tensor], has: Callable[[str], bool]
) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The stored tensors of one fused GEMM (local suffix -> tensor) from its members' tensors, and
    the member tensor names consumed. The one definition of the fused layout: `repack` writes it
    at compile time, the runtime builds it at load from a bundle whose weights were copied."""
    out: dict[str, torch.Tensor] = {}
    consumed: set[str] = set()
    for suffix in _CONCAT:
        names = [f"{m}.{suffix}" for m in members]
        if not all(has(n) for n in names):
            continue
        parts = [get(n) for n in names]
        if suffix == "weight_scale" and all(p.numel() == 1 for p in parts):
            parts = [p.reshape(1, 1).expand(r, 1) for p, r in zip(parts, rows, strict=True)]
        out[suffix] = torch.cat(parts, dim=0).contiguous()
        consumed.update(names)
    for suffix in _SHARED:
        names = [f"{m}.{suffix}" for m in members]
        if all(has(n) for n in names):
            out[suffix] = get(names[0]).contiguous()
            consumed.update(names)
    shape_names = [f"{m}.weight_shape" for m in members]
    if all(has(n) for n in shape_names):
        k = int(get(shape_names[0])[1])
        out["weight_shape"] = torch.tensor([sum(rows), k], dtype=torch.int64)
        consumed.update(shape_names)
    return out, consumed


# (bits, group size (0: per channel), in_features) of a W4A16 linear; None for any other format
TileFormat = tuple[int, int, int]
GATE_UP = FUSED_LINEARS["mlp.gate_up_proj"]


def tiled_linear_tensors(tensors: dict[str, torch.Tensor], fmt: TileFormat, out_perm: torch.Tensor | None = None,
                         input_permuted: bool = False) -> dict[str, torch.Tensor]:
    """The tiled tensors (suffix -> tensor) of one stored compressed-tensors linear."""
    bits, group, k = fmt
    w = PackedLinear(tensors["weight_packed"], tensors["weight_scale"], bits, group, k,
                     tensors.get("weight_zero_point"), tensors.get("weight_g_idx"), tensors.get("bias"))
    return repack_tiled(w, out_perm, input_permuted).to_tensors()


def tile_layer(linears: dict[str, dict[str, torch.Tensor]], formats: dict[str, TileFormat | None],
               fold_act_order: bool) -> dict[str, dict[str, torch.Tensor]]:
    """One decoder layer's linears (local name, fused or not -> suffix -> tensor) with every W4A16
    linear in the tiled layout; other linears are returned unchanged. `fold_act_order`: down_proj's
    act-order permutation goes into the rows of gate/up (`ACT_ORDER_FOLD`)."""
    perm = None
    if fold_act_order:
        down = linears["mlp.down_proj"]
        if "tiled_perm" in down:  # already tiled (then gate/up are too, by the same call at compile time)
            perm = down["tiled_perm"].long()
        else:
            _, group, _ = formats["mlp.down_proj"]  # type: ignore[misc]
            perm = act_order_perm(down["weight_g_idx"], group).long()
    out: dict[str, dict[str, torch.Tensor]] = {}
    for local, tensors in linears.items():
        fmt = formats.get(local)
        if fmt is None or "weight_packed" not in tensors:
            out[local] = tensors
            continue
        rows = None
        if perm is not None and local == "mlp.gate_up_proj":
            rows = torch.cat([perm, perm + perm.numel()])  # gate rows, then up rows, both in down's K order
        elif perm is not None and local in GATE_UP:
            rows = perm
        out[local] = tiled_linear_tensors(tensors, fmt, rows, input_permuted=perm is not None and local == "mlp.down_proj")
    return out


def unrepack_bundle(tensors: dict[str, torch.Tensor], fused: dict[str, list[str]],
                    rows_of: Callable[[str], int]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors (compressed-tensors names and layout) from a repacked bundle's:
    tiled linears back to packed codes in their original row and column order (`unrepack_tiled`,
    exact), fused GEMMs split into their members (`fused`: fused prefix -> member prefixes, as
    `repack` records it; `rows_of(member)` its output rows). What serves a GPU bundle on a CPU."""
    out: dict[str, torch.Tensor] = {}
    tiled = sorted({n.rsplit(".", 1)[0] for n in tensors if n.endswith(".tiled_meta")})
    for prefix in tiled:
        part = {n[len(prefix) + 1:]: t for n, t in tensors.items() if n.startswith(prefix + ".tiled_")}
        w = unrepack_tiled(TiledLinear.from_tensors(part))
        stored = {"weight_packed": w.weight_packed, "weight_scale": w.weight_scale,
                  "weight_zero_point": w.weight_zero_point, "weight_g_idx": w.weight_g_idx, "bias": w.bias,
                  "weight_shape": torch.tensor([w.out_features, w.in_features], dtype=torch.int64)}
        out.update({f"{prefix}.{k}": v for k, v in stored.items() if v is not None})
    out.update({n: t for n, t in tensors.items() if not any(n.startswith(p + ".tiled_") for p in tiled)})
    for prefix, members in fused.items():
        leaves = {n[len(prefix) + 1:]: out.pop(n) for n in list(out) if n.startswith(prefix + ".")}
        rows = [rows_of(m) for m in members]
        start = 0
        for member, n in zip(members, rows, strict=True):
            for leaf, t in leaves.items():
                out[f"{member}.{leaf}"] = split_fused_tensor(t, leaf, start, start + n, sum(rows))
            start += n
    return out
