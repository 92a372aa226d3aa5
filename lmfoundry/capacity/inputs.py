"""The inputs of `lmfoundry plan` (the memory plan): a model's config.json, the quantization its
checkpoint declares, a `lmfoundry bench` result, and the command's flags, each read and checked
with one-line UserErrors. The GPU table is `lmfoundry.gpus`; the arithmetic is
`lmfoundry.capacity.arithmetic`; `lmfoundry.capacity.report` puts them together. Nothing here imports torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmfoundry.capacity.arithmetic import KV_DTYPE_BYTES, WEIGHT_PRECISIONS, QuantSpec
from lmfoundry.checkpoint.sources import BUILTIN_MODELS
from lmfoundry.errors import UserError
from lmfoundry.model.config import MOE_ARCHITECTURES, SUPPORTED_ARCHITECTURES, ModelConfig

if TYPE_CHECKING:
    from lmfoundry.quantformat.scheme import QuantArgs

# Names resolved from the lmfoundry model cache instead of a path.
# the built-in model names every verb takes (`plan` reads their converted config from the cache)
EMBEDDED_MODELS = tuple(BUILTIN_MODELS)

# Dense decoders outside lmfoundry/model/config.py's list whose parameters follow the Llama layout (q/k/v/o
# attention, gated MLP); value = their config class's tie_word_embeddings default, used when
# config.json omits the key.
LLAMA_LAYOUT_ARCHITECTURES = {
    "gemma": True,
    "gemma2": True,
    "gemma3_text": True,
    "phi3": False,
    "olmo": False,
    "olmo2": False,
    "granite": False,
    "smollm3": True,
    "cohere": True,
}
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
REQUIRED_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
)


# ---------------------------------------------------------------------------------------- model


def cache_dir() -> Path:
    """The lmfoundry cache: $LMFOUNDRY_CACHE or ~/.cache/lmfoundry."""
    env = os.environ.get("LMFOUNDRY_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lmfoundry"


def resolve_model(ref: str) -> tuple[str, Path, dict[str, Any]]:
    """(display name, config.json path, raw config) for a folder, a config.json file or a known name."""
    path = Path(ref).expanduser()
    if path.is_dir():
        config_path, name = path / "config.json", path.resolve().name
        if not config_path.is_file():
            raise UserError(f"{ref}: folder has no config.json (expected a Hugging Face model folder)")
    elif path.is_file():
        config_path, name = path, path.resolve().parent.name
    elif ref.lower() in EMBEDDED_MODELS:
        name = ref.lower()
        config_path = cache_dir() / "models" / name / "config.json"
        if not config_path.is_file():
            raise UserError(
                f"{name} is not in the model cache ({config_path.parent}); run "
                f"`lmfoundry quantize {name} ...` once to fetch it, or pass a model folder"
            )
    else:
        raise UserError(
            f"{ref}: no such folder or config.json file, and not a known model name "
            f"(known: {', '.join(EMBEDDED_MODELS)})"
        )
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{config_path}: cannot read ({exc})") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{config_path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{config_path}: expected a JSON object")
    return name, config_path, raw


def parse_model_config(raw: dict[str, Any]) -> tuple[ModelConfig, list[str]]:
    """A ModelConfig for planning, more lenient than the runtime's (see LLAMA_LAYOUT_ARCHITECTURES)."""
    notes: list[str] = []
    cfg = raw
    if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = dict(cfg["text_config"])
        notes.append("multimodal config: only its text decoder is counted")
    moe = [k for k in MOE_KEYS if isinstance(cfg.get(k), int) and cfg[k] > 1]
    if moe and cfg.get("model_type") not in MOE_ARCHITECTURES:
        raise UserError(
            f"mixture-of-experts config ({moe[0]}={cfg[moe[0]]}, model_type {cfg.get('model_type')!r}): plan "
            f"counts the experts of {', '.join(MOE_ARCHITECTURES)} only"
        )
    missing = [k for k in REQUIRED_KEYS if cfg.get(k) in (None, 0)]
    if missing:
        raise UserError(f"config.json lacks {', '.join(missing)}: not a decoder config plan can count")
    model_type = cfg.get("model_type", "?")
    if model_type not in SUPPORTED_ARCHITECTURES:
        if model_type not in LLAMA_LAYOUT_ARCHITECTURES:
            known = sorted(set(SUPPORTED_ARCHITECTURES) | set(LLAMA_LAYOUT_ARCHITECTURES))
            raise UserError(
                f"unsupported model_type {model_type!r} for plan; known: {', '.join(known)}"
            )
        cfg = dict(cfg)
        cfg.setdefault("tie_word_embeddings", LLAMA_LAYOUT_ARCHITECTURES[model_type])
        cfg["model_type"] = "llama"
        notes.append(f"model_type {model_type!r} counted with the Llama layout (q/k/v/o, gated MLP)")
    try:
        model = ModelConfig.from_dict(cfg)
    except (TypeError, ValueError) as exc:
        raise UserError(f"config.json has a malformed field ({exc})") from None
    if min(model.num_heads, model.num_kv_heads, model.head_dim, model.num_layers) <= 0:
        raise UserError("config.json has non-positive head or layer counts")
    if model.num_heads % model.num_kv_heads:
        raise UserError(
            f"config.json: {model.num_heads} attention heads are not a multiple of "
            f"{model.num_kv_heads} KV heads"
        )
    return model, notes


@dataclass(frozen=True)
class CheckpointQuant:
    """The weight quantization a checkpoint's config.json declares."""

    precision: str
    spec: QuantSpec
    quantize_lm_head: bool
    method: str
    lm_head_spec: QuantSpec | None = None  # the LM head's own scheme, where it has one (else `spec`)


def checkpoint_quant(raw: dict[str, Any]) -> tuple[CheckpointQuant | None, list[str]]:
    """Read `quantization_config` (compressed-tensors, GPTQ, AWQ, HF fp8) into a QuantSpec."""
    found = raw.get("quantization_config") or raw.get("compression_config")
    if not isinstance(found, dict):
        return None, []
    qc: dict[str, Any] = found  # JSON object: string keys
    method = str(qc.get("quant_method", "?"))
    if method == "compressed-tensors":
        return _compressed_tensors_quant(qc)
    if method in ("gptq", "awq"):
        bits = int(qc.get("bits", qc.get("w_bit", 4)))
        if bits not in (4, 8):
            return None, [f"checkpoint uses {bits}-bit {method}: counted with --weights instead"]
        group = int(qc.get("group_size", qc.get("q_group_size", 128)))
        strategy = "group" if group > 0 else "channel"
        spec = QuantSpec(
            f"int{bits}",
            bits,
            strategy,
            group_size=group if group > 0 else None,
            zero_points=True,  # both formats store qzeros even when symmetric
            g_idx=method == "gptq",
        )
        return CheckpointQuant(f"int{bits}", spec, bool(qc.get("lm_head", False)), method), []
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block:
            spec = QuantSpec("fp8", 8, "block", block=(int(block[0]), int(block[1])))
        else:
            spec = QuantSpec("fp8", 8, "channel")
        return CheckpointQuant("fp8", spec, False, method), []
    return None, [f"quantization method {method!r} not understood: weights counted as --weights says"]


def _compressed_tensors_quant(qc: dict[str, Any]) -> tuple[CheckpointQuant | None, list[str]]:
    """The first config group's weights, read by the one compressed-tensors reader
    (`plan_from_compressed_tensors`); what it refuses becomes a note (plan then counts --weights)."""
    from lmfoundry.errors import UserError
    from lmfoundry.quantformat.scheme import plan_from_compressed_tensors

    try:
        plan = plan_from_compressed_tensors(qc)
    except UserError as exc:
        return None, [f"{exc}: weights counted as --weights says"]
    if not plan.groups:
        return None, ["compressed-tensors config without weight quantization: counted as bf16"]
    notes = []
    head = plan.scheme_for("lm_head")
    # the LM head's own group (`quantize --lm-head`), in whichever place the file lists it
    head_group = next((g for g in plan.groups if g.targets == ("lm_head",)), None) if len(plan.groups) > 1 else None
    others = [i for i, g in enumerate(plan.groups) if g is not head_group]
    if len(others) > 1:
        notes.append(f"{len(plan.groups)} quantization groups in the checkpoint; the first is used for all linears")
    block = list(qc["config_groups"].values())[others[0]]["weights"].get("block_structure")  # block-scaled FP8 only
    main = _ct_spec(plan.groups[others[0]].scheme.weights, block)
    if isinstance(main, str):
        return None, [main]
    precision, spec = main
    head_spec = None
    if head_group is not None:
        found = _ct_spec(head_group.scheme.weights, None)
        if isinstance(found, str):
            return None, [f"lm_head: {found}"]
        head_spec = found[1]
    return CheckpointQuant(precision, spec, head is not None, "compressed-tensors", head_spec), notes


def _ct_spec(w: QuantArgs, block: Any) -> tuple[str, QuantSpec] | str:
    """(precision, QuantSpec) of one compressed-tensors group's weights, or the note saying why
    plan cannot count them."""
    bits, kind = w.num_bits, w.type
    if kind == "float" and bits == 8:
        precision = "fp8"
    elif kind == "int" and bits in (4, 8):
        precision = f"int{bits}"
    else:
        return f"checkpoint weights are {bits}-bit {kind}: not a plan precision, use --weights"
    strategy = "group" if w.strategy == "tensor_group" else str(w.strategy)  # NVFP4-style: the global scale is negligible
    if strategy not in ("tensor", "channel", "group", "block"):
        return f"checkpoint weight strategy {strategy!r} not understood: use --weights"
    spec = QuantSpec(
        precision,
        bits,
        strategy,
        group_size=w.group_size if strategy == "group" else None,
        block=(int(block[0]), int(block[1])) if strategy == "block" and block else None,
        zero_points=not w.symmetric,
        g_idx=w.actorder == "dynamic",
    )
    if strategy == "block" and spec.block is None:
        return "checkpoint uses block scales without block_structure: use --weights"
    return precision, spec


# ---------------------------------------------------------------------------------------- bench


def load_bench(path: str, concurrency: int | None) -> tuple[float, str]:
    """(output tokens/s, description) from `lmfoundry bench` JSON: the best level or --concurrency."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise UserError(f"--bench {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"--bench {path}: cannot read ({exc})") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"--bench {path}: not valid JSON ({exc})") from None
    levels = data.get("levels") if isinstance(data, dict) else None
    if not isinstance(levels, list) or not levels:
        raise UserError(f"--bench {path}: no 'levels' list (expected the JSON of `lmfoundry bench`)")
    parsed = []
    for level in levels:
        try:
            rate, conc = float(level["output_tokens_per_s"]), int(level["concurrency"])
        except (KeyError, TypeError, ValueError):
            raise UserError(
                f"--bench {path}: each level needs numeric 'concurrency' and 'output_tokens_per_s'"
            ) from None
        parsed.append((conc, rate))
    if concurrency is not None:
        chosen = [lv for lv in parsed if lv[0] == concurrency]
        if not chosen:
            have = ", ".join(str(c) for c, _ in parsed)
            raise UserError(f"--concurrency {concurrency} is not in {path} (levels: {have})")
        conc, rate = chosen[0]
    else:
        conc, rate = max(parsed, key=lambda lv: lv[1])
    if not rate > 0:
        raise UserError(f"--bench {path}: concurrency {conc} has no positive output_tokens_per_s")
    return rate, f"bench {p.name}, concurrency {conc}"


# ---------------------------------------------------------------------------------------- flags


def parse_group_size(value: str | None) -> int | None:
    """--group-size: a positive integer, or 'channel' (also -1, GPTQ's spelling) for per-channel
    scales. 0 is refused: it reads as a group of zero columns, and `quantize` has no such size."""
    if value is None:
        return None
    text = value.strip().lower()
    if text in ("channel", "-1"):
        return 0
    try:
        group = int(text)
    except ValueError:
        raise UserError(f"--group-size must be a positive integer or 'channel', got {value!r}") from None
    if group <= 0:
        raise UserError(f"--group-size must be a positive integer or 'channel', got {value!r}")
    return group


# More than any accelerator's memory, and small enough that the byte arithmetic stays finite (1e308
# GiB overflowed to inf and ended in a traceback).
MAX_OVERHEAD_GIB = 1 << 20


@dataclass
class CapacityInputs:
    model: str
    gpu: str = "h100-80gb"
    context: int = 8192
    weights: str | None = None
    kv: str = "bf16"
    tp: int = 1
    gpu_util: float = 0.9
    group_size: str | None = None
    asymmetric: bool = False
    batch_tokens: int = 8192
    overhead_gib: float = 1.0
    throughput: float | None = None
    bench: str | None = None
    concurrency: int | None = None
    gpu_hour_price: float | None = None
    api_price: float | None = None
    max_loras: int | None = None
    max_lora_rank: int = 16


def validate(inp: CapacityInputs) -> None:
    """Reject bad flag values and combinations with one-line UserErrors."""
    if inp.context <= 0:
        raise UserError(f"--context must be a positive number of tokens, got {inp.context}")
    if inp.tp <= 0:
        raise UserError(f"--tp must be a positive integer, got {inp.tp}")
    if not 0 < inp.gpu_util <= 1:
        raise UserError(f"--gpu-util must be in (0, 1], got {inp.gpu_util}")
    if inp.batch_tokens <= 0:
        raise UserError(f"--batch-tokens must be positive, got {inp.batch_tokens}")
    if not 0 <= inp.overhead_gib <= MAX_OVERHEAD_GIB:
        raise UserError(f"--overhead-gib must be in [0, {MAX_OVERHEAD_GIB}] GiB per GPU, got {inp.overhead_gib}")
    if inp.weights is not None and inp.weights.lower() not in WEIGHT_PRECISIONS:
        raise UserError(f"unknown --weights {inp.weights!r}; choose from {', '.join(WEIGHT_PRECISIONS)}")
    if inp.kv.lower() not in KV_DTYPE_BYTES:
        raise UserError(f"unknown --kv {inp.kv!r}; choose from {', '.join(KV_DTYPE_BYTES)}")
    if inp.throughput is not None and inp.bench is not None:
        raise UserError("pass either --throughput or --bench, not both")
    if inp.throughput is not None and not inp.throughput > 0:
        raise UserError(f"--throughput must be positive tokens/s, got {inp.throughput}")
    if inp.concurrency is not None and inp.bench is None:
        raise UserError("--concurrency picks a level of --bench FILE; pass --bench too")
    for flag, price in (("--gpu-hour-price", inp.gpu_hour_price), ("--api-price", inp.api_price)):
        if price is not None and not price > 0:
            raise UserError(f"{flag} must be positive, got {price}")
    if inp.gpu_hour_price is not None and inp.throughput is None and inp.bench is None:
        raise UserError("--gpu-hour-price needs a throughput: pass --throughput TOK_S or --bench FILE")
    if inp.max_loras is not None and inp.max_loras < 1:
        raise UserError(f"--max-loras must be at least 1, got {inp.max_loras}")
    if inp.max_lora_rank < 1:
        raise UserError(f"--max-lora-rank must be at least 1, got {inp.max_lora_rank}")
    if inp.max_loras is not None and inp.tp > 1:
        raise UserError("--max-loras with --tp: the runtime serves LoRA adapters on one device")
    if inp.api_price is not None and inp.gpu_hour_price is None:
        raise UserError("--api-price is compared with self-hosting: pass --gpu-hour-price too")
