"""One tensor-parallel rank's share of a checkpoint, written as a checkpoint of its own.

`compile --tp N` compiles each rank for the shapes that rank runs: its slice of q/k/v and gate/up
(whole heads, 1/N of the MLP width), of o_proj and down_proj (by input columns) and of the
vocabulary. The share is cut by the runtime's own rules (`lmfoundry.model.tensor_parallel.RankShard`:
quantized linears by their codes and whole groups, the embedding by vocabulary rows, per-head KV
scales by the rank's KV heads) and written in the compressed-tensors form of the source, with a
config.json whose sizes are the slice's (`rank_config`): the share then plans, repacks and compiles
like any checkpoint, and the runtime rebuilds each rank from its share without slicing again.

A row-parallel bias lives on rank 0 (it is added once to the all-reduced sum); the other ranks'
shares hold zeros in its place, since their config still declares the bias.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from lmfoundry.checkpoint.folder import (
    TOKENIZER_FILES,
    CheckpointReader,
    checkpoint_names,
    decode_linear,
    encode_linear,
)
from lmfoundry.errors import UserError
from lmfoundry.model.config import ModelConfig
from lmfoundry.model.tensor_parallel import RankShard, rank_config

_KV_SCALES = (".self_attn.k_scale", ".self_attn.v_scale")


def linear_modules(config: ModelConfig) -> list[str]:
    """Full names of the model's linears (every layer's, and the LM head)."""
    return [f"model.layers.{i}.{local}" for i in range(config.num_layers) for local in config.linear_shapes] + ["lm_head"]


def share_tensors(reader: CheckpointReader, shard: RankShard) -> dict[str, torch.Tensor]:
    """Rank `shard.rank`'s tensors of the checkpoint behind `reader`, in our names."""
    plan = reader.plan
    out: dict[str, torch.Tensor] = {}
    taken: set[str] = set()
    for name in linear_modules(shard.config):
        stored = reader.prefixed(name)
        if not stored:
            continue  # a tied LM head
        taken.update(f"{name}.{leaf}" for leaf in stored)
        scheme = plan.scheme_for(name) if plan else None
        bias = stored.get("bias")
        weight = stored.get("weight")
        if scheme is None or (weight is not None and weight.is_floating_point() and weight.element_size() > 1):
            if weight is None:
                raise UserError(f"{reader.folder}: missing {name}.weight")
            weight, kept = shard.dense(name, weight, bias)
            out[f"{name}.weight"] = weight.contiguous()
        else:
            qw = decode_linear(stored, scheme)
            qw, kept = shard.quantized(name, qw, bias)
            out.update(encode_linear(name, qw, scheme))
            if qw.input_scale is not None:  # a static activation scale: one per tensor, the same on every rank
                if qw.input_scale.numel() != 1:
                    raise UserError(f"{name}: a per-channel input_scale cannot be split over --tp ranks")
                out[f"{name}.input_scale"] = qw.input_scale
        if bias is not None:
            out[f"{name}.bias"] = (kept if kept is not None else torch.zeros_like(bias)).contiguous()
    start, stop, _ = shard.vocab_range()
    for name, t in reader.get([n for n in reader.index if n not in taken]).items():  # each shard opened once
        if name == "model.embed_tokens.weight":
            t = t[start:stop].clone()
        elif name.endswith(_KV_SCALES):
            t = shard.kv_scale(t)
        out[name] = t.contiguous()
    return out


def write_share(source: Path, shard: RankShard, dest: Path) -> Path:
    """Write rank `shard.rank`'s share of the checkpoint at `source` into the new folder `dest`:
    config.json (`rank_config`), one model.safetensors and the tokenizer files."""
    from safetensors.torch import save_file

    reader = CheckpointReader(source)
    if shard.config.is_moe:
        raise UserError(f"{source}: a mixture-of-experts model has no compiled-kernel path to shard")
    config = rank_config(reader.config, shard)
    tensors = checkpoint_names(share_tensors(reader, shard), ModelConfig.from_dict(config))
    dest.mkdir(parents=True)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, dest / name)
    return dest
