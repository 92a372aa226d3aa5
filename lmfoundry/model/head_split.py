"""How tensor parallelism splits a model's attention heads and MLP width over ranks: the rules
(vLLM's) as plain arithmetic, without torch, so that `lmfoundry plan --tp` can use them on a
laptop and the runtime (`lmfoundry.model.tensor_parallel`) splits by the very same ones."""

from __future__ import annotations

from dataclasses import dataclass

from lmfoundry.errors import UserError
from lmfoundry.model.config import ModelConfig


@dataclass(frozen=True)
class HeadSplit:
    """How tensor parallelism splits attention heads over `tp` ranks."""

    tp: int
    heads_per_rank: int
    kv_heads_per_rank: int
    kv_replication: int  # how many ranks hold a copy of each KV head


def valid_tp_sizes(config: ModelConfig, limit: int = 64) -> list[int]:
    kv = config.num_kv_heads
    return [t for t in range(1, limit + 1)
            if config.num_heads % t == 0 and config.mlp_width % t == 0 and (kv % t == 0 or t % kv == 0)]


def split_heads(config: ModelConfig, tp: int) -> HeadSplit:
    """Validate `tp` against the model's heads and MLP width (vLLM's rules) and split them."""
    if tp < 1:
        raise UserError(f"--tp must be a positive integer, got {tp}")
    valid = ", ".join(str(t) for t in valid_tp_sizes(config))
    if config.num_heads % tp:
        raise UserError(f"--tp {tp} does not divide the {config.num_heads} attention heads; valid: {valid}")
    if config.mlp_width % tp:
        what = "each expert's intermediate size" if config.is_moe else "the MLP intermediate size"
        raise UserError(f"--tp {tp} does not divide {what} {config.mlp_width}; valid: {valid}")
    kv = config.num_kv_heads
    if kv % tp == 0:
        return HeadSplit(tp, config.num_heads // tp, kv // tp, 1)
    if tp % kv == 0:
        return HeadSplit(tp, config.num_heads // tp, 1, tp // kv)
    raise UserError(f"--tp {tp} neither divides nor is a multiple of the {kv} KV heads; valid: {valid}")
