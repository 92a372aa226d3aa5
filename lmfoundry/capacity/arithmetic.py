"""The arithmetic behind `lmfoundry plan` (the memory plan): parameters, weight bytes, KV bytes,
memory fit and cost.

Kept apart from the inputs and the report (`lmfoundry.capacity.inputs`, `lmfoundry.capacity.report`)
so that every number can be checked by hand in tests, and so that nothing here imports torch:
planning has to work on a laptop before anyone rents a GPU.

Conventions (all documented in `lmfoundry plan --help` too):
- Byte counts are exact integers for the layouts described; memory is reported in GiB (2**30).
- Quantized weights cover the seven linears of every decoder layer (q/k/v/o, gate/up/down).
  Embeddings, norms and biases stay 16-bit; lm_head stays 16-bit unless the checkpoint quantized it.
- Scales are 16-bit (compressed-tensors stores them in the model dtype); asymmetric schemes add a
  zero point per scale, packed at the weight's bit width.
- Tensor parallel (tp) shards column-parallel linears (q/k/v/gate/up) by output rows, row-parallel
  linears (o/down) by input columns, and embeddings/lm_head by vocabulary rows; norms and row-parallel
  biases are replicated. KV heads are split across GPUs; when tp > kv_heads every GPU keeps one KV
  head (each head replicated tp / kv_heads times), so KV memory per GPU stops shrinking.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lmfoundry.errors import UserError
from lmfoundry.model.config import ModelConfig
from lmfoundry.model.head_split import HeadSplit, split_heads

WEIGHT_PRECISIONS = ("bf16", "fp8", "int8", "int4")
KV_DTYPE_BYTES = {"bf16": 2, "fp8": 1, "int8": 1}
SCALE_BYTES = 2
HOURS_PER_MONTH = 730.0  # 365 * 24 / 12
UTILIZATIONS = (0.2, 0.5, 0.8, 1.0)
# vLLM's default cap on concurrently scheduled sequences; sizes the fp32 logits buffer of one step.
DEFAULT_MAX_NUM_SEQS = 256
GIB = 1 << 30


@dataclass(frozen=True)
class QuantSpec:
    """How one precision stores a linear weight: bits, scale layout and extra tensors.

    `strategy` is "none" (16-bit), "tensor", "channel" (one scale per output row), "group" (one per
    `group_size` input columns of each row) or "block" (one per `block` tile). `zero_points` is set
    for asymmetric schemes and for formats that always store them (GPTQ/AWQ); `g_idx` for formats
    that store an int32 group index per input column (GPTQ, compressed-tensors act-order "group").
    """

    precision: str
    bits: int
    strategy: str
    group_size: int | None = None
    block: tuple[int, int] | None = None
    zero_points: bool = False
    g_idx: bool = False

    def describe(self) -> str:
        if self.strategy == "none":
            return "16-bit"
        layout = {
            "tensor": "per-tensor scale",
            "channel": "per-channel scales",
            "group": f"group {self.group_size}",
            "block": f"block {self.block[0]}x{self.block[1]}" if self.block else "block",
        }[self.strategy]
        extras = ["asymmetric" if self.zero_points else "symmetric"]
        if self.g_idx:
            extras.append("g_idx")
        return f"{self.bits}-bit, {layout}, {', '.join(extras)}, 16-bit scales"

    def num_scales(self, out_features: int, in_features: int) -> int:
        if self.strategy == "tensor":
            return 1
        if self.strategy == "channel":
            return out_features
        if self.strategy == "group":
            assert self.group_size is not None  # a "group" spec carries its group size
            return out_features * math.ceil(in_features / self.group_size)
        if self.strategy == "block":
            assert self.block is not None  # a "block" spec carries its tile
            rows, cols = self.block
            return math.ceil(out_features / rows) * math.ceil(in_features / cols)
        raise ValueError(f"no scales for strategy {self.strategy!r}")

    def linear_bytes(self, out_features: int, in_features: int) -> int:
        """Stored bytes of one (out, in) weight with its scales, zero points and g_idx."""
        if self.strategy == "none":
            return out_features * in_features * 2
        if self.bits == 8:
            packed = out_features * in_features
        else:  # sub-byte values are packed into int32 words along each row
            packed = out_features * math.ceil(in_features * self.bits / 32) * 4
        scales = self.num_scales(out_features, in_features)
        total = packed + scales * SCALE_BYTES
        if self.zero_points:
            total += math.ceil(scales * self.bits / 8)
        if self.g_idx:
            total += in_features * 4
        return total


def default_quant_specs(group_size: int | None = None, asymmetric: bool = False) -> dict[str, QuantSpec]:
    """The layout each precision is counted with unless a checkpoint says otherwise.

    int4: group 128 symmetric (the usual W4A16); int8 and fp8: per-channel (W8A8/W8A16 presets).
    `group_size` (0 = per-channel) and `asymmetric` apply to the integer precisions.
    """

    def int_spec(bits: int, default_group: int | None) -> QuantSpec:
        g = default_group if group_size is None else group_size
        if g:
            return QuantSpec(f"int{bits}", bits, "group", group_size=g, zero_points=asymmetric)
        return QuantSpec(f"int{bits}", bits, "channel", zero_points=asymmetric)

    return {
        "bf16": QuantSpec("bf16", 16, "none"),
        "fp8": QuantSpec("fp8", 8, "channel"),
        "int8": int_spec(8, None),
        "int4": int_spec(4, 128),
    }


def sharding(cfg: ModelConfig, tp: int) -> HeadSplit:
    """Validate `tp` against the model's heads and split them: the rules vLLM applies, which the
    runtime's tensor parallelism follows (`lmfoundry.model.head_split`); a rank is one GPU here."""
    return split_heads(cfg, tp)


def linear_in_features(cfg: ModelConfig, tp: int) -> list[tuple[str, int]]:
    """Input width of each kind of linear on one GPU (what a quantization group must divide)."""
    shard = sharding(cfg, tp)
    h = cfg.hidden_size
    return [
        ("qkv/gate/up", h),
        ("o_proj", shard.heads_per_rank * cfg.head_dim),
        ("down_proj", cfg.mlp_width // tp),
    ]


def _shard_shapes(cfg: ModelConfig, shard: HeadSplit) -> dict[str, tuple[int, int]]:
    """(out, in) of each linear on one GPU."""
    tp, d, h, i = shard.tp, cfg.head_dim, cfg.hidden_size, cfg.mlp_width
    shapes = {
        "self_attn.q_proj": (shard.heads_per_rank * d, h),
        "self_attn.k_proj": (shard.kv_heads_per_rank * d, h),
        "self_attn.v_proj": (shard.kv_heads_per_rank * d, h),
        "self_attn.o_proj": (h, shard.heads_per_rank * d),
    }
    for p in cfg.mlp_prefixes:  # tensor parallel splits every expert's width alike (vLLM's fused MoE)
        shapes.update({p + "gate_proj": (i // tp, h), p + "up_proj": (i // tp, h), p + "down_proj": (h, i // tp)})
    return shapes


def weight_bytes(
    cfg: ModelConfig, spec: QuantSpec, tp: int = 1, quantize_lm_head: bool | QuantSpec = False, active: bool = False
) -> dict[str, int]:
    """Stored weight bytes on one GPU at tensor-parallel size `tp`, by part (tp=1: the whole model).
    An MoE router stays 16-bit and replicated. `active`: only the top-k experts one token reads
    (what a batch-1 decode step streams from memory). `quantize_lm_head`: the head is stored as
    `spec` (True) or as a spec of its own."""
    shard = sharding(cfg, tp)
    h, d, L = cfg.hidden_size, cfg.head_dim, cfg.num_layers
    shapes = _shard_shapes(cfg, shard)
    attn = sum(spec.linear_bytes(o, i) for n, (o, i) in shapes.items() if n.startswith("self_attn"))
    mlp = sum(spec.linear_bytes(o, i) for n, (o, i) in shapes.items() if n.startswith("mlp"))
    # 16-bit extras: column-parallel biases are sharded, row-parallel ones replicated.
    if cfg.qkv_bias:
        attn += (shard.heads_per_rank + 2 * shard.kv_heads_per_rank) * d * 2
    if cfg.o_bias:
        attn += h * 2
    if cfg.qk_norm:
        attn += 2 * d * 2
    if cfg.mlp_bias:
        mlp += (2 * (cfg.intermediate_size // tp) + h) * 2
    if cfg.is_moe:
        if active:
            mlp = mlp * cfg.num_experts_per_tok // cfg.num_experts
        mlp += cfg.num_experts * h * 2
    vocab_rows = math.ceil(cfg.vocab_size / tp)
    embeddings = vocab_rows * h * 2
    if cfg.tie_word_embeddings:
        lm_head = 0
    elif quantize_lm_head:
        lm_head = (spec if quantize_lm_head is True else quantize_lm_head).linear_bytes(vocab_rows, h)
    else:
        lm_head = vocab_rows * h * 2
    parts = {
        "embeddings": embeddings,
        "attention": attn * L,
        "mlp": mlp * L,
        "norms": (2 * h * L + h) * 2,
        "lm_head": lm_head,
    }
    parts["total"] = sum(parts.values())
    return parts


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str, tp: int = 1) -> int:
    """2 (K and V) x layers x KV heads on one GPU x head_dim x bytes per element.

    fp8/int8 caches use per-tensor scales, which are negligible and not counted.
    """
    if kv_dtype not in KV_DTYPE_BYTES:
        raise UserError(f"unknown KV dtype {kv_dtype!r}; choose from {', '.join(KV_DTYPE_BYTES)}")
    shard = sharding(cfg, tp)
    return 2 * cfg.num_layers * shard.kv_heads_per_rank * cfg.head_dim * KV_DTYPE_BYTES[kv_dtype]


def activation_bytes(
    cfg: ModelConfig, tp: int, batch_tokens: int, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
) -> int:
    """Peak 16-bit activation workspace of one forward step over `batch_tokens` tokens, per GPU.

    The larger of the attention stage (residual, normed input, q/k/v, attention output) and the MLP
    stage (residual, normed input, gate+up output, activated product), plus the fp32 logits of the
    sampled rows. An estimate of what an engine such as vLLM profiles before sizing its KV cache.
    """
    shard = sharding(cfg, tp)
    h, d = cfg.hidden_size, cfg.head_dim
    attn = 2 * h + (shard.heads_per_rank + 2 * shard.kv_heads_per_rank) * d + shard.heads_per_rank * d
    # an MoE token's gate+up and product in each of its top-k experts, plus the router's scores
    routed = max(1, cfg.num_experts_per_tok)
    mlp = 2 * h + 3 * routed * (cfg.mlp_width // tp) + cfg.num_experts
    logits = min(batch_tokens, max_num_seqs) * cfg.vocab_size * 4
    return batch_tokens * max(attn, mlp) * 2 + logits


def lora_bytes(cfg: ModelConfig, max_loras: int, max_rank: int, element_bytes: int = 2) -> int:
    """The stacked LoRA weights the runtime allocates at start (`runtime/engine/lora_adapters.py`): for each
    of `max_loras` slots and every layer's seven linears, A [max_rank, in] and B [out, max_rank] in
    the model dtype (zero padded to max_rank whatever an adapter's rank), whether a slot is used."""
    per_layer = sum(out + in_ for out, in_ in cfg.linear_shapes.values())
    return max_loras * max_rank * cfg.num_layers * per_layer * element_bytes


@dataclass(frozen=True)
class MemoryFit:
    """One GPU's memory budget and how many full-context sequences its KV cache holds."""

    gpu_bytes: int
    usable_bytes: int
    weight_bytes: int
    activation_bytes: int
    overhead_bytes: int
    kv_room_bytes: int
    kv_bytes_per_token: int
    kv_bytes_per_sequence: int
    kv_tokens: int
    max_sequences: int

    @property
    def fits(self) -> bool:
        return self.max_sequences >= 1


def memory_fit(
    gpu_bytes: int,
    gpu_util: float,
    weight_bytes_per_gpu: int,
    activation_bytes_per_gpu: int,
    overhead_bytes: int,
    kv_bytes_per_token_per_gpu: int,
    context: int,
) -> MemoryFit:
    """Sequences that fit: (memory x util - weights - activations - overhead) // KV per sequence."""
    usable = int(gpu_bytes * gpu_util)
    room = usable - weight_bytes_per_gpu - activation_bytes_per_gpu - overhead_bytes
    per_seq = kv_bytes_per_token_per_gpu * context
    return MemoryFit(
        gpu_bytes=gpu_bytes,
        usable_bytes=usable,
        weight_bytes=weight_bytes_per_gpu,
        activation_bytes=activation_bytes_per_gpu,
        overhead_bytes=overhead_bytes,
        kv_room_bytes=room,
        kv_bytes_per_token=kv_bytes_per_token_per_gpu,
        kv_bytes_per_sequence=per_seq,
        kv_tokens=max(room, 0) // kv_bytes_per_token_per_gpu,
        max_sequences=max(room, 0) // per_seq,
    )


@dataclass(frozen=True)
class CapacityEstimate:
    """Cost of one deployment (tp GPUs) producing `throughput` output tokens/s when busy."""

    throughput: float  # output tokens/s of the whole deployment at full load
    gpu_hour_price: float  # per GPU
    gpus: int
    api_price: float | None  # per million tokens

    @property
    def hourly(self) -> float:
        return self.gpu_hour_price * self.gpus

    @property
    def monthly(self) -> float:
        """Always-on cost for a month."""
        return self.hourly * HOURS_PER_MONTH

    @property
    def monthly_capacity_tokens(self) -> float:
        return self.throughput * 3600.0 * HOURS_PER_MONTH

    def cost_per_million(self, utilization: float) -> float:
        """Price per million output tokens when the deployment is busy `utilization` of the time."""
        return self.hourly / (self.throughput * 3600.0 * utilization) * 1e6

    @property
    def breakeven_tokens_per_month(self) -> float | None:
        """Monthly volume at which the always-on deployment costs what the API would."""
        if self.api_price is None:
            return None
        return self.monthly / self.api_price * 1e6

    @property
    def breakeven_utilization(self) -> float | None:
        be = self.breakeven_tokens_per_month
        return None if be is None else be / self.monthly_capacity_tokens

    def advice(self) -> str:
        """One sentence: self-host or API, from the break-even utilization."""
        if self.api_price is None:
            return ""
        be, util = self.breakeven_tokens_per_month, self.breakeven_utilization
        assert be is not None and util is not None  # both set whenever api_price is
        full = self.cost_per_million(1.0)
        if util > 1.0:
            return (
                f"Use the API: even 100% busy this deployment costs ${full:.2f} per million output "
                f"tokens, more than the API's ${self.api_price:.2f}."
            )
        if util > 0.8:
            return (
                f"Use the API unless you can keep this deployment above {util:.0%} busy "
                f"({human_count(be)} output tokens a month): below that the API's "
                f"${self.api_price:.2f}/M is cheaper."
            )
        return (
            f"Self-host if you generate more than {human_count(be)} output tokens a month "
            f"({util:.0%} of this deployment's capacity); below that the API's "
            f"${self.api_price:.2f}/M is cheaper."
        )


def human_count(n: float) -> str:
    """1234567 -> '1.23 M' (decimal units for token volumes and parameter counts)."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f}"
