"""The decoder configuration our execution code needs, read from a Hugging Face `config.json`.

Llama-family decoders (Llama, Mistral, Qwen2, Qwen3 dense, Phi-3) differ only in a few switches
(q/k/v bias, q/k RMSNorm, head_dim, rope scaling, which linears the checkpoint stores fused); this
dataclass names them so the rest of the code never looks at `model_type`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmfoundry.errors import UserError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3")

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
    whose input calibration hooks."""
    remaining = list(names)
    groups: list[tuple[str, ...]] = []
    for shared in FUSED_LINEARS.values():
        members = tuple(n for n in shared if n in remaining)
        if members:
            groups.append(members)
            for n in members:
                remaining.remove(n)
    groups += [(n,) for n in remaining]
    order = {n: i for i, n in enumerate(names)}
    return sorted(groups, key=lambda g: min(order[n] for n in g))


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

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        model_type = cfg.get("model_type", "?")
        if model_type not in SUPPORTED_ARCHITECTURES:
            archs = ",".join(cfg.get("architectures") or []) or model_type
            raise UserError(
                f"unsupported architecture {archs} (model_type {model_type!r}); "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)} (dense Llama-family decoders)"
            )
        if model_type == "phi3":
            _check_phi3(cfg)
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        attention_bias = bool(cfg.get("attention_bias", False))
        dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias; Llama/Mistral/Qwen3 only with attention_bias.
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            torch_dtype=str(dtype).replace("torch.", ""),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            raw=dict(cfg),
        )

    @property
    def checkpoint_fused(self) -> dict[str, tuple[str, ...]]:
        """Fused module name -> its linears, for checkpoints that store a group as one tensor
        (Phi-3's qkv_proj and gate_up_proj). Everything in lmfoundry works on the separate
        linears; `CheckpointReader` splits such tensors on read and `fuse_checkpoint_linears`
        joins them on write, so vLLM and transformers find the names they expect."""
        return dict(FUSED_LINEARS) if self.model_type == "phi3" else {}

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
        """(out_features, in_features) of each linear in one decoder layer, by local name."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        return {
            "self_attn.q_proj": (self.num_heads * d, h),
            "self_attn.k_proj": (self.num_kv_heads * d, h),
            "self_attn.v_proj": (self.num_kv_heads * d, h),
            "self_attn.o_proj": (h, self.num_heads * d),
            "mlp.gate_proj": (i, h),
            "mlp.up_proj": (i, h),
            "mlp.down_proj": (h, i),
        }

    def rope_inv_freq(self):
        """Inverse rotary frequencies and attention scaling, honouring the config's rope type."""
        import torch

        params = dict(self.raw.get("rope_parameters") or {})
        scaling = self.raw.get("rope_scaling") or {}
        params.update({k: v for k, v in scaling.items() if v is not None})
        theta = float(params.get("rope_theta", self.raw.get("rope_theta", 10000.0)))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type in (None, "default"):
            exponent = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
            return 1.0 / (theta**exponent), 1.0
        from transformers import AutoConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise UserError(f"unsupported rope type {rope_type!r}")
        hf_cfg = AutoConfig.for_model(**self.raw)
        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, "cpu")
        return inv_freq.float(), float(scale)


def _check_phi3(cfg: dict[str, Any]) -> None:
    """Phi-3 variants whose attention is not the Llama one are refused by name rather than run
    wrong: partial rotary (Phi-4-mini) and LongRoPE's length-switched factors (the 128k models)."""
    factor = float(cfg.get("partial_rotary_factor", 1.0) or 1.0)
    if factor != 1.0:
        raise UserError(f"phi3 with partial_rotary_factor {factor} is not supported (rotary on the whole head only)")
    scaling = cfg.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    if kind not in (None, "default"):
        raise UserError(f"phi3 with rope_scaling {kind!r} (the long-context variants) is not supported")
