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
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmfoundry.errors import UserError
from lmfoundry.manifest import contained_file
from lmfoundry.models import safetensors_files
from lmfoundry.model.config import LAYER_LINEARS, ModelConfig



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


# bits per element of every dtype the safetensors format knows (what its Rust reader accepts)
SAFETENSORS_DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32,
    "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}
MAX_SAFETENSORS_HEADER = 100_000_000  # the safetensors format's own limit


def regular_file(path: Path, what: str) -> os.stat_result:
    """stat of `path`, refused unless it is a regular file: a FIFO, device or folder named like a
    data file would block or never end when read (`/dev/zero`, a named pipe)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise UserError(f"{path}: {what} is missing") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read {what} ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise UserError(f"{path}: {what} is not a regular file")
    return st


def _bad(path: Path, why: str) -> UserError:
    return UserError(f"{path}: corrupt safetensors file: {why}")


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a .safetensors file (tensor name -> dtype, shape, data_offsets), without
    `__metadata__` and without reading the data — validated against the file the way the
    safetensors reader will check it at load time (header length within the file, known dtypes,
    byte ranges matching dtype x shape, ranges tiling the data section exactly), so a truncated
    download or a lying header is refused here with one line instead of compiling an engine for
    weights that cannot be loaded."""
    size = regular_file(path, "safetensors file").st_size
    if size < 8:
        raise _bad(path, f"{size} bytes, shorter than the 8-byte header length")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > MAX_SAFETENSORS_HEADER:
            raise _bad(path, f"implausible header length ({n} bytes)")
        if n > size - 8:
            raise _bad(path, f"header claims {n} bytes but the file has {size - 8} after the length (truncated?)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise _bad(path, "the header is not JSON") from None
    if not isinstance(header, dict):
        raise _bad(path, "the header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise _bad(path, "__metadata__ must map names to strings")
    data_len = size - 8 - n
    spans = []
    for full_name, t in header.items():
        name = full_name[:80]  # for messages: names come from the file and may be anything
        if not isinstance(t, dict):
            raise _bad(path, f"tensor {name!r} is not an object")
        dtype, shape, offsets = t.get("dtype"), t.get("shape"), t.get("data_offsets")
        if dtype not in SAFETENSORS_DTYPE_BITS:
            raise _bad(path, f"tensor {name!r} has unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise _bad(path, f"tensor {name!r}: shape must be a list of non-negative integers")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise _bad(path, f"tensor {name!r}: data_offsets must be [begin, end] with 0 <= begin <= end")
        bits = SAFETENSORS_DTYPE_BITS[dtype]
        for d in shape:
            bits *= d
        if bits % 8 or offsets[1] - offsets[0] != bits // 8:
            raise _bad(path, f"tensor {name!r}: {dtype} {shape} needs {bits / 8:g} bytes, data_offsets span "
                             f"{offsets[1] - offsets[0]}")
        if offsets[1] > data_len:
            raise _bad(path, f"tensor {name!r} ends at byte {offsets[1]} of a {data_len}-byte data section "
                             "(truncated?)")
        spans.append((offsets[0], offsets[1], name))
    cursor = 0
    for begin, end, name in sorted(spans):
        if begin != cursor:
            what = "overlaps the previous tensor" if begin < cursor else f"leaves a gap at byte {cursor}"
            raise _bad(path, f"tensor {name!r} at data_offsets [{begin}, {end}] {what}")
        cursor = end
    if cursor != data_len:
        raise _bad(path, f"the tensors cover {cursor} of {data_len} data bytes")
    return header


def _mapping(value: Any, where: str) -> dict[str, Any]:
    """`value` if it is a JSON object; a config.json section of another type is the user's file
    being wrong, which must read as one line rather than an AttributeError deep in the parsing."""
    if not isinstance(value, dict):
        raise UserError(f"{where} must be an object, got {type(value).__name__}")
    return value


def _int_field(args: dict[str, Any], key: str, default: int, where: str) -> int:
    """An integer field of quantization args (num_bits, group_size), refused with one line when not a number."""
    value = args.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
        raise UserError(f"{where}: {key} must be an integer, got {value!r}")
    return int(value)


def _target_matches(target: str, name: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == "Linear" or target == name or name.endswith("." + target)


def _scheme_from_group(group: dict[str, Any], fmt: str | None, where: str) -> LinearScheme:
    w = group.get("weights") or {}
    a = group.get("input_activations")
    fmt = group.get("format") or fmt
    bits = _int_field(w, "num_bits", 8, where)
    wtype = w.get("type", "int")
    strategy = w.get("strategy", "tensor")
    symmetric = bool(w.get("symmetric", True))
    actorder = w.get("actorder") not in (None, False, "static", "none")
    group_size = _int_field(w, "group_size", 0, where) if strategy == "group" else 0
    if group_size < 0:
        raise UserError(f"{where}: group_size must be positive, got {group_size}")
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
    if wtype == "int" and atype == "int" and bits == 8 and _int_field(a, "num_bits", 8, where) == 8:
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
    for p in sorted(folder.iterdir()):
        # compile copies or links every file of the folder into the bundle, which may be shipped:
        # a symlink out (tokenizer.json -> ~/.ssh/...) must not carry a file from elsewhere into it
        if p.is_file():
            try:
                contained_file(folder, p.name, hub_cache=True)
            except UserError as exc:
                raise UserError(f"{folder}: {exc}") from None
    for f in safetensors_files(folder):  # index entries kept inside the folder, regular files
        for name, meta in read_safetensors_header(f).items():
            tensors[name] = (meta["dtype"], tuple(meta["shape"]))
            files[name] = f.relative_to(folder).as_posix()
    model_dtype = config.torch_dtype
    if dtype is None:
        dtype = model_dtype if model_dtype in ("float16", "bfloat16") else "bfloat16"
    if dtype not in ("float16", "bfloat16"):
        raise UserError(f"kernel dtype must be float16 or bfloat16, got {dtype!r}")

    q = _mapping(config.raw.get("quantization_config") or config.raw.get("compression_config") or {},
                 f"{folder.name}: quantization_config")
    if q and q.get("quant_method") not in ("compressed-tensors", None):
        raise UserError(f"{folder}: quant_method {q.get('quant_method')!r} is not supported (compressed-tensors)")
    fmt = q.get("format")
    groups = _mapping(q.get("config_groups") or {}, f"{folder.name}: quantization_config.config_groups")
    for gname, group in groups.items():
        where = f"{folder.name}: config group {gname}"
        _mapping(group, where)
        _mapping(group.get("weights") or {}, f"{where}: weights")
        if group.get("input_activations") is not None:
            _mapping(group["input_activations"], f"{where}: input_activations")
        targets = group.get("targets") or []
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise UserError(f"{where}: targets must be a list of names")
    ignore = q.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(t, str) for t in ignore):
        raise UserError(f"{folder.name}: quantization_config.ignore must be a list of names")
    ckpt = Checkpoint(folder, config, dtype, {}, KVScheme("auto"), tensors, files,
                      hashlib.sha256(cfg_bytes).hexdigest(), fmt)
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
        _mapping(kv, f"{folder.name}: kv_cache_scheme")
        kv_type, kv_bits = kv.get("type", "float"), _int_field(kv, "num_bits", 8, f"{folder.name}: kv_cache_scheme")
        if kv_bits != 8:
            raise UserError(f"{folder.name}: {kv_bits}-bit KV cache is not supported (int8 or fp8)")
        ckpt.kv = KVScheme("fp8" if kv_type == "float" else "int8", kv.get("strategy", "tensor"))
    return ckpt
