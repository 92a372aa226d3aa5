"""The decoder configuration our execution code needs, read from a Hugging Face `config.json`.

Llama-family decoders (Llama, Mistral, Qwen2, Qwen3 dense, Phi-3) differ only in a few switches
(q/k/v bias, q/k RMSNorm, head_dim, rope scaling, which linears the checkpoint stores fused); this
dataclass names them so the rest of the code never looks at `model_type`.

Mixtral and Qwen3-MoE replace the MLP by a sparse mixture of experts: a float router picks the
top-k of `num_experts` gated MLPs (each `moe_intermediate_size` wide) per token and sums their
outputs weighted by the renormalized router probabilities. Every expert's linears are linears of
the layer (`mlp.experts.E.gate_proj`, ...); Mixtral's checkpoint names (`block_sparse_moe`,
w1/w3/w2) are read and written through `checkpoint_renames`.

Gemma 2 and Gemma 3 (text) are the same q/k/v/o + gated-MLP layer with more switches: RMSNorm
gains stored as `w` and applied as `1 + w`, the embedding scaled by sqrt(hidden_size), a norm after
attention and after the MLP as well as before each (`sandwich_norms`), a tanh-GELU MLP, the
attention scale from `query_pre_attn_scalar`, tanh soft-capping of attention scores (Gemma 2) and
of the final logits, sliding-window attention on some layers (`layer_types`), and for Gemma 3 a
second rope base for the sliding layers. Their defaults below are transformers' (a config.json
may leave out a field equal to it).

Mistral, Mixtral, Phi-3 and Qwen (with `use_sliding_window`) may restrict attention to a sliding
window too, read as transformers reads it (`window_switches`); every attention path honours it
through the same `AttentionSpec`, and the compiled kernels, which attend causally over everything,
serve such a model only up to its window (`kernel_context_limit`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from lmfoundry.errors import UserError
from lmfoundry.model.architectures import (
    FULL,
    GEMMA_DEFAULTS,
    SLIDING,
    WINDOWED_ARCHITECTURES,
    check_phi3,
    gemma3_rope_parameters,
    gemma_switches,
    moe_switches,
    window_switches,
)

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "mixtral",
                           "qwen3_moe")
GEMMA_ARCHITECTURES = ("gemma2", "gemma3_text")
MOE_ARCHITECTURES = ("mixtral", "qwen3_moe")
# The router of a sparse MoE block: a linear over the hidden state, kept in float (its top-k
# choice is discontinuous: a rounding error there swaps experts, not a few ulps of the output).
ROUTER = "mlp.gate"
# Written to the checkpoint's `ignore` for MoE models, in both namings (Mixtral's checkpoints and
# vLLM say `block_sparse_moe.gate`, transformers and Qwen3-MoE `mlp.gate`), so no loader quantizes it.
ROUTER_IGNORE = ("re:.*mlp[.]gate$", "re:.*block_sparse_moe[.]gate$")
# Mixtral's checkpoint names -> ours (Qwen3-MoE's, which are the dense MLP's under `experts.E`).
MIXTRAL_RENAMES = (("block_sparse_moe.", "mlp."), ("experts.{e}.w1.", "experts.{e}.gate_proj."),
                   ("experts.{e}.w3.", "experts.{e}.up_proj."), ("experts.{e}.w2.", "experts.{e}.down_proj."))


# The linears of one decoder layer, in execution order, and the groups of them that read the same
# input tensor, named by the fused module runtimes make of each group (vLLM's qkv_proj and
# gate_up_proj). The one statement of this structure: calibration collects a group's input
# statistics once, the quantizers fold scales into the norm that feeds a group, compile fuses a
# group into one GEMM, and the doctor checks that a group shares one scheme.
LAYER_LINEARS: tuple[str, ...] = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)
FUSED_LINEARS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
QKV, GATE_UP = FUSED_LINEARS["self_attn.qkv_proj"], FUSED_LINEARS["mlp.gate_up_proj"]


def input_groups(names: list[str] | tuple[str, ...]) -> list[tuple[str, ...]]:
    """Partition `names` (local linear names) into groups sharing one input, in layer order; a
    linear that reads its own input is its own group. The first name of each group is the one
    whose input calibration hooks. The fused groups apply under any parent module, so each MoE
    expert's gate/up (`mlp.experts.E.gate_proj`, `.up_proj`) is a group of its own: an expert
    reads only the tokens routed to it."""
    remaining = list(names)
    groups: list[tuple[str, ...]] = []
    parents = list(dict.fromkeys(n.rsplit(".", 1)[0] for n in names))
    for parent in parents:
        for shared in FUSED_LINEARS.values():
            members = tuple(m for m in (f"{parent}.{n.rsplit('.', 1)[1]}" for n in shared) if m in remaining)
            if members:
                groups.append(members)
                for n in members:
                    remaining.remove(n)
    groups += [(n,) for n in remaining]
    order = {n: i for i, n in enumerate(names)}
    return sorted(groups, key=lambda g: min(order[n] for n in g))


# Bounds of the sizes a config.json may declare: far above any released model, low enough that no
# loop or allocation sized by them (the doctor walks the layers, the loader builds them) runs away.
SIZE_LIMITS = {"vocab_size": 1 << 22, "hidden_size": 1 << 17, "intermediate_size": 1 << 20,
               "num_hidden_layers": 1 << 12, "num_attention_heads": 1 << 12, "num_key_value_heads": 1 << 12,
               "head_dim": 1 << 12, "max_position_embeddings": 1 << 24}


def _checked_int(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    """cfg[key] as a positive integer within SIZE_LIMITS, or a one-line UserError naming it (a
    string, float, bool, zero or negative size would otherwise fail deep inside, or silently)."""
    if cfg.get(key) is None:
        if default is None:
            raise UserError(f"config.json: {key} is missing (a positive integer is required)")
        return default
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"config.json: {key} must be a positive integer, got {json.dumps(value)[:40]}")
    if not 1 <= value <= SIZE_LIMITS[key]:
        raise UserError(f"config.json: {key} must be in [1, {SIZE_LIMITS[key]}], got {value}")
    return value


def _checked_float(cfg: dict[str, Any], key: str, default: float) -> float:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise UserError(f"config.json: {key} must be a number in (0, 1), got {json.dumps(value)[:40]}")
    return float(value)


def _checked_sizes(cfg: dict[str, Any]) -> dict[str, int]:
    """The model's sizes, each a bounded positive integer, and the divisions attention needs."""
    out = {k: _checked_int(cfg, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                              "num_hidden_layers", "num_attention_heads")}
    heads, hidden = out["num_attention_heads"], out["hidden_size"]
    out["num_key_value_heads"] = _checked_int(cfg, "num_key_value_heads", heads)
    if heads % out["num_key_value_heads"]:
        raise UserError(f"config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                        f"{out['num_key_value_heads']}")
    if cfg.get("head_dim") is None and hidden % heads:
        raise UserError(f"config.json: hidden_size {hidden} is not a multiple of num_attention_heads {heads} "
                        "(and no head_dim is given)")
    out["head_dim"] = _checked_int(cfg, "head_dim", hidden // heads)
    out["max_position_embeddings"] = _checked_int(cfg, "max_position_embeddings", 2048)
    return out


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    torch_dtype: str
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    raw: dict[str, Any] = field(repr=False, default_factory=dict)
    # --- Gemma switches (their defaults are the Llama behaviour)
    hidden_act: str = "silu"
    norm_offset: float = 0.0  # RMSNorm applies (norm_offset + weight): Gemma stores w of (1 + w)
    embed_scale: float | None = None  # embeddings multiplied by this (in the model dtype): Gemma's sqrt(H)
    sandwich_norms: bool = False  # post_attention/post_feedforward norms on the branch outputs (Gemma)
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (None: head_dim)
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap) before the mask
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    sliding_window: int | None = None  # keys within this many positions of the query (itself included)
    layer_types: tuple[str, ...] = ()  # per layer SLIDING or FULL; empty: every layer full attention
    # --- sparse MoE (Mixtral, Qwen3-MoE): 0 experts is a dense MLP
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalize the top-k router probabilities to sum to 1

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        model_type = cfg.get("model_type", "?")
        if model_type not in SUPPORTED_ARCHITECTURES:
            archs = ",".join(cfg.get("architectures") or []) or model_type
            if model_type == "gemma3":  # the image-text wrapper whose text_config is a gemma3_text
                raise UserError(f"unsupported architecture {archs} (model_type 'gemma3': Gemma 3 with its vision "
                                "tower); text-only Gemma 3 checkpoints (Gemma3ForCausalLM, model_type "
                                "'gemma3_text', e.g. gemma-3-1b) are supported")
            raise UserError(
                f"unsupported architecture {archs} (model_type {model_type!r}); "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)} (dense Llama-family and Gemma 2/3 text decoders)"
            )
        if model_type == "phi3":
            check_phi3(cfg)
        switches: dict[str, Any] = {}  # the fields of a family beyond the Llama layer
        if model_type in MOE_ARCHITECTURES:
            switches = moe_switches(cfg)
        if model_type in GEMMA_ARCHITECTURES:
            cfg = {**GEMMA_DEFAULTS[model_type], **cfg}
            switches = gemma_switches(cfg)
        if model_type in WINDOWED_ARCHITECTURES:
            switches.update(window_switches(cfg))
        sizes = _checked_sizes(cfg)
        num_heads, hidden = sizes["num_attention_heads"], sizes["hidden_size"]
        attention_bias = bool(cfg.get("attention_bias", False))
        dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        return cls(
            model_type=model_type,
            vocab_size=sizes["vocab_size"],
            hidden_size=hidden,
            intermediate_size=sizes["intermediate_size"],
            num_layers=sizes["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=sizes["num_key_value_heads"],
            head_dim=sizes["head_dim"],
            rms_norm_eps=_checked_float(cfg, "rms_norm_eps", 1e-6),
            max_position_embeddings=sizes["max_position_embeddings"],
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias; Llama/Mistral/Qwen3 only with attention_bias.
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            torch_dtype=str(dtype).replace("torch.", ""),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            raw=dict(cfg),
            **switches,
        )

    # ------------------------------------------------------------------ per-layer attention
    @property
    def attention_scale(self) -> float:
        """Multiplier of q·k: query_pre_attn_scalar^-1/2 (Gemma), else head_dim^-1/2."""
        return float(self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim) ** -0.5

    def layer_window(self, idx: int) -> int | None:
        """The sliding window of layer `idx` (None: full causal attention)."""
        if self.layer_types and self.layer_types[idx] == SLIDING:
            return self.sliding_window
        return None

    @property
    def rope_kinds(self) -> tuple[str, ...]:
        """The rotary tables the model uses, in the order `RotaryEmbedding` concatenates them:
        Gemma 3 has one for full-attention layers and one (its local base) for sliding layers;
        every other model one table for all layers."""
        return (FULL, SLIDING) if self.model_type == "gemma3_text" else (FULL,)

    def layer_rope(self, idx: int) -> int:
        """Index in `rope_kinds` of the rotary table layer `idx` reads."""
        if len(self.rope_kinds) == 1:
            return 0
        return self.rope_kinds.index(self.layer_types[idx] if self.layer_types else FULL)

    @property
    def needs_attention_spec(self) -> bool:
        """Whether attention differs from plain causal softmax(q·k / sqrt(head_dim)) anywhere: then
        every attention context must honour the layer's `AttentionSpec` (scale, soft-cap, window)."""
        return (self.query_pre_attn_scalar is not None or self.attn_logit_softcapping is not None
                or any(self.layer_window(i) is not None for i in range(self.num_layers)))

    @property
    def kernel_context_limit(self) -> int:
        """The longest context the compiled-kernel path computes exactly. Its paged attention is
        plain causal, which equals a sliding window of W while a sequence holds at most W tokens:
        a windowed Mistral/Qwen bundle serves up to its smallest window, not past it."""
        windows = [w for w in (self.layer_window(i) for i in range(self.num_layers)) if w is not None]
        return min([self.max_position_embeddings, *windows])

    def kernel_path_refusal(self) -> str | None:
        """Why the compiled-kernel path (engine bundles, `KernelModel`) cannot run this model, or
        None. Its fused kernels implement the Llama layer only: RMSNorm gains without the +1,
        SiLU, no sandwich norms, plain causal paged attention without soft-capping or windows."""
        if self.is_moe:
            return (f"{self.model_type} (mixture of experts) has no compiled-kernel path: the kernels have no "
                    "router or grouped expert GEMM; serve the checkpoint folder itself (the PyTorch reference "
                    "engine) instead of a bundle")
        if self.model_type in GEMMA_ARCHITECTURES:
            return (f"{self.model_type} (Gemma) has no compiled-kernel path: its (1 + w) norms, post-branch "
                    "norms, GELU MLP, attention soft-capping and sliding windows are not in the kernels; "
                    "serve the checkpoint folder itself (the PyTorch reference engine) instead of a bundle")
        return None

    @property
    def checkpoint_fused(self) -> dict[str, tuple[str, ...]]:
        """Fused module name -> its linears, for checkpoints that store a group as one tensor
        (Phi-3's qkv_proj and gate_up_proj). Everything in lmfoundry works on the separate
        linears; `CheckpointReader` splits such tensors on read and `fuse_checkpoint_linears`
        joins them on write, so vLLM and transformers find the names they expect."""
        return dict(FUSED_LINEARS) if self.model_type == "phi3" else {}

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def mlp_prefixes(self) -> tuple[str, ...]:
        """The local prefix of each gated MLP of a layer: every expert's in an MoE layer
        (`mlp.experts.E.`), else the one `mlp.`. Each has gate_proj, up_proj and down_proj."""
        return tuple(f"mlp.experts.{e}." for e in range(self.num_experts)) if self.is_moe else ("mlp.",)

    @property
    def mlp_width(self) -> int:
        """The intermediate width of each of those MLPs (an expert's in an MoE layer)."""
        return self.moe_intermediate_size if self.is_moe else self.intermediate_size

    @property
    def checkpoint_renames(self) -> tuple[tuple[str, str], ...]:
        """(checkpoint infix, our infix) pairs, "{e}" standing for an expert index: what
        `CheckpointReader` renames on read and `checkpoint_names` renames back on write."""
        return MIXTRAL_RENAMES if self.model_type == "mixtral" else ()

    def our_name(self, stored: str) -> str:
        """A checkpoint tensor name in our naming (`checkpoint_renames`)."""
        return _rename(stored, [(a, b) for a, b in self.checkpoint_renames])

    def stored_name(self, ours: str) -> str:
        """One of our tensor names as this architecture's checkpoints spell it."""
        return _rename(ours, [(b, a) for a, b in reversed(self.checkpoint_renames)])

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise UserError(f"{path}: no config.json (expected a Hugging Face model folder)")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_dict(cfg)

    @property
    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(out_features, in_features) of each quantizable linear in one decoder layer, by local
        name, in execution order: an MoE layer lists every expert's gate/up/down (the router,
        kept in float, is not among them)."""
        h, i, d = self.hidden_size, self.mlp_width, self.head_dim
        shapes = {
            "self_attn.q_proj": (self.num_heads * d, h),
            "self_attn.k_proj": (self.num_kv_heads * d, h),
            "self_attn.v_proj": (self.num_kv_heads * d, h),
            "self_attn.o_proj": (h, self.num_heads * d),
        }
        for p in self.mlp_prefixes:
            shapes.update({p + "gate_proj": (i, h), p + "up_proj": (i, h), p + "down_proj": (h, i)})
        return shapes

    @property
    def rope(self) -> tuple[float, str]:
        """(base theta, rope type) from either config style: transformers 5's `rope_parameters`
        or the older top-level `rope_theta` with `rope_scaling`. Gemma 3: its full-attention
        layers' (the sliding layers' table is `rope_inv_freq("sliding_attention")`)."""
        if self.model_type == "gemma3_text":
            full = gemma3_rope_parameters(self.raw)[FULL]
            return float(full["rope_theta"]), str(full.get("rope_type", full.get("type")) or "default")
        params = dict(self.raw.get("rope_parameters") or {})
        scaling = self.raw.get("rope_scaling") or {}
        params.update({k: v for k, v in scaling.items() if v is not None})
        theta = float(params.get("rope_theta", self.raw.get("rope_theta", 10000.0)))
        return theta, str(params.get("rope_type", params.get("type")) or "default")

    def rope_inv_freq(self, kind: str = FULL):
        """Inverse rotary frequencies and attention scaling of the rotary table `kind` (one of
        `rope_kinds`: Gemma 3's sliding layers have their own base), honouring the rope type."""
        import torch

        if kind == FULL:
            theta, rope_type = self.rope
        else:
            params = gemma3_rope_parameters(self.raw)[kind]
            theta, rope_type = float(params["rope_theta"]), str(params.get("rope_type", params.get("type")) or "default")
        if rope_type == "default":  # on the CPU even where the model is being built on meta (see below)
            exponent = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device="cpu").float() / self.head_dim
            return 1.0 / (theta**exponent), 1.0
        from transformers import AutoConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise UserError(f"unsupported rope type {rope_type!r}")
        hf_cfg = AutoConfig.for_model(**self.raw)
        # real tensors even where the model is being built on the meta device (the loader does): a
        # meta tensor's arithmetic runs through torch._refs, which imports TorchDynamo for good
        with torch.device("cpu"):
            if self.model_type == "gemma3_text":  # rope parameters per layer type
                inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, "cpu", layer_type=kind)
            else:
                inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, "cpu")
        return inv_freq.float(), float(scale)


def _rename(name: str, pairs: list[tuple[str, str]]) -> str:
    """Apply each (from, to) infix replacement in turn; "{e}" matches and keeps an expert index.
    A module name (no tensor leaf after it) is renamed like its tensors."""
    import re

    def replacement(dst: str) -> Callable[[re.Match[str]], str]:
        return lambda m: dst.replace("{e}", m.group(1)) if m.groups() else dst

    name += "."
    for src, dst in pairs:
        pattern = re.escape(src).replace(re.escape("{e}"), r"(\d+)")
        name = re.sub(pattern, replacement(dst), name)
    return name[:-1]
