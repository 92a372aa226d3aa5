"""The memory plan of `lmfoundry plan`: the report (plain JSON-able data) built from the inputs
(`lmfoundry.capacity.inputs`, `lmfoundry.gpus`) with the arithmetic of `lmfoundry.capacity.arithmetic`,
and its human-readable rendering. Nothing here imports torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

from lmfoundry.capacity.arithmetic import (
    GIB,
    KV_DTYPE_BYTES,
    UTILIZATIONS,
    WEIGHT_PRECISIONS,
    CapacityEstimate,
    QuantSpec,
    activation_bytes,
    default_quant_specs,
    human_count,
    kv_bytes_per_token,
    linear_in_features,
    lora_bytes,
    memory_fit,
    sharding,
    weight_bytes,
)
from lmfoundry.capacity.inputs import (
    CapacityInputs,
    checkpoint_quant,
    load_bench,
    parse_group_size,
    parse_model_config,
    resolve_model,
    validate,
)
from lmfoundry.errors import UserError
from lmfoundry.gpus import load_gpus, resolve_gpu
from lmfoundry.model.head_split import valid_tp_sizes
from lmfoundry.model.params import param_counts


def build_report(inp: CapacityInputs) -> dict[str, Any]:
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
    quantize_lm_head: bool | QuantSpec = False
    if ckpt is not None:
        quantize_lm_head = ckpt.lm_head_spec or ckpt.quantize_lm_head
        if group_size is None and not inp.asymmetric:
            specs[ckpt.precision] = ckpt.spec
    selected_w = (inp.weights or (ckpt.precision if ckpt else "bf16")).lower()
    selected_kv = inp.kv.lower()

    gpu_bytes = int(gpu["memory_mib"]) * (1 << 20)
    act = activation_bytes(cfg, inp.tp, inp.batch_tokens)
    overhead = int(inp.overhead_gib * GIB)
    # LoRA slots, allocated at start: counted with each precision's weights in the fit
    adapters = lora_bytes(cfg, inp.max_loras, inp.max_lora_rank) if inp.max_loras else 0
    weights: dict[str, dict[str, Any]] = {  # precision -> layout (str) and byte counts by part
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
    _refuse_absurd(cfg, inp, gpu, gpu_bytes, overhead, act, weights[selected_w]["per_gpu_bytes"]["total"],
                   kv[selected_kv]["bytes_per_token_per_gpu"] * inp.context, selected_w)
    table = []
    for p in WEIGHT_PRECISIONS:
        for k in KV_DTYPE_BYTES:
            fit = memory_fit(
                gpu_bytes,
                inp.gpu_util,
                weights[p]["per_gpu_bytes"]["total"] + adapters,
                act,
                overhead,
                kv[k]["bytes_per_token_per_gpu"],
                inp.context,
            )
            table.append({"weights": p, "kv": k, "selected": (p, k) == (selected_w, selected_kv), **asdict(fit)})
    selected = next(row for row in table if row["selected"])

    notes += _notes(cfg, inp, specs, selected_w, gpu, quantize_lm_head, shard, raw)
    if selected["max_sequences"] < 1:
        notes.append(_fit_hint(cfg, inp, specs[selected_w], quantize_lm_head, gpu_bytes, selected_kv, selected))

    report: dict[str, Any] = {
        "model": {
            "name": name,
            "config": str(config_path),
            "model_type": cfg.model_type,
            "layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "experts": {"num_experts": cfg.num_experts, "per_token": cfg.num_experts_per_tok,
                        "intermediate_size": cfg.mlp_width} if cfg.is_moe else None,
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
            "heads_per_gpu": shard.heads_per_rank,
            "kv_heads_per_gpu": shard.kv_heads_per_rank,
            "kv_replication": shard.kv_replication,
            "quantize_lm_head": bool(quantize_lm_head),
        },
        "params": param_counts(cfg),
        "weights": weights,
        "kv": kv,
        "activation_bytes_per_gpu": act,
        "lora": ({"max_loras": inp.max_loras, "max_rank": inp.max_lora_rank, "bytes": adapters,
                  "bytes_per_adapter": adapters // inp.max_loras} if inp.max_loras else None),
        "selected": selected,
        "table": table,
        # batch 1 streams every weight once per token; an MoE token only its top-k experts' (+ the rest)
        "decode_ceiling_tokens_per_s": (
            gpu["bandwidth_gbs"] * 1e9
            / weight_bytes(cfg, specs[selected_w], inp.tp, quantize_lm_head, active=True)["total"]
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
            plan = CapacityEstimate(throughput, inp.gpu_hour_price, inp.tp, inp.api_price)
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
            ins = sorted({i for _, i in linear_in_features(cfg, inp.tp)})
            bad = [i for i in ins if i % spec.group_size]
            if bad and spec.group_size > ins[-1]:
                notes.append(
                    f"{p} group {spec.group_size} is larger than every layer's in_features (at most {ins[-1]} per GPU "
                    f"at tp {inp.tp}): a group is a run of input columns sharing one scale; try a divisor of "
                    f"{math.gcd(*ins)} with --group-size"
                )
            elif bad:
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


def _refuse_absurd(cfg, inp, gpu, gpu_bytes, overhead, act, weight_bytes_per_gpu, sequence_bytes, weights) -> None:
    """Refuse in one line, naming the limit, a size that alone takes more than one GPU has: the
    overhead, a step's activation workspace (--batch-tokens), the memory --gpu-util leaves, the
    adapter slots (--max-loras; LoRA runs on one GPU, so no --tp divides them). plan printed such
    plans with negative GiB and exited 0; a plan that merely does not fit is still reported, with
    a hint (`_fit_hint`)."""
    name, total = gpu["name"], gpu_bytes
    if overhead >= total:
        raise UserError(f"--overhead-gib {inp.overhead_gib:g} is all of the {name}'s {_gib(total)} or more")
    room = total - overhead
    if act > room:
        most = _largest(lambda t: activation_bytes(cfg, inp.tp, t) <= room, inp.batch_tokens)
        raise UserError(f"--batch-tokens {inp.batch_tokens:,}: one step's activation workspace takes {_gib(act)} per GPU "
                        f"at tp {inp.tp}, more than the {name}'s {_gib(total)} less --overhead-gib; at most {most:,} "
                        "tokens fit")
    usable = int(total * inp.gpu_util)
    if usable < overhead + act:
        least = math.ceil((overhead + act) / total * 1000) / 1000
        raise UserError(f"--gpu-util {inp.gpu_util:g} leaves {_gib(usable)} of the {name}'s {_gib(total)}, less than "
                        f"the activation workspace and --overhead-gib alone ({_gib(overhead + act)}); it must be at "
                        f"least {least:g}")
    if inp.max_loras:
        per_slot = lora_bytes(cfg, 1, inp.max_lora_rank)
        if inp.max_loras * per_slot > usable:
            spare = usable - overhead - act - weight_bytes_per_gpu - sequence_bytes
            raise UserError(f"--max-loras {inp.max_loras:,}: {inp.max_loras:,} adapter slots of rank {inp.max_lora_rank} "
                            f"take {_gib(inp.max_loras * per_slot)}, more than the {_gib(usable)} --gpu-util leaves on "
                            f"one {name} (LoRA runs on one GPU); at most {max(spare, 0) // per_slot:,} fit beside the "
                            f"{weights} weights, activations, overhead and one {inp.context:,}-token sequence")


def _largest(fits, upper: int) -> int:
    """The largest n in [0, upper] with fits(n), for a `fits` true at 0 and monotone."""
    low, high = 0, upper
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def _fit_hint(cfg, inp, spec, quantize_lm_head, gpu_bytes, kv_dtype, selected) -> str:
    """Which tensor-parallel size would fit one full-context sequence; with --max-loras, which
    number of adapter slots (plan refuses LoRA with --tp, so it never suggests one)."""
    if inp.max_loras:
        per_slot = lora_bytes(cfg, 1, inp.max_lora_rank)
        spare = selected["kv_room_bytes"] + inp.max_loras * per_slot - selected["kv_bytes_per_sequence"]
        if spare >= per_slot:
            return (f"does not fit with {inp.max_loras:,} adapter slots: at most {spare // per_slot:,} fit beside one "
                    f"{inp.context:,}-token sequence (LoRA runs on one GPU: --tp does not divide them)")
        if spare >= 0:
            return (f"does not fit with {inp.max_loras:,} adapter slots: not one fits beside one {inp.context:,}-token "
                    "sequence (LoRA runs on one GPU: --tp does not divide them)")
        return ("does not fit even without the adapter slots, and LoRA runs on one GPU (no --tp): try smaller "
                "--weights, --kv or --context, or a larger --gpu")
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
        f"{m['name']} ({m['model_type']}, {human_count(params['total'])} parameters"
        + (f", {human_count(params['active'])} active: {m['experts']['per_token']} of "
           f"{m['experts']['num_experts']} experts" if m.get("experts") else "")
        + ") on "
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
    lora = report.get("lora")
    if lora:
        lines.append(
            f"LoRA: {lora['max_loras']} adapter slots x rank {lora['max_rank']} (A and B of every linear, 16-bit, "
            f"zero padded) = {_gib(lora['bytes'])} ({_gib(lora['bytes_per_adapter'])} an adapter), with the weights"
        )
    lines.append(
        f"Memory{per}: {_gib(sel['gpu_bytes'])} x {s['gpu_util']:.2f} = {_gib(sel['usable_bytes'])}"
        f" - weights{' + LoRA' if lora else ''} {_gib(sel['weight_bytes'])} - activations {_gib(sel['activation_bytes'])}"
        f" - overhead {_gib(sel['overhead_bytes'])} = {_gib(sel['kv_room_bytes'])} for KV"
    )
    lines.append(
        f"  -> {sel['max_sequences']:,} concurrent sequences of {s['context']:,} tokens "
        f"({sel['kv_tokens']:,} tokens of KV)"
    )
    lines.append(
        f"  batch-1 decode ceiling: {report['decode_ceiling_tokens_per_s']:,.0f} tok/s "
        f"(bandwidth / weight bytes per GPU{' a token reads' if m.get('experts') else ''})"
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
