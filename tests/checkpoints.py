"""Tiny compressed-tensors checkpoints written by the tests themselves (no quantizer involved), for
the compile tests and the runtime's bundle-loading tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from safetensors.torch import save_file

from lmfoundry.model.config import LAYER_LINEARS

LINEARS = LAYER_LINEARS


def scheme_group(scheme: str, bits: int = 4, group: int | None = 32, symmetric: bool = True,
                 actorder: bool = False, static_input: bool = False) -> tuple[str, dict[str, Any]]:
    """(format, config group) in compressed-tensors' vocabulary."""
    if scheme == "w4a16":
        weights = {"num_bits": bits, "type": "int", "symmetric": symmetric,
                   "strategy": "group" if group else "channel", "group_size": group,
                   "actorder": "group" if actorder else None}
        return "pack-quantized", {"targets": ["Linear"], "weights": weights, "input_activations": None}
    kind = "int" if scheme == "w8a8" else "float"
    act = {"num_bits": 8, "type": kind, "symmetric": True, "strategy": "tensor" if static_input else "token",
           "dynamic": not static_input}
    weights = {"num_bits": 8, "type": kind, "symmetric": True, "strategy": "channel"}
    fmt = "int-quantized" if scheme == "w8a8" else "float-quantized"
    return fmt, {"targets": ["Linear"], "weights": weights, "input_activations": act}


def write_checkpoint(
    path: Path,
    scheme: str = "w4a16",
    *,
    bits: int = 4,
    group: int | None = 32,
    symmetric: bool = True,
    actorder: bool = False,
    static_input: bool = False,
    kv_cache: str | None = None,
    layers: int = 2,
    hidden: int = 128,
    intermediate: int = 256,
    heads: int = 2,
    kv_heads: int = 1,
    head_dim: int = 64,
    vocab: int = 256,
    weights: bool = True,
    overrides: dict[str, dict[str, Any]] | None = None,
    same_gidx: bool = True,
    seed: int = 0,
) -> Path:
    """A Llama-family folder: config.json (+ safetensors with real packed tensors)."""
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": intermediate, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "num_hidden_layers": layers, "vocab_size": vocab, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 512, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": 2,
    }
    groups = {}
    if scheme != "dense":
        fmt, group0 = scheme_group(scheme, bits, group, symmetric, actorder, static_input)
        groups["group_0"] = group0
        for i, (target, g) in enumerate((overrides or {}).items()):
            groups[f"group_{i + 1}"] = {**g, "targets": [target]}
        q: dict[str, Any] = {"quant_method": "compressed-tensors", "format": fmt, "config_groups": groups,
                             "ignore": ["lm_head"]}
        if kv_cache:
            q["kv_cache_scheme"] = {"num_bits": 8, "type": "float" if kv_cache == "fp8" else "int",
                                    "symmetric": True, "strategy": "tensor", "dynamic": False}
        if overrides:  # the override groups must win: put them first
            q["config_groups"] = {k: groups[k] for k in [*list(groups)[1:], "group_0"]}
        config["quantization_config"] = q
    (path / "config.json").write_text(json.dumps(config, indent=1))
    if not weights:
        return path
    shapes = {"self_attn.q_proj": (heads * head_dim, hidden), "self_attn.k_proj": (kv_heads * head_dim, hidden),
              "self_attn.v_proj": (kv_heads * head_dim, hidden), "self_attn.o_proj": (hidden, heads * head_dim),
              "mlp.gate_proj": (intermediate, hidden), "mlp.up_proj": (intermediate, hidden),
              "mlp.down_proj": (hidden, intermediate)}
    t: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(vocab, hidden, generator=gen).bfloat16(),
        "model.norm.weight": torch.ones(hidden).bfloat16(),
        "lm_head.weight": torch.randn(vocab, hidden, generator=gen).bfloat16(),
    }
    gidx_cache: dict[int, torch.Tensor] = {}
    for layer in range(layers):
        pre = f"model.layers.{layer}."
        t[pre + "input_layernorm.weight"] = torch.ones(hidden).bfloat16()
        t[pre + "post_attention_layernorm.weight"] = torch.ones(hidden).bfloat16()
        for local in LINEARS:
            n, k = shapes[local]
            name = pre + local
            if scheme == "dense":
                t[name + ".weight"] = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
            elif scheme == "w4a16":
                lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
                ngroups = k // group if group else 1
                t[name + ".weight_packed"] = pack_to_int32(torch.randint(lo, hi, (n, k), generator=gen, dtype=torch.int8), bits)
                t[name + ".weight_scale"] = (torch.rand(n, ngroups, generator=gen) * 0.01 + 0.001).bfloat16()
                t[name + ".weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
                if not symmetric:
                    zp = torch.randint(lo, hi, (n, ngroups), generator=gen, dtype=torch.int8)
                    t[name + ".weight_zero_point"] = pack_to_int32(zp, bits, packed_dim=0)
                if actorder:
                    if same_gidx and k in gidx_cache:
                        gi = gidx_cache[k]
                    else:
                        gi = ((torch.arange(k) // (group or k))[torch.randperm(k, generator=gen)]).to(torch.int32)
                        gidx_cache[k] = gi
                    t[name + ".weight_g_idx"] = gi.clone()
            else:
                if scheme == "w8a8":
                    t[name + ".weight"] = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
                else:
                    t[name + ".weight"] = (torch.randn(n, k, generator=gen) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
                t[name + ".weight_scale"] = (torch.rand(n, 1, generator=gen) * 0.01 + 0.001).bfloat16()
                if static_input:
                    t[name + ".input_scale"] = torch.tensor([0.02], dtype=torch.float32)
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
