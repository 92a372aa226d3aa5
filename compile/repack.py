"""Write the checkpoint's tensors with the compile-time GEMM fusions applied (`--weights repack`).

q/k/v (and gate/up) tensors are concatenated along the output dimension into
`...self_attn.qkv_proj.*` (`...mlp.gate_up_proj.*`), so the runtime loads one weight per fused GEMM.
Concatenation is valid for every stored form because each is row-major in the output dim:
packed weights (packed along K), scales, packed zero points (whole int32 rows per member — checked
when the fusion was decided), and biases. Per-tensor scales are expanded to per-channel first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from lmfoundry.compile.checkpoint import Checkpoint
from lmfoundry.compile.plan import Plan
from lmfoundry.model.config import FUSED_LINEARS

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
            parts = [p.reshape(1, 1).expand(r, 1) for p, r in zip(parts, rows)]
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


def repack(ck: Checkpoint, plan: Plan, dest: Path) -> dict[str, list[str]]:
    """Write all tensors (fused where planned) to `dest`; returns fused name -> member names."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    applied = {f.name for f in plan.fusions if f.kind == "concat_gemm" and f.applied}
    handles = {name: safe_open(ck.path / name, framework="pt") for name in set(ck.tensor_files.values())}

    def get(name: str) -> torch.Tensor:
        return handles[ck.tensor_files[name]].get_tensor(name)

    out: dict[str, torch.Tensor] = {}
    consumed: set[str] = set()
    fused_record: dict[str, list[str]] = {}
    for i in range(ck.config.num_layers):
        for fused in applied:
            members = [f"model.layers.{i}.{m}" for m in FUSED_LINEARS[fused]]
            target = f"model.layers.{i}.{fused}"
            fused_record[target] = members
            rows = [ck.shape_of(m)[0] for m in members]
            tensors, used = fuse_members(members, rows, get, lambda n: n in ck.tensors)
            out.update({f"{target}.{suffix}": t for suffix, t in tensors.items()})
            consumed.update(used)
    for name in ck.tensors:
        if name not in consumed:
            out[name] = get(name).contiguous()
    save_file(out, str(dest), metadata={"format": "pt", "lmfoundry_repacked": "1"})
    return fused_record
