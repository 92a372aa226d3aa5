"""What every model executor takes and offers: one step's flat inputs (`StepInputs`, built by
`ModelRunner`, rows ordered decodes first) and the executor's protocol (`ModelExecutor`), shared by
the reference executor (`executor.py`), the kernel executor (`kernel_executor.py`) and the
tensor-parallel one (`ranks.py`) without any of them importing another for it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class StepInputs:
    """One step's tokens, flat: rows [0, num_decode) are single-token decodes, then one chunk per
    prefilling sequence. `items[j] = (context, n, block_table)`: n new tokens after `context`
    cached ones; rows of item j are `offsets[j] : offsets[j] + n`."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    items: list[tuple[int, int, list[int]]]
    offsets: list[int]
    num_decode: int
    block_size: int
    lora_rows: torch.Tensor | None = None  # int32 [T]: each row's LoRA slot (-1: base); None: all base

    @property
    def decode_items(self) -> list[tuple[int, int, list[int]]]:
        return self.items[: self.num_decode]

    @property
    def prefill_items(self) -> list[tuple[int, int, list[int]]]:
        return self.items[self.num_decode :]


class ModelExecutor(Protocol):
    config: Any  # ModelConfig
    dtype: torch.dtype
    context_limit: int  # the longest sequence this path computes exactly (the engine's max_model_len cap)

    def kv_bytes_per_token(self) -> int: ...
    def allocate(self, num_blocks: int) -> None: ...
    def forward(self, step: StepInputs) -> torch.Tensor: ...  # final-norm hidden states, one row per token
    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


def padded_table(blocks: list[int], width: int) -> list[int]:
    return list(blocks[:width]) + [0] * (width - min(len(blocks), width))
