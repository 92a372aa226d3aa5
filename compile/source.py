"""What `compile` needs to know about a checkpoint: shapes, per-linear quantization schemes, KV cache
scheme, dtype, and which tensors exist — read from config.json and safetensors headers only (no
weights are loaded, so a config-only folder is a valid input).

Schemes follow compressed-tensors' `quantization_config`: `config_groups` with `targets` (module
class "Linear", exact names, or "re:" regexes matched from the start of the module name), `weights`
and `input_activations` quantization args, a top-level or per-group `format`, and `ignore`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from lmfoundry.checkpoint.headers import read_safetensors_header
from lmfoundry.checkpoint.sources import safetensors_files
from lmfoundry.errors import UserError
from lmfoundry.manifest import contained_file
from lmfoundry.model.config import LAYER_LINEARS, ModelConfig
from lmfoundry.quantformat.scheme import Scheme, plan_from_compressed_tensors


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




def linear_scheme(scheme: Scheme | None, declared_format: str | None, where: str) -> LinearScheme:
    """The kernel family and parameters of one linear's scheme (None: not quantized), refused with
    one line when no kernel runs it."""
    if scheme is None:
        return LinearScheme("dense")
    w, a = scheme.weights, scheme.input_activations
    bits, strategy = w.num_bits, w.strategy
    actorder = w.actorder not in (None, False, "static", "none")
    group_size = w.group_size or 0 if strategy == "group" else 0
    if w.type == "int" and a is None:
        if declared_format not in (None, "pack-quantized"):
            raise UserError(f"{where}: weight-only int format {declared_format!r} is not supported (expected pack-quantized)")
        if bits not in (4, 8):
            raise UserError(f"{where}: {bits}-bit weights are not supported by the kernels (4 or 8 bits)")
        if strategy not in ("group", "channel"):
            raise UserError(f"{where}: weight strategy {strategy!r} not supported for W{bits}A16 (group or channel)")
        return LinearScheme("w4a16", bits, group_size, w.symmetric, actorder, strategy)
    if a is None:
        raise UserError(f"{where}: float weight-only quantization (no input_activations) is not supported; "
                        "use FP8 with dynamic per-token activations")
    if a.strategy not in ("token", "tensor"):
        raise UserError(f"{where}: activation strategy {a.strategy!r} not supported (token or tensor)")
    if strategy not in ("channel", "tensor"):
        raise UserError(f"{where}: weight strategy {strategy!r} not supported for 8-bit activations (channel or tensor)")
    if not w.symmetric or not a.symmetric:
        raise UserError(f"{where}: asymmetric 8-bit weights/activations are not supported")
    if w.type == a.type == "int" and bits == a.num_bits == 8:
        return LinearScheme("w8a8", 8, 0, True, False, strategy, a.strategy, a.dynamic)
    if w.type == a.type == "float" and bits == 8:
        return LinearScheme("fp8", 8, 0, True, False, strategy, a.strategy, a.dynamic)
    raise UserError(f"{where}: unsupported scheme weights {w.type}{bits} / activations {a.type}{a.num_bits}")


def load_checkpoint(path: str | Path, dtype: str | None = None) -> Checkpoint:
    """Read a Hugging Face folder (quantized or float) into a `Checkpoint` (raises UserError)."""
    folder = Path(path)
    if not folder.exists():
        raise UserError(f"{folder}: no such checkpoint folder")
    if not folder.is_dir():
        raise UserError(f"{folder}: not a folder (expected a Hugging Face checkpoint folder)")
    config = ModelConfig.from_file(folder)
    refusal = config.kernel_path_refusal()  # Gemma: the kernels implement the Llama layer only
    if refusal is not None:
        raise UserError(f"{folder}: {refusal}")
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

    q = config.raw.get("quantization_config") or config.raw.get("compression_config") or {}
    plan = plan_from_compressed_tensors(q, f"{folder.name}: quantization_config") if q else None
    fmt = q.get("format") if q else None
    ckpt = Checkpoint(folder, config, dtype, {}, KVScheme("auto"), tensors, files,
                      hashlib.sha256(cfg_bytes).hexdigest(), fmt)
    declared = {g.scheme.name: (q["config_groups"][g.scheme.name].get("format") or fmt) for g in plan.groups} if plan else {}
    for name in ckpt.linear_names():
        scheme = plan.scheme_for(name) if plan else None
        where = f"{folder.name}: config group {scheme.name}" if scheme is not None else folder.name
        ls = linear_scheme(scheme, declared.get(scheme.name) if scheme is not None else None, where)
        if ls.kind == "w4a16" and ls.group_size:
            n, k = ckpt.shape_of(name)
            if k % ls.group_size:
                raise UserError(
                    f"{name}: group size {ls.group_size} does not divide its {k} input features; "
                    f"requantize with a group size that divides {k} (e.g. 64) or per-channel"
                )
        ckpt.schemes[name] = ls
    kv = plan.kv_cache if plan else None
    if kv is not None:
        if kv.num_bits != 8:
            raise UserError(f"{folder.name}: {kv.num_bits}-bit KV cache is not supported (int8 or fp8)")
        ckpt.kv = KVScheme("fp8" if kv.type == "float" else "int8", kv.strategy)
    return ckpt
