"""What each supported architecture adds to the Llama-family `config.json`: the switches
`ModelConfig.from_dict` reads for Phi-3 (fused linears), sparse MoE (Mixtral, Qwen3-MoE), sliding
windows (Mistral, Qwen2/3, Phi-3) and Gemma 2/3 (sandwich norms, GELU, soft-caps, per-layer
attention types and rope), each checked into plain values with one-line errors. Kept apart from
`config.py` so that the common config reads in one sitting and each family's quirks in another.
"""

from __future__ import annotations

from typing import Any

from lmfoundry.errors import UserError

# transformers' Gemma2Config / Gemma3TextConfig defaults, for fields a config.json may omit. Soft-caps
# are looked up with `in`, not `.get`: an explicit null switches them off.
GEMMA_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096, "rms_norm_eps": 1e-6,
               "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "max_position_embeddings": 8192},
    "gemma3_text": {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096, "rms_norm_eps": 1e-6,
                    "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
                    "attn_logit_softcapping": None, "final_logit_softcapping": None,
                    "max_position_embeddings": 131072},
}
# MLP activations by config name -> the `approximate` argument of torch's GELU (silu is the Llama one).
GELU_ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}
SLIDING, FULL = "sliding_attention", "full_attention"
# Llama-family models whose attention transformers restricts to a sliding window when the config
# asks (`window_switches`): Mistral (default window 4096), Mixtral and Phi-3 on every layer,
# Qwen2/Qwen3 on the layers from `max_window_layers` on and Qwen3-MoE on all, with use_sliding_window.
WINDOWED_ARCHITECTURES = ("mistral", "mixtral", "phi3", "qwen2", "qwen3", "qwen3_moe")


def check_phi3(cfg: dict[str, Any]) -> None:
    """Phi-3 variants whose attention is not the Llama one are refused by name rather than run
    wrong: partial rotary (Phi-4-mini) and LongRoPE's length-switched factors (the 128k models)."""
    factor = float(cfg.get("partial_rotary_factor", 1.0) or 1.0)
    if factor != 1.0:
        raise UserError(f"phi3 with partial_rotary_factor {factor} is not supported (rotary on the whole head only)")
    scaling = cfg.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    if kind not in (None, "default"):
        raise UserError(f"phi3 with rope_scaling {kind!r} (the long-context variants) is not supported")


def moe_switches(cfg: dict[str, Any]) -> dict[str, Any]:
    """The MoE fields of `ModelConfig` (Mixtral: always renormalized top-k; Qwen3-MoE: its
    `norm_topk_prob`), refusing by name the layouts the reference does not run."""
    model_type = cfg["model_type"]
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    top_k = cfg.get("num_experts_per_tok")
    if not experts or not top_k or not 0 < int(top_k) <= int(experts):
        raise UserError(f"{model_type}: needs num_local_experts/num_experts >= num_experts_per_tok >= 1 "
                        f"(got {experts!r} and {top_k!r})")
    if model_type == "qwen3_moe":
        if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1) or 1) != 1:
            raise UserError("qwen3_moe with dense layers among the MoE ones (mlp_only_layers / decoder_sparse_step "
                            "!= 1) is not supported: every layer must be a sparse MoE block")
        width = cfg.get("moe_intermediate_size")
        norm = bool(cfg.get("norm_topk_prob", False))
    else:
        width = cfg.get("intermediate_size")
        norm = True
    if not width:
        raise UserError(f"{model_type}: the experts' width (moe_intermediate_size) is missing")
    return {"num_experts": int(experts), "num_experts_per_tok": int(top_k), "moe_intermediate_size": int(width),
            "norm_topk_prob": norm}


def window_switches(cfg: dict[str, Any]) -> dict[str, Any]:
    """`sliding_window` and `layer_types` of a Mistral / Mixtral / Phi-3 / Qwen config, as
    transformers reads them: each query sees the `sliding_window` newest keys (itself included).
    A window no shorter than max_position_embeddings never excludes a key inside the model's
    positions, so it is dropped (plain causal attention: the fast paths and the compiled kernels)."""
    model_type = cfg["model_type"]
    num_layers = int(cfg["num_hidden_layers"])
    # transformers' defaults when config.json omits the key: 4096 for Mistral and the Qwens
    window = cfg.get("sliding_window", None if model_type in ("mixtral", "phi3") else 4096)
    if model_type.startswith("qwen") and not cfg.get("use_sliding_window", False):
        window = None
    if window is None or int(window) >= int(cfg.get("max_position_embeddings", 2048)):
        return {}
    if int(window) < 1:
        raise UserError(f"{model_type}: sliding_window must be positive (got {window!r})")
    if model_type in ("qwen2", "qwen3"):
        first = int(cfg.get("max_window_layers", 28))
        layer_types = cfg.get("layer_types") or [SLIDING if i >= first else FULL for i in range(num_layers)]
        if len(layer_types) != num_layers or set(layer_types) - {SLIDING, FULL}:
            raise UserError(f"{model_type}: layer_types must list {num_layers} entries of {SLIDING}/{FULL}")
    else:  # transformers applies one sliding mask to every layer of these (Mistral ignores layer_types)
        layer_types = [SLIDING] * num_layers
    if SLIDING not in layer_types:
        return {}
    return {"sliding_window": int(window), "layer_types": tuple(layer_types)}


def gemma_switches(cfg: dict[str, Any]) -> dict[str, Any]:
    """The Gemma fields of `ModelConfig` from a Gemma 2 / Gemma 3 text config (defaults merged in),
    refusing by name the variants whose execution differs from what the reference implements."""
    model_type = cfg["model_type"]
    if cfg.get("use_bidirectional_attention"):
        raise UserError(f"{model_type} with use_bidirectional_attention (EmbeddingGemma-style encoders) is not "
                        "supported: lmfoundry runs causal decoders")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in GELU_ACTIVATIONS:
        raise UserError(f"{model_type} with hidden_activation {act!r} is not supported "
                        f"(supported: {', '.join(GELU_ACTIVATIONS)})")
    num_layers = int(cfg["num_hidden_layers"])
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        # transformers' defaults: Gemma 2 alternates (sliding first), Gemma 3 has one full layer
        # per `sliding_window_pattern` (6) layers
        pattern = 2 if model_type == "gemma2" else int(cfg.get("sliding_window_pattern") or 6)
        layer_types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    layer_types = tuple(layer_types)
    unknown = sorted(set(layer_types) - {SLIDING, FULL})
    if unknown or len(layer_types) != num_layers:
        raise UserError(f"{model_type}: layer_types must list {num_layers} entries of {SLIDING}/{FULL} "
                        f"(got {len(layer_types)}{', unknown ' + ', '.join(map(str, unknown)) if unknown else ''})")
    window = cfg.get("sliding_window")
    if SLIDING in layer_types and (window is None or int(window) < 1):
        raise UserError(f"{model_type}: sliding_attention layers need a positive sliding_window (got {window!r})")

    def cap(key: str) -> float | None:
        value = cfg.get(key)
        if value is not None and float(value) <= 0:
            raise UserError(f"{model_type}: {key} must be positive or null (got {value!r})")
        return float(value) if value is not None else None

    if model_type == "gemma3_text":
        gemma3_rope_parameters(cfg)  # refuse a rope layout we do not read before any work
    return {
        "hidden_act": act,
        "norm_offset": 1.0,
        "embed_scale": float(cfg["hidden_size"]) ** 0.5,
        "sandwich_norms": True,
        "query_pre_attn_scalar": float(cfg["query_pre_attn_scalar"]),
        # transformers' Gemma 3 attention never applies attn_logit_softcapping (the field exists in
        # its config but is not passed to attention; every released Gemma 3 has it null): match it
        "attn_logit_softcapping": cap("attn_logit_softcapping") if model_type == "gemma2" else None,
        "final_logit_softcapping": cap("final_logit_softcapping"),
        "sliding_window": int(window) if window is not None else None,
        "layer_types": layer_types,
    }


def gemma3_rope_parameters(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Gemma 3's rope parameters per layer type, as transformers' Gemma3TextConfig reads them: the
    new layout `rope_parameters = {full_attention: {...}, sliding_attention: {...}}`, or the legacy
    keys `rope_theta` (+ `rope_scaling`) for full layers and `rope_local_base_freq` for sliding ones."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and params and not ({FULL, SLIDING} & set(params)):
        raise UserError("gemma3_text: rope_parameters must be keyed by full_attention/sliding_attention "
                        f"(got keys {sorted(params)})")
    params = params if isinstance(params, dict) else {}
    full = dict(params.get(FULL) or {"rope_type": "default"})
    local = dict(params.get(SLIDING) or {"rope_type": "default"})
    if not params.get(FULL) and isinstance(raw.get("rope_scaling"), dict):
        full.update({k: v for k, v in raw["rope_scaling"].items() if v is not None})
    full.setdefault("rope_theta", raw.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", raw.get("rope_local_base_freq", 10_000.0))
    return {FULL: full, SLIDING: local}
