"""Continuous batching: which sequences run in the next forward pass, and how many tokens each.

Every step is planned afresh under a token budget (`max_num_batched_tokens`):
1. running sequences first, oldest first: one token for a decode, the next chunk for a prompt
   still being prefilled (chunked prefill), so decodes keep flowing while a long prompt is read;
2. then waiting sequences, first come first served, while budget, sequence slots and KV blocks
   last. A new sequence first takes whatever prefix the cache already holds.
When a running sequence needs a block and none is free, the newest running sequence is preempted:
its blocks are released and it goes back to the head of the queue to be recomputed (its full
blocks usually survive in the prefix cache, so recompute is mostly a cache hit).

Speculative decoding: a decode whose sequence carries draft tokens is scheduled as 1 + drafts
tokens (the last token and its drafts, scored in one pass). Drafts take budget like any token and
are cut to what the budget leaves; when the blocks for them would leave too few for the other
running sequences, the drafts are dropped (the sequence decodes one token) rather than preempting
anybody for a guess.
"""

from __future__ import annotations

import time
from collections import deque

from lmfoundry.runtime.engine.block_manager import BlockManager
from lmfoundry.runtime.engine.engine_config import EngineConfig
from lmfoundry.runtime.engine.sequence import Sequence, SequenceStatus

ScheduledBatch = list[tuple[Sequence, int]]  # (sequence, number of new tokens to compute)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        batch: ScheduledBatch = []
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            if seq.draft_token_ids:
                if n == 1:
                    del seq.draft_token_ids[budget - 1 :]
                    want = bm.blocks_for(seq.num_computed_tokens + 1 + len(seq.draft_token_ids))
                    # Leave a block for each running sequence after this one, which may need one.
                    spare = bm.num_free_blocks - (len(self.running) - i - 1)
                    if want - len(seq.block_table) > spare:
                        seq.draft_token_ids = []
                    n += len(seq.draft_token_ids)
                else:
                    seq.draft_token_ids = []  # only a decode can verify drafts
            while not bm.grow(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                batch.append((seq, n))
                budget -= n
                i += 1

        # While sequences are being preempted, admitting new ones would only thrash.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            matched = bm.match_prefix(seq)
            n = min(len(seq) - len(matched) * bm.block_size, budget)
            if not bm.can_admit(matched, len(matched) * bm.block_size + n):
                break
            bm.admit(seq, matched, len(matched) * bm.block_size + n)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if seq.times.scheduled is None:
                seq.times.scheduled = time.monotonic()  # queue time ends at first admission
            self.running.append(seq)
            batch.append((seq, n))
            budget -= n
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.draft_token_ids = []
        self.block_manager.free_seq(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark seq finished (or aborted) and release its blocks, wherever it is."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free_seq(seq)
        seq.draft_token_ids = []
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.times.finished = time.monotonic()
