"""Write the checkpoint's tensors in the layout the engine's kernels read (`--weights repack`):
fused where the kernel selection fused, W4A16 tiled, as `lmfoundry.engine_bundle.weight_layout` defines them
(the runtime reads the same layout back from there)."""

from __future__ import annotations

from pathlib import Path

import torch

from lmfoundry.compile.kernel_selection import KernelBuild
from lmfoundry.compile.source import Checkpoint
from lmfoundry.engine_bundle.weight_layout import (
    ACT_ORDER_FOLD,
    TileFormat,
    fuse_members,
    tile_layer,
    tiled_linear_tensors,
)
from lmfoundry.model.config import FUSED_LINEARS, LAYER_LINEARS


def repack(ck: Checkpoint, build: KernelBuild, dest: Path) -> dict[str, list[str]]:
    """Write all tensors (fused where planned, W4A16 tiled) to `dest`; returns fused name -> member names."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    applied = {f.name for f in build.fusions if f.kind == "concat_gemm" and f.applied}
    fold = any(f.name == ACT_ORDER_FOLD and f.applied for f in build.fusions)
    handles = {name: safe_open(ck.path / name, framework="pt") for name in set(ck.tensor_files.values())}

    def get(name: str) -> torch.Tensor:
        return handles[ck.tensor_files[name]].get_tensor(name)

    def fmt_of(full: str) -> TileFormat | None:
        s = ck.schemes.get(full)
        if s is None or s.kind != "w4a16":
            return None
        return s.bits, s.group_size or 0, ck.shape_of(full)[1]  # type: ignore[return-value]

    def stored(prefix: str) -> dict[str, torch.Tensor]:
        return {n[len(prefix) + 1:]: get(n) for n in ck.tensors if n.startswith(prefix + ".")}

    out: dict[str, torch.Tensor] = {}
    consumed: set[str] = set()
    fused_record: dict[str, list[str]] = {}
    for i in range(ck.config.num_layers):
        pre = f"model.layers.{i}"
        linears: dict[str, dict[str, torch.Tensor]] = {}
        formats: dict[str, TileFormat | None] = {}
        for local in FUSED_LINEARS:
            members = [f"{pre}.{m}" for m in FUSED_LINEARS[local]]
            if local in applied:
                fused_record[f"{pre}.{local}"] = members
                rows = [ck.shape_of(m)[0] for m in members]
                linears[local], used = fuse_members(members, rows, get, lambda n: n in ck.tensors)
                consumed.update(used)
                formats[local] = fmt_of(members[0])
        for local in LAYER_LINEARS:
            if any(local in FUSED_LINEARS[f] for f in applied):
                continue
            linears[local] = stored(f"{pre}.{local}")
            formats[local] = fmt_of(f"{pre}.{local}")
        for local, tensors in tile_layer(linears, formats, fold).items():
            if formats.get(local) is None:
                continue  # not W4A16: written below as stored (or as fused above)
            consumed.update(f"{pre}.{local}.{suffix}" for suffix in linears[local])
            out.update({f"{pre}.{local}.{suffix}": t for suffix, t in tensors.items()})
        for local in applied:
            if formats.get(local) is None:
                out.update({f"{pre}.{local}.{suffix}": t for suffix, t in linears[local].items()})
    head = fmt_of("lm_head")
    if head is not None and "lm_head.weight_packed" in ck.tensors:
        head_tensors = stored("lm_head")
        consumed.update(f"lm_head.{suffix}" for suffix in head_tensors)
        out.update({f"lm_head.{suffix}": t for suffix, t in tiled_linear_tensors(head_tensors, head).items()})
    for name in ck.tensors:
        if name not in consumed:
            out[name] = get(name).contiguous()
    # one metadata key: safetensors writes metadata from a hash map whose order changes from process
    # to process, so a second key would make rebuilds differ byte for byte (engine.json records the mode)
    save_file(out, str(dest), metadata={"format": "pt"})
    return fused_record
