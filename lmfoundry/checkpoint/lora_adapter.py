"""PEFT LoRA adapter folders (`adapter_config.json` + `adapter_model.safetensors`), read against
the base model they are to run on.

An adapter is a set of low-rank updates of the base's linears: linear `m` computes
x W^T + scale_m * (x A_m^T) B_m^T with A_m [r, in], B_m [out, r] and scale_m = alpha / r (or
alpha / sqrt(r) with rsLoRA, per module through PEFT's `rank_pattern` / `alpha_pattern`). An
adapter trained on a fused linear (Phi-3's `qkv_proj`, `gate_up_proj`) is split into its members
here: each member keeps the shared A and its rows of B, which is the same product.

Everything that would make the adapter compute something other than that sum is refused in one
line, before any tensor is read: another kind of adapter (DoRA, QA-LoRA, aLoRA, bias terms,
whole-module replacements), a target the base lacks (or one the runtime does not adapt: the
embedding, the LM head, MoE experts), shapes of another base (hidden size, vocabulary, layer
count), a rank over the server's maximum. The base is only read as its `ModelConfig`, so a
refusal costs no model load.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lmfoundry.checkpoint.headers import read_safetensors_header, regular_file
from lmfoundry.errors import UserError
from lmfoundry.model.config import FUSED_LINEARS, LAYER_LINEARS, ModelConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
CONFIG_MAX_BYTES = 1 << 20
FLOAT_DTYPES = ("F32", "BF16", "F16")
# adapter_config.json switches that make the adapter something other than a sum of B A products
# (or that change which tokens it applies to), each refused with what it is
OTHER_KINDS = {
    "use_dora": "DoRA (use_dora: true)",
    "use_qalora": "QA-LoRA (use_qalora: true)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "layer_replication": "layer replication (layer_replication)",
    "target_parameters": "LoRA on parameters (target_parameters)",
    "trainable_token_indices": "trainable tokens (trainable_token_indices)",
    "modules_to_save": "whole-module replacements (modules_to_save)",
    "arrow_config": "Arrow routing (arrow_config)",
}
# PEFT's saved names: "base_model.model.<module>.<kind>[.<adapter>][.weight|.bias]"
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+?)\.(?P<kind>lora_A|lora_B|lora_embedding_A|lora_embedding_B|"
                  r"lora_magnitude_vector)(?:\.(?P<adapter>[^.]+))?(?:\.(?P<param>weight|bias))?$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class LoRALinear:
    """One adapted linear: its delta is scale * B @ A."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass
class LoRAAdapter:
    """An adapter as the runtime stacks it: each adapted linear of the base by its full name
    (`model.layers.{i}.self_attn.q_proj`), fused targets already split into their linears."""

    path: Path
    rank: int  # the largest rank of any module (what --max-lora-rank must hold)
    linears: dict[str, LoRALinear]

    @property
    def targets(self) -> tuple[str, ...]:
        """The local linear names (`self_attn.q_proj`, ...) it adapts in some layer."""
        return tuple(sorted({_LAYER.match(n).group(2) for n in self.linears}))  # type: ignore[union-attr]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for lin in self.linears.values() for t in (lin.a, lin.b))


@dataclass(frozen=True)
class _Module:
    """One adapted module as the file stores it: tensor names and shapes (nothing read yet)."""

    stored: str  # the module name in the file (PEFT's, after base_model.model.)
    a: tuple[str, list[int]]
    b: tuple[str, list[int]]


def _refuse(path: Path, why: str) -> UserError:
    return UserError(f"{path}: {why}")


def read_adapter_config(folder: Path) -> dict[str, Any]:
    """adapter_config.json of an adapter folder, checked to be a plain PEFT LoRA (see module doc)."""
    if not folder.is_dir():
        raise _refuse(folder, "not a folder (a LoRA adapter is a PEFT folder with adapter_config.json and "
                              "adapter_model.safetensors)")
    path = folder / ADAPTER_CONFIG
    if not path.exists():
        raise _refuse(folder, f"no {ADAPTER_CONFIG}: not a PEFT adapter folder")
    size = regular_file(path, "the adapter config").st_size
    if size > CONFIG_MAX_BYTES:
        raise _refuse(path, f"{size} bytes, larger than an adapter config can be ({CONFIG_MAX_BYTES})")
    try:
        config = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise _refuse(path, "not valid JSON") from None
    if not isinstance(config, dict):
        raise _refuse(path, "not a JSON object")
    kind = config.get("peft_type")
    if kind != "LORA":
        raise _refuse(path, f"peft_type {kind!r}: only LoRA adapters (peft_type LORA) are implemented")
    for key, what in OTHER_KINDS.items():
        if config.get(key):
            raise _refuse(path, f"{what} is not implemented; only plain LoRA products are served")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise _refuse(path, f"LoRA bias terms (bias: {config.get('bias')!r}, lora_bias: {config.get('lora_bias')!r}) "
                            "are not implemented")
    alpha = config.get("lora_alpha")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise _refuse(path, f"lora_alpha must be a number, got {alpha!r}")
    for name in ("rank_pattern", "alpha_pattern"):
        value = config.get(name) or {}
        if not isinstance(value, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                  for v in value.values()):
            raise _refuse(path, f"{name} must map module patterns to numbers")
    return config


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's `get_pattern_key`: the first pattern that matches the end of the module's name."""
    for key, value in patterns.items():
        try:
            if re.match(rf"(.*\.)?({key})$", module):
                return value
        except re.error:
            continue
    return default


def _modules(path: Path, header: dict[str, Any]) -> dict[str, _Module]:
    """The file's adapted modules; anything that is not a LoRA A/B weight is refused by name."""
    found: dict[str, dict[str, tuple[str, list[int]]]] = {}
    for name, entry in header.items():
        m = _KEY.match(name)
        shown = name[:120]
        if m is None:
            raise _refuse(path, f"tensor {shown!r} is not a LoRA weight (a whole-module replacement or another "
                                "kind of adapter): not implemented")
        kind, param = m.group("kind"), m.group("param")
        if kind == "lora_magnitude_vector":
            raise _refuse(path, f"tensor {shown!r} is a DoRA magnitude: DoRA is not implemented")
        if param == "bias":
            raise _refuse(path, f"tensor {shown!r} is a LoRA bias: LoRA bias terms are not implemented")
        if entry["dtype"] not in FLOAT_DTYPES:
            raise _refuse(path, f"tensor {shown!r} is {entry['dtype']}; LoRA weights are float32, bfloat16 or float16")
        side = "a" if kind.endswith("A") else "b"
        slot = found.setdefault(m.group("module") + ("#embedding" if "embedding" in kind else ""), {})
        if side in slot:
            raise _refuse(path, f"two {kind} tensors for {m.group('module')!r} (several adapters in one file?)")
        slot[side] = (name, list(entry["shape"]))
    modules = {}
    for module, sides in found.items():
        if set(sides) != {"a", "b"}:
            missing = "lora_B" if "b" not in sides else "lora_A"
            raise _refuse(path, f"{module!r} has no {missing} tensor (a truncated or corrupt adapter)")
        modules[module] = _Module(module, sides["a"], sides["b"])
    if not modules:
        raise _refuse(path, "the adapter holds no LoRA weights")
    return modules


def _local_targets(local: str) -> tuple[str, ...] | None:
    """The base linears a module of a layer adapts: itself, or a fused module's members."""
    if local in LAYER_LINEARS:
        return (local,)
    return FUSED_LINEARS.get(local)


def _check_module(path: Path, mod: _Module, base: ModelConfig, max_rank: int | None) -> tuple[int, str, tuple[str, ...]]:
    """(layer, local name, base linears) of one module, its shapes checked against the base."""
    (_, a_shape), (_, b_shape) = mod.a, mod.b
    name = mod.stored
    if name.endswith("#embedding") or name.rsplit(".", 1)[-1] == "lm_head":
        module = name.removesuffix("#embedding")
        rows = a_shape[1] if name.endswith("#embedding") else (b_shape[0] if len(b_shape) == 2 else None)
        if rows is not None and rows != base.vocab_size:
            raise _refuse(path, f"the adapter is for another base: its {module} covers a vocabulary of {rows}, "
                                f"this base's is {base.vocab_size}")
        raise _refuse(path, f"LoRA on {module} is not implemented (only the decoder layers' linears are adapted)")
    layer_match = _LAYER.match(base.our_name(name))
    if layer_match is None:
        raise _refuse(path, f"targets {name!r}, which this base ({base.model_type}) does not have")
    layer, local = int(layer_match.group(1)), layer_match.group(2)
    if local.startswith("mlp.experts.") or ".experts." in local:
        raise _refuse(path, f"LoRA on MoE experts ({name}) is not implemented")
    targets = _local_targets(local)
    if targets is None or base.is_moe and local.startswith("mlp."):
        raise _refuse(path, f"targets {name!r}, which this base ({base.model_type}) does not have "
                            f"(it adapts {', '.join(n.rsplit('.', 1)[1] for n in LAYER_LINEARS)})")
    if layer >= base.num_layers:
        raise _refuse(path, f"targets {name}, but this base has {base.num_layers} layers: the adapter is for "
                            "another base")
    if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != b_shape[1] or a_shape[0] < 1:
        raise _refuse(path, f"{name}: lora_A {a_shape} and lora_B {b_shape} are not an [r, in], [out, r] pair")
    shapes = base.linear_shapes
    want_out = sum(shapes[t][0] for t in targets)
    want_in = shapes[targets[0]][1]
    if (b_shape[0], a_shape[1]) != (want_out, want_in):
        raise _refuse(path, f"the adapter is for another base: its {name} maps {a_shape[1]} features to "
                            f"{b_shape[0]}, this base's maps {want_in} to {want_out} (hidden size "
                            f"{base.hidden_size})")
    if max_rank is not None and a_shape[0] > max_rank:
        raise _refuse(path, f"rank {a_shape[0]} ({name}) exceeds --max-lora-rank {max_rank}")
    return layer, local, targets


def check_adapter(folder: str | Path, base: ModelConfig, max_rank: int | None = None) -> int:
    """Refuse an adapter that does not fit `base` (see module doc) from its config and header
    alone; returns its largest rank."""
    return _plan(Path(folder), base, max_rank)[0]


def _plan(folder: Path, base: ModelConfig, max_rank: int | None
          ) -> tuple[int, dict[str, Any], Path, list[tuple[_Module, int, str, tuple[str, ...]]]]:
    config = read_adapter_config(folder)
    weights = folder / ADAPTER_WEIGHTS
    if not weights.exists():
        if (folder / "adapter_model.bin").exists():
            raise _refuse(folder, "adapter_model.bin is a pickle, which is never loaded; save the adapter as "
                                  "safetensors (PEFT's save_pretrained(..., safe_serialization=True))")
        raise _refuse(folder, f"no {ADAPTER_WEIGHTS}")
    if base.is_moe:
        raise _refuse(folder, f"LoRA on a mixture-of-experts base ({base.model_type}) is not implemented")
    header = read_safetensors_header(weights)
    plan = [(mod, *_check_module(weights, mod, base, max_rank)) for mod in _modules(weights, header).values()]
    seen: dict[str, str] = {}
    for mod, layer, _, targets in plan:
        for t in targets:
            full = f"model.layers.{layer}.{t}"
            if full in seen:
                raise _refuse(weights, f"{full} is adapted twice ({seen[full]} and {mod.stored})")
            seen[full] = mod.stored
    rank = max(mod.a[1][0] for mod, *_ in plan)
    return rank, config, weights, plan


def read_adapter(folder: str | Path, base: ModelConfig, max_rank: int | None = None) -> LoRAAdapter:
    """The adapter's weights for `base`, in float32, each linear with its scale (see module doc)."""
    from safetensors import safe_open

    folder = Path(folder)
    rank, config, weights, plan = _plan(folder, base, max_rank)
    use_rslora = bool(config.get("use_rslora"))
    alpha0 = float(config["lora_alpha"])
    alphas = config.get("alpha_pattern") or {}
    linears: dict[str, LoRALinear] = {}
    shapes = base.linear_shapes
    with safe_open(str(weights), framework="pt") as f:
        for mod, layer, local, targets in plan:
            a, b = f.get_tensor(mod.a[0]).float(), f.get_tensor(mod.b[0]).float()
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise _refuse(weights, f"{mod.stored} holds inf or NaN values")
            r = a.shape[0]
            alpha = float(_pattern_value(alphas, f"model.layers.{layer}.{local}", alpha0))
            scale = alpha / math.sqrt(r) if use_rslora else alpha / r
            row = 0
            for t in targets:
                rows = shapes[t][0]
                linears[f"model.layers.{layer}.{t}"] = LoRALinear(a, b[row : row + rows].contiguous(), scale)
                row += rows
    return LoRAAdapter(folder, rank, linears)
