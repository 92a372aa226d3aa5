"""What `compile` needs to know about a checkpoint: shapes, per-linear quantization schemes, KV cache
scheme, dtype, and which tensors exist — read from config.json and safetensors headers only (no
weights are loaded, so a config-only folder is a valid input).

Schemes follow compressed-tensors' `quantization_config`: `config_groups` with `targets` (module
class "Linear", exact names, or "re:" regexes matched from the start of the module name), `weights`
and `input_activations` quantization args, a top-level or per-group `format`, and `ignore`.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmfoundry.errors import UserError
from lmfoundry.runtime.config import ModelConfig

LAYER_LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


@dataclass(frozen=True)
class LinearScheme:
    """How one linear is stored and which kernel family runs it."""

    kind: str  # "w4a16" (int weight-only, 4 or 8 bits), "w8a8", "fp8", "dense"
    bits: int | None = None
    group_size: int | None = None  # 0 = per channel (also per tensor for 8-bit weights)
    symmetric: bool = True
    actorder: bool = False
    weight_strategy: str | None = None  # group | channel | tensor
    input_strategy: str | None = None  # token | tensor (None: weight-only)
    input_dynamic: bool | None = None

    def describe(self) -> str:
        if self.kind == "dense":
            return "dense"
        if self.kind == "w4a16":
            g = "channel" if not self.group_size else f"g{self.group_size}"
            return f"W{self.bits}A16 {g} {'sym' if self.symmetric else 'asym'}{' actorder' if self.actorder else ''}"
        return f"{self.kind.upper()} w:{self.weight_strategy} a:{self.input_strategy}{' dynamic' if self.input_dynamic else ' static'}"


@dataclass(frozen=True)
class KVScheme:
    dtype: str  # "auto" (model dtype), "int8", "fp8"
    strategy: str = "tensor"  # tensor | head


@dataclass
class Checkpoint:
    path: Path
    config: ModelConfig
    dtype: str  # float16 | bfloat16 (activations and kernels)
    schemes: dict[str, LinearScheme]  # full module name -> scheme
    kv: KVScheme
    tensors: dict[str, tuple[str, tuple[int, ...]]]  # name -> (safetensors dtype, shape)
    tensor_files: dict[str, str]  # name -> file name
    config_sha256: str
    quant_format: str | None
    raw_quant: dict[str, Any] = field(default_factory=dict)

    def linear_names(self) -> list[str]:
        names = [f"model.layers.{i}.{local}" for i in range(self.config.num_layers) for local in LAYER_LINEARS]
        return names + ["lm_head"]

    def shape_of(self, name: str) -> tuple[int, int]:
        """(out_features, in_features) of a linear."""
        if name == "lm_head":
            return self.config.vocab_size, self.config.hidden_size
        local = name.split(".", 3)[3]
        return self.config.linear_shapes[local]

    def scale_dtype(self, name: str) -> str:
        """dtype of a linear's weight_scale (the model dtype when the tensors are not present)."""
        entry = self.tensors.get(f"{name}.weight_scale")
        return _SAFETENSORS_DTYPES.get(entry[0], self.dtype) if entry else self.dtype

    def has_weights(self) -> bool:
        return bool(self.tensors)


_SAFETENSORS_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "I8": "int8", "I32": "int32",
                       "I64": "int64", "F8_E4M3": "float8_e4m3fn"}


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a .safetensors file (tensor names, dtypes, shapes) without its data."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > 100_000_000:
            raise UserError(f"{path}: implausible safetensors header ({size} bytes)")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def _target_matches(target: str, name: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == "Linear" or target == name or name.endswith("." + target)


def _scheme_from_group(group: dict[str, Any], fmt: str | None, where: str) -> LinearScheme:
    w = group.get("weights") or {}
    a = group.get("input_activations")
    fmt = group.get("format") or fmt
    bits = int(w.get("num_bits", 8))
    wtype = w.get("type", "int")
    strategy = w.get("strategy", "tensor")
    symmetric = bool(w.get("symmetric", True))
    actorder = w.get("actorder") not in (None, False, "static", "none")
    group_size = int(w.get("group_size") or 0) if strategy == "group" else 0
    if wtype == "int" and a is None:
        if fmt not in (None, "pack-quantized"):
            raise UserError(f"{where}: weight-only int format {fmt!r} is not supported (expected pack-quantized)")
        if bits not in (4, 8):
            raise UserError(f"{where}: {bits}-bit weights are not supported by the kernels (4 or 8 bits)")
        if strategy not in ("group", "channel"):
            raise UserError(f"{where}: weight strategy {strategy!r} not supported for W{bits}A16 (group or channel)")
        return LinearScheme("w4a16", bits, group_size, symmetric, actorder, strategy)
    if a is None:
        raise UserError(f"{where}: float weight-only quantization (no input_activations) is not supported; "
                        "use FP8 with dynamic per-token activations")
    atype = a.get("type", "int")
    astrategy = a.get("strategy", "tensor")
    dynamic = bool(a.get("dynamic", False))
    if astrategy not in ("token", "tensor"):
        raise UserError(f"{where}: activation strategy {astrategy!r} not supported (token or tensor)")
    if strategy not in ("channel", "tensor"):
        raise UserError(f"{where}: weight strategy {strategy!r} not supported for 8-bit activations (channel or tensor)")
    if not symmetric or not a.get("symmetric", True):
        raise UserError(f"{where}: asymmetric 8-bit weights/activations are not supported")
    if wtype == "int" and atype == "int" and bits == 8 and int(a.get("num_bits", 8)) == 8:
        return LinearScheme("w8a8", 8, 0, True, False, strategy, astrategy, dynamic)
    if wtype == "float" and atype == "float" and bits == 8:
        return LinearScheme("fp8", 8, 0, True, False, strategy, astrategy, dynamic)
    raise UserError(f"{where}: unsupported scheme weights {wtype}{bits} / activations {atype}{a.get('num_bits')}")


def load_checkpoint(path: str | Path, dtype: str | None = None) -> Checkpoint:
    """Read a Hugging Face folder (quantized or float) into a `Checkpoint` (raises UserError)."""
    folder = Path(path)
    if not folder.exists():
        raise UserError(f"{folder}: no such checkpoint folder")
    if not folder.is_dir():
        raise UserError(f"{folder}: not a folder (expected a Hugging Face checkpoint folder)")
    config = ModelConfig.from_file(folder)
    cfg_bytes = (folder / "config.json").read_bytes()
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    files: dict[str, str] = {}
    for f in sorted(folder.glob("*.safetensors")):
        for name, meta in read_safetensors_header(f).items():
            tensors[name] = (meta["dtype"], tuple(meta["shape"]))
            files[name] = f.name
    model_dtype = config.torch_dtype
    if dtype is None:
        dtype = model_dtype if model_dtype in ("float16", "bfloat16") else "bfloat16"
    if dtype not in ("float16", "bfloat16"):
        raise UserError(f"kernel dtype must be float16 or bfloat16, got {dtype!r}")

    q = config.raw.get("quantization_config") or config.raw.get("compression_config") or {}
    if q and q.get("quant_method") not in ("compressed-tensors", None):
        raise UserError(f"{folder}: quant_method {q.get('quant_method')!r} is not supported (compressed-tensors)")
    fmt = q.get("format")
    groups = q.get("config_groups") or {}
    ignore = list(q.get("ignore") or [])
    ckpt = Checkpoint(folder, config, dtype, {}, KVScheme("auto"), tensors, files,
                      hashlib.sha256(cfg_bytes).hexdigest(), fmt, dict(q))
    for name in ckpt.linear_names():
        scheme = LinearScheme("dense")
        if not any(_target_matches(t, name) for t in ignore):
            for gname, group in groups.items():
                if any(_target_matches(t, name) for t in group.get("targets") or []):
                    scheme = _scheme_from_group(group, fmt, f"{folder.name}: config group {gname}")
                    break
        if scheme.kind == "w4a16" and scheme.group_size:
            n, k = ckpt.shape_of(name)
            if k % scheme.group_size:
                raise UserError(
                    f"{name}: group size {scheme.group_size} does not divide its {k} input features; "
                    f"requantize with a group size that divides {k} (e.g. 64) or per-channel"
                )
        ckpt.schemes[name] = scheme
    kv = q.get("kv_cache_scheme")
    if kv:
        kv_type, kv_bits = kv.get("type", "float"), int(kv.get("num_bits", 8))
        if kv_bits != 8:
            raise UserError(f"{folder.name}: {kv_bits}-bit KV cache is not supported (int8 or fp8)")
        ckpt.kv = KVScheme("fp8" if kv_type == "float" else "int8", kv.get("strategy", "tensor"))
    return ckpt
