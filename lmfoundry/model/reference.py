"""The reference execution of a Llama-family, Gemma 2/3 or sparse-MoE (Mixtral, Qwen3-MoE)
decoder, as plain `nn.Module`s (gpt-fast style).

This one implementation is used everywhere a model runs: by the layer-wise calibration pipeline
(one `DecoderLayer` at a time), by perplexity and eval-gate, and by the serving runtime (which
passes an `AttentionContext` to run attention over its paged KV cache). State-dict names equal the
Hugging Face names, so checkpoints load without a renaming table.

Quantized linears are swapped in by `lmfoundry.runtime.loader` (the runtime module swap is a
separate, explicit step from the offline artifact).

Gemma's differences are switches of `ModelConfig` read here: (1 + w) norm gains, the scaled
embedding, the post-branch ("sandwich") norms, the GELU MLP, and an `AttentionSpec` per layer
(scale, score soft-cap, sliding window) that every attention path must honour. Gemma 3's two rope
bases travel as one table of 2 * head_dim columns (`RotaryEmbedding`), of which each layer reads
its half: that keeps the (cos, sin) pair every caller already passes layer by layer. The rotary
table, the attention rules and the attention functions themselves are attention_math.py's.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from lmfoundry.model.attention_math import (
    AttentionSpec,
    RotaryEmbedding,
    apply_rotary,
    building_on_meta,
    causal_attention,
    spec_attention,
)
from lmfoundry.model.config import ModelConfig
from lmfoundry.model.kv_quant import KVRoundTrip


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, as Hugging Face's Llama does.

    With `offset` 1 it is Gemma's: the stored weight w is applied as (1 + w), in float32 before the
    cast back ("(x * w).to(dtype)", where Llama casts first and multiplies in the model dtype)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:
            return (F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * (self.offset + self.weight.float())).to(x.dtype)
        if x.dtype == self.weight.dtype == torch.float32:  # one fused op, same float32 result
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        dtype = x.dtype
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(dtype)

    @torch.no_grad()
    def divide_gain_(self, s: torch.Tensor, storage_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Divide the applied gain (offset + weight) by s, per channel: how SmoothQuant and AWQ fold
        a smoothing factor into the norm that feeds the smoothed linears. Returns the factor really
        applied, which the caller multiplies into the linears' columns.

        For a Gemma norm the stored weight becomes (1 + w) / s - 1. Stored in bfloat16 that loses
        the small gains a large s makes: (1 + w) / s = 0.05 is stored as -0.95 to within 2^-9,
        a 4 % error of the gain (plain gains keep 2^-9 relative whatever s is). So with a
        `storage_dtype` the new weight is rounded to it here, and the factor returned is the one
        that rounded weight realizes (old gain / new gain), so the layer's function is preserved
        exactly by what the checkpoint will hold. A gain that would round to 0 keeps the smallest
        representable magnitude instead (that channel is then divided by less than s)."""
        w = self.weight.data
        old = self.offset + w.float()
        new_w = old / s - self.offset
        if not self.offset or storage_dtype is None:
            self.weight.data = new_w.to(w.dtype)
            return s
        stored = new_w.to(storage_dtype).float()
        gain = self.offset + stored
        lost = (gain == 0) & (old != 0)  # a gain rounded to zero would erase its channel
        if bool(lost.any()):  # keep the smallest gain -offset ± one ulp of offset represents
            tiny = self.offset * torch.finfo(storage_dtype).eps
            stored = torch.where(lost, (torch.sign(old) * tiny - self.offset).to(storage_dtype).float(), stored)
            gain = self.offset + stored
        self.weight.data = stored.to(w.dtype)
        return torch.where(old == 0, torch.ones_like(old), old / gain)  # a dead channel stays as it is


class AttentionContext(Protocol):
    """What the serving runtime passes to run attention over its own (paged) KV cache.

    A context that sets `supports_attention_spec = True` takes the layer's `AttentionSpec` as a
    fifth argument and must honour it; a model whose attention needs one (`ModelConfig.
    needs_attention_spec`) refuses a context without it rather than attend the Llama way."""

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] for the new tokens; returns [T, Hq, D]."""
        ...


class FusedLinear(Protocol):
    """Linears that read one input (q/k/v, gate/up) computed as one product: what the forward
    reads of the module a serving runtime sets as `Attention.qkv_proj` or `MLP.gate_up_proj`
    (the CPU runtime's `FusedPrepackedLinear`). Named here so the model imports no runtime."""

    def parts(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each linear's output [..., out_i] for input x, in the group's order."""
        ...


# A KV quantizer maps (k, v) to what the cache would hand back after a quantize-on-write,
# dequantize-on-read round trip. Set on an `Attention` by `lmfoundry.quantizers.kv_scales`.


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        d = config.head_dim
        self.layer_idx = layer_idx
        # None: plain causal attention at head_dim^-1/2 (the SDPA fast path); else Gemma's
        self.spec: AttentionSpec | None = None
        if config.needs_attention_spec:
            self.spec = AttentionSpec(config.attention_scale, config.attn_logit_softcapping,
                                      config.layer_window(layer_idx))
        self.model_type = config.model_type
        self.rope_index = config.layer_rope(layer_idx)  # which head_dim columns of the rotary table
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.q_proj = nn.Linear(config.hidden_size, config.num_heads * d, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_kv_heads * d, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_kv_heads * d, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.num_heads * d, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps, config.norm_offset)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, config.norm_offset)
        self.kv_round_trip: KVRoundTrip | None = None
        # q/k/v as one product: set by the CPU serving swap (runtime/cpu/dense_linears.prepack_dense_linears)
        self.qkv_proj: FusedLinear | None = None
        # rotary of q and k in one call, or None where it does not fit: set by the CPU serving swap
        # (runtime/cpu/elementwise.swap_native_elementwise)
        self.rope: Callable[..., tuple[torch.Tensor, torch.Tensor] | None] | None = None

    def project_qk(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [..., T, Hq, D] and k [..., T, Hkv, D] with rotary applied (what attention scores need)."""
        return self.rotated_qk(self.q_proj(x), self.k_proj(x), cos, sin)

    def rotated_qk(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q_proj's and k_proj's outputs [..., T, Hq * D], [..., T, Hkv * D] as heads, normalized
        where the model does, with rotary applied."""
        shape = q.shape[:-1]
        q = q.view(*shape, self.num_heads, self.head_dim)
        k = k.view(*shape, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        if cos.shape[-1] != self.head_dim:  # several rotary tables side by side: this layer's
            d, i = self.head_dim, self.rope_index
            cos, sin = cos[..., i * d:(i + 1) * d], sin[..., i * d:(i + 1) * d]
        if self.rope is not None:
            rotated = self.rope(q, k, cos, sin)
            if rotated is not None:
                return rotated
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def project_qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns q [..., T, Hq, D] and k, v [..., T, Hkv, D] with rotary applied to q and k."""
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj.parts(x)
            q, k = self.rotated_qk(q, k, cos, sin)
        else:
            q, k = self.project_qk(x, cos, sin)
            v = self.v_proj(x)
        return q, k, v.view(*x.shape[:-1], self.num_kv_heads, self.head_dim)

    def heads_output(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context: AttentionContext | None = None,
    ) -> torch.Tensor:
        """Everything before o_proj: the attention output [..., T, Hq * D] (o_proj's input)."""
        q, k, v = self.project_qkv(x, cos, sin)
        if context is not None:
            if self.spec is None:
                out = context.attend(self.layer_idx, q, k, v)
            elif getattr(context, "supports_attention_spec", False):
                out = context.attend(self.layer_idx, q, k, v, self.spec)  # type: ignore[call-arg]
            else:
                from lmfoundry.errors import UserError

                raise UserError(f"{type(context).__name__} runs plain causal attention, but {self.model_type} "
                                f"attention needs scale {self.spec.scale:.4g}, soft-cap {self.spec.softcap} and "
                                f"window {self.spec.window}: this path does not support {self.model_type} yet")
        else:
            if self.kv_round_trip is not None:
                k, v = self.kv_round_trip(k, v)
            out = causal_attention(q, k, v) if self.spec is None else spec_attention(q, k, v, self.spec)
        return out.reshape(*x.shape[:-1], self.num_heads * self.head_dim)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context: AttentionContext | None = None,
    ) -> torch.Tensor:
        return self.o_proj(self.heads_output(x, cos, sin, context))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        from lmfoundry.model.architectures import GELU_ACTIVATIONS

        h, i, b = config.hidden_size, intermediate_size or config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=b)
        self.up_proj = nn.Linear(h, i, bias=b)
        self.down_proj = nn.Linear(i, h, bias=b)
        self.gelu = GELU_ACTIVATIONS.get(config.hidden_act)  # None: SiLU (Llama); "tanh"/"none": Gemma
        # gate/up as one product: set by the CPU serving swap (runtime/cpu/dense_linears.prepack_dense_linears)
        self.gate_up_proj: FusedLinear | None = None
        # act(gate) * up in one pass, or None where it does not fit: set by the CPU serving swap
        # (runtime/cpu/elementwise.swap_native_elementwise)
        self.act_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None] | None = None

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """down_proj's input: act(gate(x)) * up(x), in place on gate's output: no third
        intermediate-sized tensor is allocated and written."""
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj.parts(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        if self.act_mul is not None:
            out = self.act_mul(gate, up)
            if out is not None:
                return out
        return self.activation(gate).mul_(up)

    def activation(self, gate: torch.Tensor) -> torch.Tensor:
        """act(gate): SiLU in place on gate_proj's output, or GELU (Gemma) into a new tensor."""
        if self.gelu is not None:
            return F.gelu(gate, approximate=self.gelu)
        return F.silu(gate, inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.hidden(x))


ExpertCalibration = Literal["all", "routed"]


class SparseMoE(nn.Module):
    """Mixtral's / Qwen3-MoE's sparse block: a float router (`gate`) scores the experts per
    token, the top-k probabilities (renormalized where the model does) weight the outputs of
    those k gated MLPs, which are summed. Each expert runs only its own tokens.

    `calibrate_experts` is set by the calibration pipeline only (serving leaves it None): with
    "all" every expert also runs every token, so its linears' input statistics come from the
    whole calibration set (an expert the router rarely picks would otherwise have a handful of
    tokens); with "routed" an expert sees its routed tokens, and one that no token picked runs
    every token rather than none (no statistics means no scales). Either way only routed tokens
    reach the output, so the layer's function is the served one."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(config, config.moe_intermediate_size) for _ in range(config.num_experts))
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.weights_in_model_dtype = config.model_type == "qwen3_moe"  # transformers' Qwen3-MoE casts them
        self.calibrate_experts: ExpertCalibration | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token of x [N, H]: the k chosen experts [N, k] and their weights [N, k]. Softmax
        in float32 over the router logits, top-k, renormalized (transformers' order)."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return chosen, weights.to(x.dtype) if self.weights_in_model_dtype else weights

    def expert_tokens(self, chosen: torch.Tensor, e: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(token rows, top-k slots) routed to expert `e`, and whether it runs every token this
        time (the calibration modes above)."""
        rows, slots = torch.where(chosen == e)
        mode = self.calibrate_experts
        return rows, slots, mode == "all" or (mode == "routed" and rows.numel() == 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        chosen, weights = self.route(flat)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slots, every = self.expert_tokens(chosen, e)
            if every:
                y = expert(flat)[rows]
            elif rows.numel():
                y = expert(flat[rows])
            else:
                continue
            out.index_add_(0, rows, (y * weights[rows, slots, None]).to(out.dtype))
        return out.reshape(x.shape)


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(x)). Gemma ("sandwich") also normalizes each branch's
    output: x + post_attention_layernorm(attn(input_layernorm(x))), then
    x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x))) — so in Gemma the norm
    feeding the MLP is `pre_feedforward_layernorm`, and `post_attention_layernorm` is not an input
    norm at all. Code that needs "the norm feeding gate/up" uses `mlp_norm` / `MLP_NORM`."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        h, eps, offset = config.hidden_size, config.rms_norm_eps, config.norm_offset
        self.input_layernorm = RMSNorm(h, eps, offset)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(h, eps, offset)
        self.mlp: MLP | SparseMoE = SparseMoE(config) if config.is_moe else MLP(config)
        self.linear_names = tuple(config.linear_shapes)  # the quantizable linears, in execution order
        self.mlp_prefixes = config.mlp_prefixes  # "mlp." or each expert's "mlp.experts.E."
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(h, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(h, eps, offset)
        self.mlp_norm_name = "pre_feedforward_layernorm" if self.sandwich else "post_attention_layernorm"

    @property
    def mlp_norm(self) -> RMSNorm:
        """The norm whose output gate_proj/up_proj read (where MLP smoothing factors fold)."""
        return cast(RMSNorm, self.get_submodule(self.mlp_norm_name))

    def attn_residual(self, y: torch.Tensor) -> torch.Tensor:
        """What o_proj's output adds to the residual stream (normalized first in Gemma)."""
        return self.post_attention_layernorm(y) if self.sandwich else y

    def mlp_residual(self, y: torch.Tensor) -> torch.Tensor:
        """What down_proj's output adds to the residual stream (normalized first in Gemma)."""
        return self.post_feedforward_layernorm(y) if self.sandwich else y

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context: AttentionContext | None = None,
    ) -> torch.Tensor:
        x = x + self.attn_residual(self.self_attn(self.input_layernorm(x), cos, sin, context))
        return x + self.mlp_residual(self.mlp(self.mlp_norm(x)))


def _embedding(count: int, width: int) -> nn.Embedding:
    """An `nn.Embedding`, left uninitialized when built on the meta device (the loaders' skeletons,
    filled from a checkpoint). The default init of a meta tensor runs `normal_` through torch._refs,
    whose first call imports TorchDynamo and sympy into the process, where they stay resident: the
    serving engine, which never compiles, would carry them for its whole life."""
    if building_on_meta():
        return nn.Embedding(count, width, _weight=torch.empty(count, width))
    return nn.Embedding(count, width)


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = _embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_offset)
        self.rotary_emb = RotaryEmbedding(config)


def embed(config: ModelConfig, table: torch.Tensor | nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Embedding rows of `input_ids`, times Gemma's sqrt(hidden_size) where the config has one.
    The factor is rounded to the table's dtype first and multiplied in it, as transformers does
    (sqrt(3072) = 55.43 becomes 55.5 in bfloat16): the model was trained with that product.
    `table` is the weight, or a module that looks rows up itself (a tensor-parallel rank's share
    of the vocabulary, see tensor_parallel.py)."""
    if isinstance(table, nn.Module):
        x = table(input_ids)
        dtype = x.dtype
    else:
        x = F.embedding(input_ids, table)
        dtype = table.dtype
    if config.embed_scale is None:
        return x
    return x * torch.tensor(config.embed_scale, dtype=torch.float32).to(dtype)


class LogitSoftcap:
    """A forward hook turning an LM head's logits into cap * tanh(logits / cap) (Gemma), in the
    logits' dtype as transformers does. A class, not a closure, so a model stays picklable."""

    def __init__(self, cap: float) -> None:
        self.cap = cap

    def __call__(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        return torch.tanh(out / self.cap) * self.cap


def run_decoder(decoder: Any, x: torch.Tensor, positions: torch.Tensor,
                context: AttentionContext | None = None) -> torch.Tensor:
    """Final-norm hidden states of embedded inputs `x`: `decoder`'s rotary table, layers and final
    norm (a `DecoderModel`, or a module holding just those three, as `compile --arch cpu`'s step
    does so that the embedding table stays out of its package)."""
    cos, sin = decoder.rotary_emb(positions, x.dtype)
    for layer in decoder.layers:
        x = layer(x, cos, sin, context)
    return cast(torch.Tensor, decoder.norm(x))


class CausalLM(nn.Module):
    """Decoder + LM head. `forward(ids)` returns float32 logits for whole causal sequences.

    Gemma's final-logit soft-cap is a forward hook on `lm_head`, attached again whenever the
    module is replaced (the loader swaps in the stored linear): the serving runtime calls
    `model.lm_head(hidden)` itself, so a cap applied only in `forward` would be skipped there."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def __setattr__(self, name: str, value: Any) -> None:  # any value (torch's stubs say Tensor | Module)
        super().__setattr__(name, value)
        cap = self.config.final_logit_softcapping if name == "lm_head" else None
        if cap is not None and isinstance(value, nn.Module) and not getattr(value, "_logit_softcap", None):
            value.register_forward_hook(LogitSoftcap(cap))
            cast(Any, value)._logit_softcap = cap  # once per module, however often it is assigned

    @property
    def dtype(self) -> torch.dtype:
        table = self.model.embed_tokens  # a serving swap's table may say its dtype without a `.weight`
        return cast(torch.dtype, table.dtype) if hasattr(table, "dtype") else table.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        context: AttentionContext | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states. input_ids: [B, T] (or [T] with a context)."""
        if positions is None:
            positions = torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
        return run_decoder(self.model, self.embed_inputs(input_ids), positions, context)

    def embed_inputs(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The decoder's inputs for `input_ids`: their embedding rows (see `embed`)."""
        return embed(self.config, self.model.embed_tokens, input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        context: AttentionContext | None = None,
    ) -> torch.Tensor:
        return self.lm_head(self.hidden_states(input_ids, positions, context)).float()
