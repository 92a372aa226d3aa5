"""`lmfoundry plan`: GPU memory, KV-cache and cost arithmetic before anyone rents a GPU.

Reads only a model's config.json (never its weights, never torch), so it answers in well under a
second: how many bytes the weights take at each precision, how many bytes one token of KV cache
costs, how many full-context sequences fit on the chosen GPU, and, given a throughput and prices,
what a million output tokens costs and when self-hosting beats an API. The arithmetic lives in
`lmfoundry.plan_math`; this module resolves inputs, validates flags and renders the answer.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import click

from lmfoundry.errors import UserError
from lmfoundry.plan_math import (
    GIB,
    KV_DTYPE_BYTES,
    UTILIZATIONS,
    WEIGHT_PRECISIONS,
    CostPlan,
    QuantSpec,
    activation_bytes,
    default_quant_specs,
    human_count,
    kv_bytes_per_token,
    memory_fit,
    param_counts,
    sharding,
    valid_tp_sizes,
    weight_bytes,
)
from lmfoundry.runtime.config import SUPPORTED_ARCHITECTURES, ModelConfig

# Names resolved from the lmfoundry model cache instead of a path.
EMBEDDED_MODELS = ("smollm2-135m",)

# Dense decoders outside runtime/config.py's list whose parameters follow the Llama layout (q/k/v/o
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


# --------------------------------------------------------------------------------------- inputs


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
    if moe:
        raise UserError(
            f"mixture-of-experts config ({moe[0]}={cfg[moe[0]]}): plan counts dense decoders only"
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


def checkpoint_quant(raw: dict[str, Any]) -> tuple[CheckpointQuant | None, list[str]]:
    """Read `quantization_config` (compressed-tensors, GPTQ, AWQ, HF fp8) into a QuantSpec."""
    qc = raw.get("quantization_config") or raw.get("compression_config")
    if not isinstance(qc, dict):
        return None, []
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
    groups = [g for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]
    groups = [g for g in groups if isinstance(g.get("weights"), dict)]
    if not groups:
        return None, ["compressed-tensors config without weight quantization: counted as bf16"]
    notes = []
    if len(groups) > 1:
        notes.append(f"{len(groups)} quantization groups in the checkpoint; the first is used for all linears")
    group = groups[0]
    w = group["weights"]
    bits, kind = int(w.get("num_bits", 8)), str(w.get("type", "int"))
    if kind == "float" and bits == 8:
        precision = "fp8"
    elif kind == "int" and bits in (4, 8):
        precision = f"int{bits}"
    else:
        return None, [f"checkpoint weights are {bits}-bit {kind}: not a plan precision, use --weights"]
    strategy = str(w.get("strategy") or ("group" if w.get("group_size") else "tensor"))
    block = w.get("block_structure")
    if strategy == "tensor_group":  # NVFP4-style: treat as groups (the global scale is negligible)
        strategy = "group"
    if strategy not in ("tensor", "channel", "group", "block"):
        return None, [f"checkpoint weight strategy {strategy!r} not understood: use --weights"]
    spec = QuantSpec(
        precision,
        bits,
        strategy,
        group_size=int(w["group_size"]) if strategy == "group" else None,
        block=(int(block[0]), int(block[1])) if strategy == "block" and block else None,
        zero_points=not w.get("symmetric", True),
        g_idx=w.get("actorder") == "group",
    )
    if strategy == "block" and spec.block is None:
        return None, ["checkpoint uses block scales without block_structure: use --weights"]
    targets = [str(t) for t in group.get("targets") or []]
    ignore = [str(t) for t in qc.get("ignore") or []]
    lm_head = (
        ("Linear" in targets or any("lm_head" in t for t in targets))
        and not any("lm_head" in t for t in ignore)
    )
    return CheckpointQuant(precision, spec, lm_head, "compressed-tensors"), notes


def load_gpus() -> dict[str, dict[str, Any]]:
    """The GPU table from lmfoundry/gpus.yaml (key -> row)."""
    import yaml

    text = resources.files("lmfoundry").joinpath("gpus.yaml").read_text()
    return yaml.safe_load(text)


def resolve_gpu(name: str, gpus: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    key = name.strip().lower()
    for gpu_key, row in gpus.items():
        if key == gpu_key or key in (row.get("aliases") or []):
            return gpu_key, row
    raise UserError(f"unknown GPU {name!r}; known: {', '.join(gpus)}")


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


def parse_group_size(value: str | None) -> int | None:
    """--group-size: a positive integer, or 'channel' (also 0 / -1) for per-channel scales."""
    if value is None:
        return None
    text = value.strip().lower()
    if text in ("channel", "0", "-1"):
        return 0
    try:
        group = int(text)
    except ValueError:
        raise UserError(f"--group-size must be a positive integer or 'channel', got {value!r}") from None
    if group < 0:
        raise UserError(f"--group-size must be a positive integer or 'channel', got {value!r}")
    return group


# --------------------------------------------------------------------------------------- report


@dataclass
class PlanInputs:
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


def validate(inp: PlanInputs) -> None:
    """Reject bad flag values and combinations with one-line UserErrors."""
    if inp.context <= 0:
        raise UserError(f"--context must be a positive number of tokens, got {inp.context}")
    if inp.tp <= 0:
        raise UserError(f"--tp must be a positive integer, got {inp.tp}")
    if not 0 < inp.gpu_util <= 1:
        raise UserError(f"--gpu-util must be in (0, 1], got {inp.gpu_util}")
    if inp.batch_tokens <= 0:
        raise UserError(f"--batch-tokens must be positive, got {inp.batch_tokens}")
    if inp.overhead_gib < 0:
        raise UserError(f"--overhead-gib must be >= 0, got {inp.overhead_gib}")
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
    if inp.api_price is not None and inp.gpu_hour_price is None:
        raise UserError("--api-price is compared with self-hosting: pass --gpu-hour-price too")


def build_plan(inp: PlanInputs) -> dict[str, Any]:
    """Everything `plan` reports, as plain JSON-able data (bytes as integers)."""
    validate(inp)
    gpus = load_gpus()
    gpu_key, gpu = resolve_gpu(inp.gpu, gpus)
    name, config_path, raw = resolve_model(inp.model)
    cfg, notes = parse_model_config(raw)
    ckpt, quant_notes = checkpoint_quant(raw)
    notes += quant_notes
    shard = sharding(cfg, inp.tp)  # validates tp before anything else is computed

    group_size = parse_group_size(inp.group_size)
    specs = default_quant_specs(group_size, inp.asymmetric)
    quantize_lm_head = False
    if ckpt is not None:
        quantize_lm_head = ckpt.quantize_lm_head
        if group_size is None and not inp.asymmetric:
            specs[ckpt.precision] = ckpt.spec
    selected_w = (inp.weights or (ckpt.precision if ckpt else "bf16")).lower()
    selected_kv = inp.kv.lower()

    gpu_bytes = int(gpu["memory_mib"]) * (1 << 20)
    act = activation_bytes(cfg, inp.tp, inp.batch_tokens)
    overhead = int(inp.overhead_gib * GIB)
    weights = {
        p: {
            "layout": specs[p].describe(),
            "model_bytes": weight_bytes(cfg, specs[p], 1, quantize_lm_head),
            "per_gpu_bytes": weight_bytes(cfg, specs[p], inp.tp, quantize_lm_head),
        }
        for p in WEIGHT_PRECISIONS
    }
    kv = {
        k: {
            "bytes_per_token": kv_bytes_per_token(cfg, k, 1),
            "bytes_per_token_per_gpu": kv_bytes_per_token(cfg, k, inp.tp),
        }
        for k in KV_DTYPE_BYTES
    }
    table = []
    for p in WEIGHT_PRECISIONS:
        for k in KV_DTYPE_BYTES:
            fit = memory_fit(
                gpu_bytes,
                inp.gpu_util,
                weights[p]["per_gpu_bytes"]["total"],
                act,
                overhead,
                kv[k]["bytes_per_token_per_gpu"],
                inp.context,
            )
            table.append({"weights": p, "kv": k, "selected": (p, k) == (selected_w, selected_kv), **asdict(fit)})
    selected = next(row for row in table if row["selected"])

    notes += _notes(cfg, inp, specs, selected_w, gpu, quantize_lm_head, shard, raw)
    if selected["max_sequences"] < 1:
        notes.append(_fit_hint(cfg, inp, specs[selected_w], quantize_lm_head, gpu_bytes, selected_kv))

    report: dict[str, Any] = {
        "model": {
            "name": name,
            "config": str(config_path),
            "model_type": cfg.model_type,
            "layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "heads": cfg.num_heads,
            "kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size,
            "tied_embeddings": cfg.tie_word_embeddings,
            "max_position_embeddings": cfg.max_position_embeddings,
            "checkpoint_quantization": (
                {"method": ckpt.method, "precision": ckpt.precision, "layout": ckpt.spec.describe()}
                if ckpt
                else None
            ),
        },
        "gpu": {"key": gpu_key, **{k: v for k, v in gpu.items() if k != "aliases"}},
        "settings": {
            "context": inp.context,
            "weights": selected_w,
            "kv": selected_kv,
            "tp": inp.tp,
            "gpu_util": inp.gpu_util,
            "batch_tokens": inp.batch_tokens,
            "overhead_bytes": overhead,
            "heads_per_gpu": shard.heads_per_gpu,
            "kv_heads_per_gpu": shard.kv_heads_per_gpu,
            "kv_replication": shard.kv_replication,
            "quantize_lm_head": quantize_lm_head,
        },
        "params": param_counts(cfg),
        "weights": weights,
        "kv": kv,
        "activation_bytes_per_gpu": act,
        "selected": selected,
        "table": table,
        "decode_ceiling_tokens_per_s": (
            gpu["bandwidth_gbs"] * 1e9 / selected["weight_bytes"]
        ),
        "cost": None,
        "advice": None,
        "notes": notes,
    }
    throughput, source = inp.throughput, "--throughput"
    if inp.bench is not None:
        throughput, source = load_bench(inp.bench, inp.concurrency)
    if throughput is not None:
        report["cost"] = {"throughput": throughput, "throughput_source": source,
                          "monthly_capacity_tokens": throughput * 3600 * 730.0}
        if inp.gpu_hour_price is not None:
            plan = CostPlan(throughput, inp.gpu_hour_price, inp.tp, inp.api_price)
            report["cost"].update(
                {
                    "gpu_hour_price": inp.gpu_hour_price,
                    "gpus": inp.tp,
                    "monthly_cost_always_on": plan.monthly,
                    "cost_per_million": {f"{u:.0%}": plan.cost_per_million(u) for u in UTILIZATIONS},
                    "api_price": inp.api_price,
                    "breakeven_tokens_per_month": plan.breakeven_tokens_per_month,
                    "breakeven_utilization": plan.breakeven_utilization,
                }
            )
            report["advice"] = plan.advice() or None
    return report


def _notes(cfg, inp, specs, selected_w, gpu, quantize_lm_head, shard, raw) -> list[str]:
    notes = []
    if inp.context > cfg.max_position_embeddings:
        notes.append(
            f"--context {inp.context:,} exceeds the model's max_position_embeddings "
            f"{cfg.max_position_embeddings:,}"
        )
    window = raw.get("sliding_window")
    uses_window = raw.get("use_sliding_window", raw.get("model_type") != "qwen2")
    if isinstance(window, int) and window < inp.context and uses_window:
        notes.append(f"sliding_window {window}: KV is counted for the full context (engines may keep less)")
    if shard.kv_replication > 1:
        notes.append(
            f"tp {inp.tp} > {cfg.num_kv_heads} KV heads: each KV head is replicated on "
            f"{shard.kv_replication} GPUs, so KV per GPU no longer shrinks with tp"
        )
    for p in ("int4", "int8"):
        spec = specs[p]
        if spec.strategy == "group":
            ins = sorted({i for _, i in _linear_in_features(cfg, inp.tp)})
            bad = [i for i in ins if i % spec.group_size]
            if bad:
                notes.append(
                    f"{p} group {spec.group_size} does not divide in_features {bad[0]} "
                    f"(per GPU at tp {inp.tp}): such checkpoints cannot be stored; try a divisor "
                    f"of {math.gcd(*ins)} with --group-size"
                )
    if selected_w == "fp8" and gpu.get("fp8_tflops") is None:
        notes.append(f"{gpu['name']} has no FP8 tensor cores: fp8 weights run weight-only (dequantized)")
    if quantize_lm_head and not cfg.tie_word_embeddings:
        notes.append("lm_head is quantized, as in the checkpoint")
    return notes


def _linear_in_features(cfg: ModelConfig, tp: int) -> list[tuple[str, int]]:
    shard = sharding(cfg, tp)
    h = cfg.hidden_size
    return [
        ("qkv/gate/up", h),
        ("o_proj", shard.heads_per_gpu * cfg.head_dim),
        ("down_proj", cfg.intermediate_size // tp),
    ]


def _fit_hint(cfg, inp, spec, quantize_lm_head, gpu_bytes, kv_dtype) -> str:
    """Which tensor-parallel size would fit one full-context sequence."""
    for t in valid_tp_sizes(cfg):
        if t <= inp.tp:
            continue
        fit = memory_fit(
            gpu_bytes,
            inp.gpu_util,
            weight_bytes(cfg, spec, t, quantize_lm_head)["total"],
            activation_bytes(cfg, t, inp.batch_tokens),
            int(inp.overhead_gib * GIB),
            kv_bytes_per_token(cfg, kv_dtype, t),
            inp.context,
        )
        if fit.fits:
            return f"does not fit at tp {inp.tp}: --tp {t} fits {fit.max_sequences} sequence(s)"
    return f"does not fit at tp {inp.tp}, nor at any valid tp up to 64"


# --------------------------------------------------------------------------------------- render


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _kib(n: float) -> str:
    return f"{n / 1024:.1f} KiB"


def render(report: dict[str, Any]) -> str:
    """The human-readable answer (plain text, fixed-width tables)."""
    m, g, s = report["model"], report["gpu"], report["settings"]
    params, weights, sel = report["params"], report["weights"], report["selected"]
    lines = []
    fp8 = f" / fp8 {g['fp8_tflops']:g}" if g.get("fp8_tflops") else ""
    lines.append(
        f"{m['name']} ({m['model_type']}, {human_count(params['total'])} parameters) on "
        f"{s['tp']} x {g['name']} ({g['memory_mib'] / 1024:.1f} GiB, {g['bandwidth_gbs']:g} GB/s, "
        f"bf16 {g['bf16_tflops']:g}{fp8} TFLOPS)"
    )
    lines.append(
        f"context {s['context']:,} tokens, gpu-util {s['gpu_util']:.2f}, "
        f"weights {s['weights']} ({weights[s['weights']]['layout']}), KV {s['kv']}"
    )
    lines.append("")
    header = f"{'part':<12}{'params':>12}" + "".join(f"{p + ' GiB':>11}" for p in WEIGHT_PRECISIONS)
    lines.append(header)
    for part in ("embeddings", "attention", "mlp", "norms", "lm_head", "total"):
        count = params[part]
        label = "(tied)" if part == "lm_head" and m["tied_embeddings"] else human_count(count)
        row = f"{part:<12}{label:>12}"
        row += "".join(f"{weights[p]['model_bytes'][part] / GIB:>11.2f}" for p in WEIGHT_PRECISIONS)
        lines.append(row)
    lines.append(
        f"{'total GB':<24}"
        + "".join(f"{weights[p]['model_bytes']['total'] / 1e9:>11.2f}" for p in WEIGHT_PRECISIONS)
    )
    lines.append("")
    kvb = report["kv"][s["kv"]]
    heads = f"{s['kv_heads_per_gpu']} KV heads"
    if s["tp"] > 1:
        heads += f" per GPU ({m['kv_heads']} / tp {s['tp']})"
    lines.append(
        f"KV cache: 2 x {m['layers']} layers x {heads} x {m['head_dim']} head_dim x "
        f"{KV_DTYPE_BYTES[s['kv']]} B ({s['kv']}) = {_kib(kvb['bytes_per_token_per_gpu'])}/token; "
        f"{_gib(sel['kv_bytes_per_sequence'])} per {s['context']:,}-token sequence"
    )
    per = " per GPU" if s["tp"] > 1 else ""
    lines.append(
        f"Memory{per}: {_gib(sel['gpu_bytes'])} x {s['gpu_util']:.2f} = {_gib(sel['usable_bytes'])}"
        f" - weights {_gib(sel['weight_bytes'])} - activations {_gib(sel['activation_bytes'])}"
        f" - overhead {_gib(sel['overhead_bytes'])} = {_gib(sel['kv_room_bytes'])} for KV"
    )
    lines.append(
        f"  -> {sel['max_sequences']:,} concurrent sequences of {s['context']:,} tokens "
        f"({sel['kv_tokens']:,} tokens of KV)"
    )
    lines.append(
        f"  batch-1 decode ceiling: {report['decode_ceiling_tokens_per_s']:,.0f} tok/s "
        f"(bandwidth / weight bytes per GPU)"
    )
    lines.append("")
    lines.append(
        f"  {'weights':<8}{'kv':<6}{'weights/GPU':>13}{'KV/token':>11}{'KV/seq':>11}"
        f"{'KV room':>11}{'max seqs':>10}"
    )
    for row in report["table"]:
        mark = "*" if row["selected"] else " "
        lines.append(
            f"{mark} {row['weights']:<8}{row['kv']:<6}{_gib(row['weight_bytes']):>13}"
            f"{_kib(row['kv_bytes_per_token']):>11}{_gib(row['kv_bytes_per_sequence']):>11}"
            f"{_gib(row['kv_room_bytes']):>11}{row['max_sequences']:>10,}"
        )
    cost = report["cost"]
    if cost:
        lines.append("")
        lines.append(
            f"Throughput {cost['throughput']:,.1f} output tok/s ({cost['throughput_source']}): "
            f"{human_count(cost['monthly_capacity_tokens'])} tokens/month at 100%"
        )
        if "cost_per_million" in cost:
            lines.append(
                f"Cost per million output tokens at ${cost['gpu_hour_price']:.2f}/GPU-hour x "
                f"{cost['gpus']} GPU{'s' if cost['gpus'] > 1 else ''} (${cost['monthly_cost_always_on']:,.0f}/month always on):"
            )
            lines.append(
                "  " + "   ".join(f"{u} busy: ${v:.3f}" for u, v in cost["cost_per_million"].items())
            )
            if cost["api_price"] is not None:
                lines.append(
                    f"  break-even vs API ${cost['api_price']:.2f}/M: "
                    f"{human_count(cost['breakeven_tokens_per_month'])} output tokens/month "
                    f"({cost['breakeven_utilization']:.0%} of capacity)"
                )
        else:
            lines.append("  add --gpu-hour-price (and --api-price) for cost per million tokens")
    if report["advice"]:
        lines.append(report["advice"])
    for note in report["notes"]:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def render_gpus(gpus: dict[str, dict[str, Any]]) -> str:
    lines = [f"{'gpu':<16}{'memory':>11}{'GB/s':>7}{'bf16 TF':>9}{'fp8 TF':>8}  name"]
    for key, g in gpus.items():
        fp8 = f"{g['fp8_tflops']:g}" if g.get("fp8_tflops") else "-"
        lines.append(
            f"{key:<16}{g['memory_mib'] / 1024:>7.1f} GiB{g['bandwidth_gbs']:>7g}"
            f"{g['bf16_tflops']:>9g}{fp8:>8}  {g['name']}"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------- command


class _Number(click.ParamType):
    """int/float option whose parse errors are one-line UserErrors like every other plan error."""

    def __init__(self, kind: type) -> None:
        self.kind = kind
        self.name = kind.__name__

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, self.kind):
            return value
        try:
            return self.kind(value)
        except (TypeError, ValueError):
            flag = param.opts[0] if param is not None and param.opts else "value"
            noun = "an integer" if self.kind is int else "a number"
            raise UserError(f"{flag} must be {noun}, got {value!r}") from None


INT, FLOAT = _Number(int), _Number(float)


@click.command("plan")
@click.argument("model_or_checkpoint", required=False)
@click.option("--gpu", metavar="NAME", default="h100-80gb", show_default=True, help="GPU from lmfoundry/gpus.yaml (--list-gpus).")
@click.option("--context", type=INT, default=8192, show_default=True, help="Tokens per sequence (prompt + output).")
@click.option("--weights", metavar="bf16|fp8|int8|int4", default=None, help="Weight precision of the headline plan [default: the checkpoint's, else bf16].")
@click.option("--kv", metavar="bf16|fp8|int8", default="bf16", show_default=True, help="KV-cache dtype of the headline plan.")
@click.option("--tp", type=INT, default=1, show_default=True, help="Tensor-parallel GPUs.")
@click.option("--gpu-util", type=FLOAT, default=0.9, show_default=True, help="Fraction of GPU memory the engine may use.")
@click.option("--group-size", metavar="N|channel", default=None, help="int4/int8 group size or 'channel' [default: int4 128, int8 channel, or the checkpoint's].")
@click.option("--asymmetric", is_flag=True, help="Count a zero point per int4/int8 scale.")
@click.option("--batch-tokens", type=INT, default=8192, show_default=True, help="Tokens per forward step (sizes the activation workspace).")
@click.option("--overhead-gib", type=FLOAT, default=1.0, show_default=True, help="CUDA context, CUDA graphs, NCCL and allocator slack per GPU.")
@click.option("--throughput", metavar="TOK_S", type=FLOAT, default=None, help="Measured output tokens/s of the whole deployment (all --tp GPUs).")
@click.option("--bench", metavar="FILE", default=None, help="JSON from `lmfoundry bench` (uses its best level).")
@click.option("--concurrency", type=INT, default=None, help="Use this concurrency level of --bench.")
@click.option("--gpu-hour-price", metavar="USD", type=FLOAT, default=None, help="Price of one GPU-hour (the deployment pays for --tp of them).")
@click.option("--api-price", metavar="USD", type=FLOAT, default=None, help="API price per million output tokens.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option("--list-gpus", is_flag=True, help="Print the GPU table and exit.")
def plan(model_or_checkpoint: str | None, as_json: bool, list_gpus: bool, **options: Any) -> None:
    """Memory, KV-cache and cost arithmetic for MODEL_OR_CHECKPOINT (a model folder, a config.json,
    or smollm2-135m), from its config alone.

    \b
    Counts: weights per precision (int4/int8 include 16-bit group scales and, if asymmetric, zero
    points; embeddings, norms and lm_head stay 16-bit); KV bytes per token = 2 x layers x KV heads x
    head_dim x bytes; sequences that fit in memory x --gpu-util after weights, an activation
    workspace and --overhead-gib. --tp splits weights and KV heads (a KV head is replicated when
    tp > KV heads). With --throughput or --bench plus --gpu-hour-price: cost per million output
    tokens, and with --api-price the monthly break-even volume.
    """
    if list_gpus:
        gpus = load_gpus()
        click.echo(json.dumps(gpus, indent=2) if as_json else render_gpus(gpus))
        return
    if not model_or_checkpoint:
        raise UserError("missing MODEL_OR_CHECKPOINT (a model folder, a config.json, or smollm2-135m)")
    report = build_plan(PlanInputs(model=model_or_checkpoint, **options))
    click.echo(json.dumps(report, indent=2) if as_json else render(report))
