"""Runs one scheduled batch through the model: flat ragged inputs, paged attention, logits.

Only the rows that need logits go through the LM head: the last token of each sequence whose
prompt (or chunk series) is complete, plus every prompt row of sequences that asked for prompt
logprobs. For a 512-token prefill that skips 511 of 512 vocab projections.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from lmfoundry.runtime.engine.attention import Chunk, DecodeGroup, PagedAttention
from lmfoundry.runtime.engine.config import EngineConfig
from lmfoundry.runtime.engine.kv_cache import PagedKVCache, resolve_kv_formats
from lmfoundry.runtime.engine.scheduler import ScheduledBatch
from lmfoundry.runtime.engine.sequence import Sequence, TokenLogprob

PROMPT_LOGPROB_ROWS = 128
CASCADE_MIN_TOKENS = 64  # shared-prefix length from which decode attention is split (cascade)  # vocab projections done at once for prompt logprobs (memory bound)


@dataclass
class StepResult:
    sample_seqs: list[Sequence]  # sequences that get a new token, in row order of `logits`
    logits: torch.Tensor | None  # [len(sample_seqs), vocab] float32
    prompt_logprobs: dict[int, list[tuple[int, TokenLogprob]]] = field(default_factory=dict)  # seq_id -> (position, lp)


class ModelRunner:
    def __init__(self, model: nn.Module, config: EngineConfig) -> None:
        self.model = model.eval()
        self.config = config
        cfg = model.config
        self.block_size = config.block_size
        self.formats = resolve_kv_formats(model, config.kv_cache_dtype)
        bytes_per_token = sum(f.bytes_per_token(cfg.num_kv_heads, cfg.head_dim) for f in self.formats)
        if config.num_kv_blocks is not None:
            self.num_blocks = config.num_kv_blocks
        else:
            budget = int(config.kv_cache_memory_gb * 2**30)
            self.num_blocks = max(1, budget // (bytes_per_token * self.block_size))
        self.cache = PagedKVCache(self.formats, self.num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_cache_bytes = bytes_per_token * self.block_size * self.num_blocks

    @property
    def round_trips(self) -> list:
        return [getattr(layer.self_attn, "kv_round_trip", None) for layer in self.model.model.layers]

    def _slots(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        table = torch.tensor(seq.block_table, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _shared_blocks(self, tables: torch.Tensor) -> int:
        """Leading blocks every decode sequence shares, when enough to pay for a cascade split.
        Shared block ids are prefix-cache hits: full blocks, and never the block being written."""
        if tables.shape[0] < 2 or not self.config.cascade_attention:
            return 0
        same = (tables == tables[:1]).all(dim=0)
        shared = int(torch.cumprod(same.to(torch.int64), 0).sum())
        return shared if shared * self.block_size >= CASCADE_MIN_TOKENS else 0

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepResult:
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        decode_rows: list[int] = []
        decode_seqs: list[Sequence] = []
        chunks: list[Chunk] = []
        lossless = all(f.lossless for f in self.formats)
        for seq, n in batch:
            c, row = seq.num_computed_tokens, len(ids)
            ids.extend(seq.token_ids[c : c + n])
            positions.append(torch.arange(c, c + n))
            slots.append(self._slots(seq, c, c + n))
            if n == 1:
                decode_rows.append(row)
                decode_seqs.append(seq)
            elif c == 0 and lossless:
                chunks.append(Chunk(row, row + n, 0, None, None))
            else:
                blocks = torch.tensor(seq.block_table[: -(-(c + n) // self.block_size)], dtype=torch.long)
                mask = None
                if c > 0:
                    mask = torch.arange(c + n)[None, :] <= (c + torch.arange(n))[:, None]
                chunks.append(Chunk(row, row + n, c, blocks, mask))

        decode = None
        if decode_seqs:
            lengths = torch.tensor([s.num_computed_tokens + 1 for s in decode_seqs])
            max_len = int(lengths.max())
            max_blocks = -(-max_len // self.block_size)
            tables = torch.zeros(len(decode_seqs), max_blocks, dtype=torch.long)
            for i, s in enumerate(decode_seqs):
                t = s.block_table[:max_blocks]
                tables[i, : len(t)] = torch.tensor(t, dtype=torch.long)
            real = torch.arange(max_blocks * self.block_size)[None, :] < lengths[:, None]
            contiguous = decode_rows == list(range(len(decode_rows)))
            rows = None if contiguous and not chunks else torch.tensor(decode_rows)
            decode = DecodeGroup(rows, tables, real[:, None, None, :], self._shared_blocks(tables))

        context = PagedAttention(self.cache, self.round_trips, torch.cat(slots), decode, chunks)
        hidden = self.model.hidden_states(torch.tensor(ids, dtype=torch.long), torch.cat(positions), context)

        sample_seqs, sample_rows, row = [], [], 0
        result = StepResult([], None)
        for seq, n in batch:
            if seq.num_computed_tokens + n == len(seq):
                sample_seqs.append(seq)
                sample_rows.append(row + n - 1)
            if seq.prompt_logprobs is not None:
                self._prompt_logprobs(seq, hidden[row : row + n], seq.num_computed_tokens, result)
            row += n
        result.sample_seqs = sample_seqs
        if sample_rows:
            result.logits = self.model.lm_head(hidden[torch.tensor(sample_rows)]).float()
        return result

    def _prompt_logprobs(self, seq: Sequence, hidden: torch.Tensor, start: int, result: StepResult) -> None:
        """Log-probabilities of prompt tokens start+1 .. from the chunk's hidden rows."""
        first = max(start, seq.params.prompt_logprobs_start - 1)  # row p scores token p+1
        last = min(start + hidden.shape[0], seq.num_prompt_tokens - 1)  # exclusive
        k = seq.params.prompt_logprobs or 0
        out = result.prompt_logprobs.setdefault(seq.seq_id, [])
        for lo in range(first, last, PROMPT_LOGPROB_ROWS):
            hi = min(lo + PROMPT_LOGPROB_ROWS, last)
            logp = torch.log_softmax(self.model.lm_head(hidden[lo - start : hi - start]).float(), dim=-1)
            targets = torch.tensor(seq.token_ids[lo + 1 : hi + 1])
            chosen = logp.gather(1, targets[:, None])[:, 0].tolist()
            top_v, top_i = logp.topk(k, dim=-1) if k else (None, None)
            for j in range(hi - lo):
                top = list(zip(top_i[j].tolist(), top_v[j].tolist())) if k else []
                out.append((lo + 1 + j, TokenLogprob(int(targets[j]), chosen[j], top)))
