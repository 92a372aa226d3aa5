"""The on-disk checkpoint: a Hugging Face folder in the compressed-tensors format.

Writing: `CheckpointWriter` builds the folder in a temporary sibling and renames it into place at
the end, so an interrupted run never leaves a folder that looks complete. Tensors are written one
shard per decoder layer as the layer-wise pipeline produces them (memory stays at one layer).

Reading: `CheckpointReader` memory-maps the shards and hands out tensors by name; `decode_linear`
turns the stored tensors of one linear back into a `QuantizedWeight` (or a float weight).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lmfoundry.checkpoint.sources import safetensors_files
from lmfoundry.errors import UserError, disk_full
from lmfoundry.manifest import MANIFEST, hash_folder
from lmfoundry.quantformat.int32_packing import WIDTHS, unpack_int32
from lmfoundry.quantformat.quantized_weight import QuantizedWeight
from lmfoundry.quantformat.scheme import QuantizationPlan, Scheme, plan_from_compressed_tensors, to_compressed_tensors

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "chat_template.jinja", "generation_config.json", "vocab.json", "merges.txt", "added_tokens.json",
)


# --------------------------------------------------------------------------------------- encode
def encode_linear(name: str, qw: QuantizedWeight, scheme: Scheme) -> dict[str, torch.Tensor]:
    """Stored tensors of one quantized linear (`name` is the full module name)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    fmt = scheme.format
    out: dict[str, torch.Tensor] = {f"{name}.weight_scale": qw.scale.contiguous()}
    if fmt == "pack-quantized":
        bits = qw.args.num_bits
        out[f"{name}.weight_packed"] = pack_to_int32(qw.q.to(torch.int8), bits)
        out[f"{name}.weight_shape"] = torch.tensor(list(qw.q.shape), dtype=torch.int64)
        if qw.zero_point is not None:
            out[f"{name}.weight_zero_point"] = pack_to_int32(qw.zero_point.to(torch.int8), bits, packed_dim=0)
    else:
        out[f"{name}.weight"] = qw.q.contiguous()
        if qw.zero_point is not None:
            out[f"{name}.weight_zero_point"] = qw.zero_point.contiguous()
    if qw.g_idx is not None:
        out[f"{name}.weight_g_idx"] = qw.g_idx.to(torch.int32).contiguous()
    return out


def _library_unpack(packed: torch.Tensor, bits: int, shape: tuple[int, ...] | torch.Size, dim: int = 1) -> torch.Tensor:
    """compressed-tensors' own reader, for the code widths whose layout differs between its
    releases (3, 5, 6, 7 bits): the installed library reads what the installed library wrote."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    return unpack_from_int32(packed, bits, torch.Size(shape), packed_dim=dim)  # type: ignore[arg-type]


def decode_linear(tensors: dict[str, torch.Tensor], scheme: Scheme) -> QuantizedWeight:
    """Inverse of `encode_linear`; `tensors` uses local names (weight_packed, weight_scale, ...)."""
    args = scheme.weights
    scale = tensors["weight_scale"]
    zp = tensors.get("weight_zero_point")
    if "weight_packed" in tensors:
        shape = torch.Size(tensors["weight_shape"].tolist())
        unpack = unpack_int32 if args.num_bits in WIDTHS else _library_unpack
        q = unpack(tensors["weight_packed"], args.num_bits, shape)
        if zp is not None:
            zp = unpack(zp, args.num_bits, (shape[0], scale.shape[-1]), dim=0)
    elif "weight" in tensors:
        q = tensors["weight"]
    else:
        raise UserError(f"quantized linear is missing weight_packed/weight (has {sorted(tensors)})")
    g_idx = tensors.get("weight_g_idx")
    return QuantizedWeight(q, scale, zp, args, g_idx.long() if g_idx is not None else None,
                           input_scale=tensors.get("input_scale"))


# --------------------------------------------------------------------------------------- write
class CheckpointWriter:
    """Builds an output folder atomically. Use as a context manager; call `finish()` last."""

    def __init__(self, out_dir: str | os.PathLike, overwrite: bool = False, work: Path | None = None) -> None:
        """`work`: the folder to build in (kept as it is on entry: a resumed run's shards are
        there); default: a fresh `.NAME.partial-PID` beside `out_dir`."""
        self.out_dir = Path(out_dir).resolve()
        if self.out_dir.exists() and any(self.out_dir.iterdir()) and not overwrite:
            raise UserError(f"{self.out_dir} exists and is not empty (pass --overwrite to replace it)")
        self.keep_work = work is not None
        self.tmp = Path(work) if work is not None else self.out_dir.with_name(f".{self.out_dir.name}.partial-{os.getpid()}")
        self.weight_map: dict[str, str] = {}
        self.total_bytes = 0

    def __enter__(self) -> "CheckpointWriter":
        if not self.keep_work:
            shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True, exist_ok=self.keep_work)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.tmp.exists():  # not finished: leave nothing behind
            shutil.rmtree(self.tmp, ignore_errors=True)

    def write_shard(self, filename: str, tensors: dict[str, torch.Tensor]) -> None:
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        try:
            save_file(tensors, str(self.tmp / filename), metadata={"format": "pt"})
        except Exception as exc:  # noqa: BLE001 - safetensors says "disk full" with its own error type
            if not disk_full(exc):
                raise
            need = sum(t.numel() * t.element_size() for t in tensors.values())
            raise UserError(f"{self.tmp / filename}: no space left on the device writing {need / 2**20:.1f} MiB "
                            f"of {self.out_dir.name} ({self.total_bytes / 2**20:.1f} MiB written before); nothing "
                            "was kept") from None
        for k, v in tensors.items():
            self.weight_map[k] = filename
            self.total_bytes += v.numel() * v.element_size()

    def copy_files(self, src: Path, names: Iterable[str]) -> None:
        for n in names:
            if (src / n).is_file():
                shutil.copy2(src / n, self.tmp / n)

    def write_json(self, name: str, data: dict[str, Any]) -> None:
        (self.tmp / name).write_text(json.dumps(data, indent=2, default=str) + "\n")

    def finish(self, config: dict[str, Any], manifest: dict[str, Any]) -> Path:
        self.write_json("config.json", config)
        self.write_json("model.safetensors.index.json",
                        {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(self.weight_map.items()))})
        manifest["files"] = hash_folder(self.tmp)
        self.write_json(MANIFEST, manifest)
        if self.out_dir.exists():
            shutil.rmtree(self.out_dir)
        os.replace(self.tmp, self.out_dir)
        return self.out_dir


def quantized_config(source_config: dict[str, Any], plan: QuantizationPlan, dtype: torch.dtype) -> dict[str, Any]:
    cfg = dict(source_config)
    cfg["quantization_config"] = to_compressed_tensors(plan)
    if plan.scheme_for("lm_head") is not None and cfg.get("tie_word_embeddings"):
        cfg["tie_word_embeddings"] = False  # the quantized head is stored apart from the embedding
    cfg["torch_dtype"] = str(dtype).replace("torch.", "")
    cfg.pop("dtype", None)
    return cfg


# --------------------------------------------------------------------------------------- read
class CheckpointReader:
    """Lazy access to a model folder's tensors (safetensors memory maps, opened per request).

    The shard list comes from the folder's index (or its *.safetensors files) with every path kept
    inside the folder and every shard a regular file (`safetensors_files`), and every shard's
    header is checked against its size (`read_safetensors_header`), so an index naming `../x`, an
    absolute path or a symlink out, a FIFO, or a truncated or lying header is one `UserError`
    before any tensor is mapped."""

    def __init__(self, folder: str | os.PathLike) -> None:
        from lmfoundry.checkpoint.headers import read_safetensors_header, regular_file

        self.folder = Path(folder)
        config_path = self.folder / "config.json"
        regular_file(config_path, "config.json")
        try:
            self.config = json.loads(config_path.read_bytes())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UserError(f"{config_path}: not valid JSON ({exc})") from None
        if not isinstance(self.config, dict):
            raise UserError(f"{config_path}: must be a JSON object")
        qcfg = self.config.get("quantization_config")
        self.plan: QuantizationPlan | None = plan_from_compressed_tensors(qcfg) if qcfg else None
        self.files = safetensors_files(self.folder)
        self.index: dict[str, Path] = {}
        for f in self.files:
            for k in sorted(read_safetensors_header(f)):  # the order safe_open lists them in
                self.index[k] = f
        # fused checkpoint tensors (Phi-3's qkv_proj, gate_up_proj) seen as their linears' parts
        self.virtual: dict[str, tuple[str, int, int, int]] = _split_fused_names(self.index, self.config)
        for name, (fused, *_rows) in self.virtual.items():
            self.index[name] = self.index[fused]
        for fused in {v[0] for v in self.virtual.values()}:
            del self.index[fused]
        # tensors an architecture names otherwise (Mixtral's block_sparse_moe.experts.E.w1) under ours
        self.stored: dict[str, str] = _renamed_names(self.index, self.config)
        for ours, stored in self.stored.items():
            self.index[ours] = self.index.pop(stored)

    @property
    def dtype(self) -> torch.dtype:
        name = self.config.get("torch_dtype") or self.config.get("dtype") or "float32"
        return getattr(torch, str(name).replace("torch.", ""))

    def has(self, name: str) -> bool:
        return name in self.index

    def get(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """Load the named tensors, opening each shard once and closing it afterwards (so its
        pages leave the resident set)."""
        by_file: dict[Path, list[str]] = {}
        for n in names:
            if n not in self.index:
                raise UserError(f"{self.folder}: tensor {n} not found in the checkpoint")
            by_file.setdefault(self.index[n], []).append(n)
        out = {}
        for f, keys in by_file.items():
            with safe_open(str(f), "pt") as st:
                fused: dict[str, torch.Tensor] = {}
                for k in keys:
                    if k in self.virtual:
                        source, start, end, rows = self.virtual[k]
                        if source not in fused:
                            fused[source] = st.get_tensor(source)
                        out[k] = split_fused_tensor(fused[source], k.rsplit(".", 1)[1], start, end, rows)
                    else:
                        out[k] = st.get_tensor(self.stored.get(k, k))
        return out

    def prefixed(self, prefix: str) -> dict[str, torch.Tensor]:
        """All tensors under `prefix.` with the prefix stripped."""
        names = [k for k in self.index if k.startswith(prefix + ".")]
        return {k[len(prefix) + 1 :]: v for k, v in self.get(names).items()}


class InMemoryCheckpoint(CheckpointReader):
    """A checkpoint whose tensors are already in memory (a repacked engine bundle turned back into
    compressed-tensors form), read through the `CheckpointReader` interface."""

    def __init__(self, folder: str | os.PathLike, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        self.folder = Path(folder)
        self.config = config
        qcfg = config.get("quantization_config")
        self.plan = plan_from_compressed_tensors(qcfg) if qcfg else None
        self.files = []
        self.index = {k: self.folder for k in tensors}
        self.virtual, self.stored = {}, {}
        self.tensors = tensors

    def get(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        out = {}
        for n in names:
            if n not in self.tensors:
                raise UserError(f"{self.folder}: tensor {n} not found in the checkpoint")
            out[n] = self.tensors[n]
        return out


# ------------------------------------------------------------------ fused checkpoint tensors
# Leaves of a fused linear shared by all its parts rather than split by rows.
_SHARED_LEAVES = ("weight_g_idx", "input_scale")


def _model_config(config: dict[str, Any]) -> Any:
    """The `ModelConfig` of a checkpoint's config.json, or None for a model we do not run (the
    caller's own checks say why)."""
    from lmfoundry.model.config import ModelConfig

    try:
        return ModelConfig.from_dict(config)
    except (UserError, KeyError, TypeError, ValueError):
        return None


def _renamed_names(index: dict[str, Path], config: dict[str, Any]) -> dict[str, str]:
    """Our name -> the stored name, for every tensor the architecture names otherwise."""
    model = _model_config(config)
    if model is None or not model.checkpoint_renames:
        return {}
    return {ours: name for name in index if (ours := model.our_name(name)) != name}


def checkpoint_names(tensors: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """Tensors in our naming as `config`'s architecture stores them: fused where it stores linears
    fused (Phi-3), renamed where it names them otherwise (Mixtral)."""
    tensors = fuse_checkpoint_linears(tensors, config.checkpoint_fused)
    if not config.checkpoint_renames:
        return tensors
    return {config.stored_name(k): v for k, v in tensors.items()}


def _split_fused_names(index: dict[str, Path], config: dict[str, Any]) -> dict[str, tuple[str, int, int, int]]:
    """Virtual name -> (fused tensor name, first row, end row, rows of the fused linear) for every
    tensor of a fused linear in a checkpoint whose architecture stores them fused."""
    model = _model_config(config)
    if model is None:
        return {}
    fused_map = model.checkpoint_fused
    if not fused_map:
        return {}
    shapes = model.linear_shapes
    out: dict[str, tuple[str, int, int, int]] = {}
    for name in index:
        for fused, members in fused_map.items():
            marker = f".{fused}."
            if marker not in name:
                continue
            prefix, leaf = name.split(marker, 1)
            rows = sum(shapes[m][0] for m in members)
            start = 0
            for m in members:
                end = start + shapes[m][0]
                out[f"{prefix}.{m}.{leaf}"] = (name, start, end, rows)
                start = end
    return out


def split_fused_tensor(t: torch.Tensor, leaf: str, start: int, end: int, rows: int) -> torch.Tensor:
    """Rows [start, end) of one tensor of a fused linear (scales, codes, biases; zero points
    packed 8 rows per int32 are sliced in packed rows)."""
    if leaf in _SHARED_LEAVES or t.numel() == 1:
        return t
    if leaf == "weight_shape":
        return torch.tensor([end - start, int(t[1])], dtype=t.dtype)
    per = rows // t.shape[0] if t.shape[0] and rows % t.shape[0] == 0 else 0
    if not per or start % per or end % per:
        raise UserError(f"fused tensor {leaf} with {t.shape[0]} rows cannot be split at rows {start}:{end} of {rows}")
    return t[start // per:end // per].clone()


def fuse_checkpoint_linears(tensors: dict[str, torch.Tensor], fused_map: dict[str, tuple[str, ...]]
                            ) -> dict[str, torch.Tensor]:
    """Join the tensors of linears a checkpoint stores fused (`ModelConfig.checkpoint_fused`):
    rows concatenated (zero points packed along rows too), shapes summed, and what the parts
    share (g_idx, static input scales, per-tensor scales) kept once, refused if the parts differ."""
    if not fused_map:
        return tensors
    out = dict(tensors)
    for fused, members in fused_map.items():
        groups: dict[tuple[str, str], list[str]] = {}
        for name in tensors:
            for m in members:
                marker = f".{m}."
                if marker in name:
                    prefix, leaf = name.split(marker, 1)
                    groups.setdefault((prefix, leaf), []).append(name)
        for (prefix, leaf), names in groups.items():
            parts = [f"{prefix}.{m}.{leaf}" for m in members]
            if sorted(names) != sorted(parts):
                raise UserError(f"{prefix}: {fused} is stored fused, but {leaf} exists for only "
                                f"{', '.join(n.split('.')[-2] for n in names)}; give its linears one scheme")
            values = [out.pop(n) for n in parts]
            if leaf in _SHARED_LEAVES or all(v.numel() == 1 for v in values):
                if any(not torch.equal(v, values[0]) for v in values[1:]):
                    raise UserError(f"{prefix}.{fused}: its parts have different {leaf}; a fused checkpoint "
                                    "holds one (use per-channel or group scales, and no dynamic act-order)")
                joined = values[0]
            elif leaf == "weight_shape":
                joined = torch.tensor([sum(int(v[0]) for v in values), int(values[0][1])], dtype=values[0].dtype)
            else:
                joined = torch.cat(values, dim=0)
            out[f"{prefix}.{fused}.{leaf}"] = joined
    return out
