"""Runs one scheduled batch through the model: flat ragged inputs, paged attention, logits (and
the pooled last hidden state of embedding inputs, embedding.py).

The runner owns what both executors share: the KV capacity (blocks that fit the memory budget),
the flat step inputs (decode rows first, then prefill chunks) and which rows need logits. Only the
rows that need logits go through the LM head: the last token of each sequence whose prompt (or
chunk series) is complete, plus every prompt row of sequences that asked for prompt logprobs. For
a 512-token prefill that skips 511 of 512 vocab projections.

A speculative decode (a sequence carrying draft tokens) runs as a chunk of its last token and its
drafts, and every row of it needs logits: row j scores draft j (the last row gives the token after
all drafts). Its rows come out consecutively in `logits`, `num_rows` of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from lmfoundry.errors import UserError
from lmfoundry.runtime.engine.engine_config import EngineConfig
from lmfoundry.runtime.engine.executor import local_executor
from lmfoundry.runtime.engine.lora_adapters import step_rows
from lmfoundry.runtime.engine.outputs import TokenLogprob
from lmfoundry.runtime.engine.scheduler import ScheduledBatch
from lmfoundry.runtime.engine.sequence import Sequence
from lmfoundry.runtime.engine.step_inputs import ModelExecutor, StepInputs

PROMPT_LOGPROB_ROWS = 128  # vocab projections done at once for prompt logprobs (memory bound)


def make_executor(model: Any, config: EngineConfig) -> ModelExecutor:
    """The executor for a loaded model: a `ShardedModel` runs its tensor-parallel ranks, anything
    else the executor of a model held here (`executor.local_executor`)."""
    from lmfoundry.runtime.engine.ranks import ShardedModel, TensorParallelExecutor

    if isinstance(model, ShardedModel):
        return TensorParallelExecutor(model, config)
    return local_executor(model, config)


@dataclass
class StepResult:
    sample_seqs: list[Sequence]  # sequences that get a new token, in row order of `logits`
    logits: torch.Tensor | None  # [sum(num_rows), vocab] float32
    num_rows: list[int] = field(default_factory=list)  # logits rows per sample seq: 1 + its drafts
    prompt_logprobs: dict[int, list[tuple[int, TokenLogprob]]] = field(default_factory=dict)  # seq_id -> (position, lp)
    # Embedding inputs whose prompt is complete, with their pooled vector (unit length).
    pooled: list[tuple[Sequence, list[float]]] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model: Any, config: EngineConfig) -> None:
        self.model = model
        self.config = config
        self.block_size = config.block_size
        self.executor = make_executor(model, config)
        bytes_per_token = self.executor.kv_bytes_per_token()
        if config.num_kv_blocks is not None:
            self.num_blocks = config.num_kv_blocks
        else:
            budget = int(config.kv_cache_memory_gb * 2**30)
            self.num_blocks = budget // (bytes_per_token * self.block_size)
        if self.num_blocks < 1:
            raise UserError(f"the KV cache budget holds no block of {self.block_size} tokens "
                            f"({bytes_per_token * self.block_size} bytes each); give it more memory")
        self.executor.allocate(self.num_blocks)
        self.kv_cache_bytes = bytes_per_token * self.block_size * self.num_blocks
        # Offline callers that need whole next-token distributions of prompts (eval's perplexity and
        # divergence statistics, `LLMEngine.prompt_logits`) see each chunk's raw logits here:
        # hook(seq, position of the first token they predict, float32 logits [rows, vocab]).
        self.logits_hook: Callable[[Sequence, int, torch.Tensor], None] | None = None

    @property
    def cache(self) -> Any:
        """The reference executor's paged cache (tests and stats look at its tensors)."""
        return getattr(self.executor, "cache", None)

    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def inputs(self, batch: ScheduledBatch) -> tuple[list[tuple[Sequence, int]], StepInputs]:
        """The batch reordered decodes first, and its flat step inputs."""
        ordered = sorted(batch, key=lambda item: item[1] != 1)  # stable: decodes first
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        items, offsets = [], []
        for seq, n in ordered:
            c = seq.num_computed_tokens
            offsets.append(len(ids))
            ids.extend(seq.scheduled_token_ids(c, c + n))
            positions.extend(range(c, c + n))
            slots.extend(self._slots(seq, c, c + n))
            items.append((c, n, seq.block_table))
        num_decode = sum(1 for _, n in ordered if n == 1)
        return ordered, StepInputs(ids, positions, slots, items, offsets, num_decode, self.block_size,
                                   step_rows(ordered))

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepResult:
        ordered, step = self.inputs(batch)
        hidden = self.executor.forward(step)
        sample_seqs: list[Sequence] = []
        sample_rows: list[int] = []
        pool_seqs: list[Sequence] = []
        pool_rows: list[int] = []
        result = StepResult([], None)
        for (seq, n), row in zip(ordered, step.offsets, strict=True):
            drafts = len(seq.draft_token_ids)
            if seq.pooling:
                if seq.num_computed_tokens + n == len(seq):
                    pool_seqs.append(seq)
                    pool_rows.append(row + n - 1)
            elif seq.num_computed_tokens + n == len(seq) + drafts:
                sample_seqs.append(seq)
                sample_rows.extend(range(row + n - 1 - drafts, row + n))
                result.num_rows.append(1 + drafts)
            if seq.prompt_logprobs is not None:
                self._prompt_logprobs(seq, hidden[row : row + n], seq.num_computed_tokens, result)
        result.sample_seqs = sample_seqs
        if pool_rows:
            rows = hidden.index_select(0, torch.tensor(pool_rows, device=hidden.device)).float()
            vectors = torch.nn.functional.normalize(rows, dim=-1).cpu().tolist()
            result.pooled = list(zip(pool_seqs, vectors, strict=True))
        if sample_rows:
            rows = torch.tensor(sample_rows, device=hidden.device)
            result.logits = self.executor.logits(hidden.index_select(0, rows))
        return result

    def _prompt_logprobs(self, seq: Sequence, hidden: torch.Tensor, start: int, result: StepResult) -> None:
        """Log-probabilities of prompt tokens start+1 .. from the chunk's hidden rows."""
        first = max(start, seq.params.prompt_logprobs_start - 1)  # row p scores token p+1
        last = min(start + hidden.shape[0], seq.num_prompt_tokens - 1)  # exclusive
        k = seq.params.prompt_logprobs or 0
        out = result.prompt_logprobs.setdefault(seq.seq_id, [])
        for lo in range(first, last, PROMPT_LOGPROB_ROWS):
            hi = min(lo + PROMPT_LOGPROB_ROWS, last)
            logits = self.executor.logits(hidden[lo - start : hi - start])
            if self.logits_hook is not None:
                self.logits_hook(seq, lo + 1, logits)
            logp = torch.log_softmax(logits, dim=-1).cpu()
            targets = torch.tensor(seq.token_ids[lo + 1 : hi + 1])
            chosen = logp.gather(1, targets[:, None])[:, 0].tolist()
            best = logp.topk(k, dim=-1)  # k = 0: empty rows
            top_i, top_v = best.indices.tolist(), best.values.tolist()
            for j in range(hi - lo):
                top = list(zip(top_i[j], top_v[j], strict=True))
                out.append((lo + 1 + j, TokenLogprob(int(targets[j]), chosen[j], top)))
