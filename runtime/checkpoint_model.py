"""Load a model folder (float or compressed-tensors) into the reference `CausalLM`.

The model is built on the meta device and each module receives exactly its tensors from the
safetensors memory maps; quantized linears are decoded and swapped for the module that executes
their stored format (`build_linear`). A checkpoint that declares a KV-cache scheme must carry its
scales.

Weight-only integer schemes (W4A16, W8A16) stay packed when the model runs in bfloat16: their codes
go to the CPU runtime's packed linears (`lmfoundry.runtime.cpu.weight_only_linears`), so the artifact is as
small in memory as on disk. In float32 (or float16) they are dequantized once at load: that dense
weight is bit-identical to what transformers decompresses, which is what parity tests and
`--dtype float32` runs want, and those kernels have no fast float32 path. Schemes with quantized
activations (W8A8-INT8, FP8) run `ActivationQuantizedLinear`, the integer / fp8 arithmetic of the
kernels' reference (`lmfoundry.model.quantized_linear`).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import cast

import torch
from torch import nn

from lmfoundry.checkpoint.folder import CheckpointReader, decode_linear
from lmfoundry.errors import UserError
from lmfoundry.model.attention_math import RotaryEmbedding
from lmfoundry.model.config import ModelConfig
from lmfoundry.model.linears import dense_linear
from lmfoundry.model.reference import CausalLM, DecoderLayer
from lmfoundry.model.tensor_parallel import Collectives, RankShard, shard_modules
from lmfoundry.quantformat.quantized_weight import QuantizedWeight
from lmfoundry.quantformat.scheme import Scheme

log = logging.getLogger("lmfoundry.runtime")


@torch.no_grad()
def load_causal_lm(reader: CheckpointReader, dtype: torch.dtype | None = None,
                   shard: RankShard | None = None, comm: Collectives | None = None) -> CausalLM:
    """The reference model of a checkpoint; with `shard` (and its rank's `comm`), one
    tensor-parallel rank's share of it: each linear sliced before its runtime module is built,
    the embedding and LM head by vocabulary (see `lmfoundry.model.tensor_parallel`)."""
    config = ModelConfig.from_dict(reader.config)
    dtype = dtype or reader.dtype
    if shard is not None:
        shard.heads  # noqa: B018 - refuses a degree the heads or MLP width do not split into
    with torch.device("meta"):
        model = CausalLM(config)
    plan = reader.plan
    linear_names = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    fallbacks: list[str] = []
    schemes = {}  # quantized linear -> its stored scheme (what `weight_format` describes)
    for name in sorted(linear_names):
        if name == "lm_head" and config.tie_word_embeddings and not reader.has("lm_head.weight"):
            continue
        tensors = reader.prefixed(name)
        scheme = plan.scheme_for(name) if plan else None
        bias = tensors.get("bias")
        stored = tensors.get("weight")
        if scheme is None or (stored is not None and stored.is_floating_point() and stored.element_size() > 1):
            if "weight" not in tensors:
                raise UserError(f"{reader.folder}: missing {name}.weight")
            want = tuple(cast(nn.Linear, model.get_submodule(name)).weight.shape)
            if tuple(tensors["weight"].shape) != want:
                raise UserError(f"{reader.folder}: {name}.weight is stored with shape {list(tensors['weight'].shape)}, "
                                f"but config.json implies {list(want)}")
            weight = tensors["weight"]
            if shard is not None:
                weight, bias = shard.dense(name, weight, bias)
            module: nn.Module = dense_linear(weight.to(dtype), bias.to(dtype) if bias is not None else None)
        else:
            qw = decode_linear(tensors, scheme)
            if shard is not None:
                qw, bias = shard.quantized(name, qw, bias)
            module = build_linear(qw, bias, scheme, dtype, fallbacks)
            schemes[name] = scheme
        model.set_submodule(name, module)
    for reason, count in Counter(fallbacks).items():
        log.warning("%s: %d linear(s) dequantized to dense %s: %s", reader.folder, count, dtype, reason)
    # everything that is not a linear: embeddings, norms, KV scales
    rest = {}
    for name, _p in list(model.named_parameters()) + list(model.named_buffers()):
        owner = name.rsplit(".", 1)[0]
        if owner in linear_names or name.endswith("inv_freq"):
            continue
        rest[name] = name
    tensors = reader.get(rest)
    expected = model.state_dict()
    for k, v in tensors.items():
        if k in expected and tuple(v.shape) != tuple(expected[k].shape):
            raise UserError(f"{reader.folder}: {k} is stored with shape {list(v.shape)}, but config.json implies "
                            f"{list(expected[k].shape)}")
    model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=False, assign=True)
    if config.tie_word_embeddings and not reader.has("lm_head.weight"):
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb = RotaryEmbedding(config)  # its buffers were built on meta
    attach_kv_cache_scheme(model, reader, shard)
    if shard is not None:
        assert comm is not None, "a shard needs its rank's collectives"
        shard_modules(model, shard, comm)
    model.stored_schemes = schemes  # type: ignore[assignment]
    model.requires_grad_(False)
    leftover = [n for n, p in model.named_parameters() if p.is_meta]
    if leftover:
        raise UserError(f"{reader.folder}: tensors missing from the checkpoint: {leftover[:3]}")
    return model.eval()


def packs_weights(dtype: torch.dtype) -> bool:
    """Whether weight-only quantized linears stay packed for a model running in `dtype`."""
    return dtype == torch.bfloat16


def build_linear(qw: QuantizedWeight, bias: torch.Tensor | None, scheme: Scheme, dtype: torch.dtype,
                 fallbacks: list[str] | None = None) -> nn.Module:
    """The module that executes a stored quantized linear. A weight-only linear whose codes fit no
    packed kernel is dequantized, and the reason is appended to `fallbacks`."""
    if scheme.input_activations is not None:
        from lmfoundry.model.quantized_linear import KIND, build_activation_linear

        if scheme.format not in KIND:
            raise UserError(f"format {scheme.format!r} with quantized activations has no execution "
                            f"(known: {', '.join(KIND)})")
        return build_activation_linear(qw, bias, scheme, dtype)
    if packs_weights(dtype) and qw.q.device.type == "cpu":
        from lmfoundry.runtime.cpu.weight_only_linears import packed_linear

        module = packed_linear(qw, bias)
        if not isinstance(module, str):
            return module
        if fallbacks is not None:
            fallbacks.append(module)
    return dense_linear(qw.dequantize(dtype), bias.to(dtype) if bias is not None else None)


def attach_kv_cache_scheme(model: CausalLM, reader: CheckpointReader, shard: RankShard | None = None) -> None:
    """Give each attention its KV round trip from the checkpoint's kv_cache_scheme and scales.

    A declared scheme without scales is refused: silently using 1.0 (as some runtimes do) gives
    garbage for FP8 and INT8 caches."""
    plan = reader.plan
    if plan is None or plan.kv_cache is None:
        return
    from lmfoundry.model.kv_quant import kv_round_trip_from_checkpoint

    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}.self_attn"
        missing = [s for s in ("k_scale", "v_scale") if not reader.has(f"{prefix}.{s}")]
        if missing:
            raise UserError(
                f"{reader.folder}: kv_cache_scheme is declared but {prefix}.{missing[0]} is missing; "
                "refusing to fall back to a scale of 1.0"
            )
        scales = reader.get([f"{prefix}.k_scale", f"{prefix}.v_scale"])
        k_scale, v_scale = scales[f"{prefix}.k_scale"], scales[f"{prefix}.v_scale"]
        if shard is not None:  # per-head scales: this rank's KV heads
            k_scale, v_scale = shard.kv_scale(k_scale), shard.kv_scale(v_scale)
        attn = cast(DecoderLayer, layer).self_attn
        attn.kv_round_trip = kv_round_trip_from_checkpoint(plan.kv_cache, k_scale, v_scale)
