"""One token stream being generated: its tokens, how many have KV in the cache, its blocks.

A request with `n > 1` becomes n sequences sharing the prompt (and, through the prefix cache,
the prompt's KV blocks).
"""

from __future__ import annotations

import enum
import itertools
import time
from typing import TYPE_CHECKING

import torch

from lmfoundry.runtime.engine.outputs import SequenceTimes, TokenLogprob
from lmfoundry.runtime.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from lmfoundry.runtime.engine.grammar import GrammarMatcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


class Sequence:
    def __init__(
        self,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.index = index  # choice index within the request
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.times = SequenceTimes()

        # KV state: tokens [0, num_computed_tokens) have their K/V written into block_table.
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of the leading full blocks (memo)
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at last admission
        self.num_preemptions = 0
        # Speculative decoding: tokens proposed to follow token_ids, set before a step and scored
        # by the target in that step (their K/V go to slots past token_ids; only the accepted ones
        # are ever counted as computed). Empty outside a speculative step.
        self.draft_token_ids: list[int] = []

        # Outputs.
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] * self.num_prompt_tokens if params.prompt_logprobs is not None else None
        )
        self.output_text = ""
        self.num_emitted_chars = 0
        self.num_emitted_tokens = 0
        self.prefix_offset = 0  # incremental detokenizer state (relative to the output tokens)
        self.read_offset = 0

        # token_ids as a tensor, grown as tokens are appended (see `token_id_tensor`).
        self._id_buffer: torch.Tensor | None = None
        self._id_buffer_len = 0

        self.generator: torch.Generator | None = None
        if params.seed is not None:
            # Choice i of a seeded request draws from seed + i, wrapped into torch's uint64 range.
            self.generator = torch.Generator().manual_seed((params.seed + index) % 2**64)

        # Structured output: where the output stands in its grammar (set by the engine when
        # params.json_schema is set). The sampler masks the logits with it and advances it with
        # each chosen token; preemption keeps the tokens, so the state stays valid across recompute.
        self.grammar: GrammarMatcher | None = None
        # An embedding input (embedding.py): run as a prompt only; once it is all computed, its last
        # hidden state is pooled into the request's result and the sequence finishes, never sampled.
        self.pooling = False

        # LoRA (lora.py): the slot of the request's adapter in the stacked weights (-1: the base)
        # and its load's key, the root the prefix cache chains this sequence's block hashes from.
        self.lora_slot = -1
        self.lora_key = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    def token_id_tensor(self) -> torch.Tensor:
        """`token_ids` as an int64 CPU tensor (a view of a buffer that only copies the tokens
        appended since the last call). The sampler's penalties read every token of a penalized
        sequence at every step; rebuilding the tensor from the list would cost O(length) Python
        work per step. Tokens are only ever appended, never changed."""
        n = len(self.token_ids)
        if self._id_buffer is None or self._id_buffer.numel() < n:
            grown = torch.empty(max(2 * n, 64), dtype=torch.int64)
            if self._id_buffer is not None:
                grown[: self._id_buffer_len] = self._id_buffer[: self._id_buffer_len]
            self._id_buffer = grown
        if self._id_buffer_len < n:
            self._id_buffer[self._id_buffer_len : n] = torch.tensor(self.token_ids[self._id_buffer_len : n],
                                                                    dtype=torch.int64)
            self._id_buffer_len = n
        return self._id_buffer[:n]

    def scheduled_token_ids(self, start: int, end: int) -> list[int]:
        """Tokens at positions [start, end) of token_ids followed by the draft tokens: what a step
        feeds the model (a speculative decode runs the last token and its drafts together)."""
        if end <= len(self.token_ids):
            return self.token_ids[start:end]
        return (self.token_ids + self.draft_token_ids)[start:end]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request_id!r}, len={len(self)}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table}, {self.status.value})"
        )
