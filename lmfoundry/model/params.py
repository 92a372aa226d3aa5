"""How many parameters a model has, by part, from its config alone.

Below the stages that need it: `plan`'s memory and cost arithmetic (capacity, a verb's layer)
and eval-gate's memory plan (evals) both count a model's weights before loading it, and evals may
not import the verbs' layer.
"""

from __future__ import annotations

from lmfoundry.model.config import ModelConfig


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Parameters by part; tied embeddings are counted once (lm_head = 0). An MoE layer's "mlp"
    holds every expert and the router; "active" is what one token runs through (its top-k experts),
    the number that sets decode's weight traffic per token."""
    h, d, L = cfg.hidden_size, cfg.head_dim, cfg.num_layers
    embeddings = cfg.vocab_size * h
    lm_head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    attn = sum(o * i for name, (o, i) in cfg.linear_shapes.items() if name.startswith("self_attn"))
    if cfg.qkv_bias:
        attn += (cfg.num_heads + 2 * cfg.num_kv_heads) * d
    if cfg.o_bias:
        attn += h
    if cfg.qk_norm:
        attn += 2 * d
    mlp = sum(o * i for name, (o, i) in cfg.linear_shapes.items() if name.startswith("mlp"))
    if cfg.mlp_bias:
        mlp += 2 * cfg.intermediate_size + h
    router = cfg.num_experts * h
    idle_experts = (mlp // cfg.num_experts) * (cfg.num_experts - cfg.num_experts_per_tok) if cfg.is_moe else 0
    norms = 2 * h * L + h
    counts = {
        "embeddings": embeddings,
        "attention": attn * L,
        "mlp": (mlp + router) * L,
        "norms": norms,
        "lm_head": lm_head,
    }
    counts["total"] = sum(counts.values())
    counts["active"] = counts["total"] - idle_experts * L
    return counts
