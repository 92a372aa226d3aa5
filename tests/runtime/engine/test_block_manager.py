"""Block-manager invariants under random admit / append / free / preempt sequences."""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lmfoundry.runtime.engine.block_manager import BlockManager
from lmfoundry.runtime.engine.sampling_params import SamplingParams
from lmfoundry.runtime.engine.sequence import Sequence

BLOCK = 4
NUM_BLOCKS = 12


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK, enable_prefix_caching=True)
        self.running: list[Sequence] = []
        self.waiting: list[Sequence] = []

    # Prompts over a 2-token alphabet with shared stems so prefixes collide often.
    @rule(stem=st.sampled_from([[], [1, 1, 1, 1], [1, 1, 1, 1, 2, 2, 2, 2]]),
          tail=st.lists(st.integers(1, 2), min_size=1, max_size=9))
    def new_request(self, stem: list[int], tail: list[int]) -> None:
        self.waiting.append(Sequence("r", 0, stem + tail, SamplingParams()))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        seq = self.waiting[0]
        matched = self.bm.match_prefix(seq)
        for i, b in enumerate(matched):  # a hit really holds the same tokens
            assert self.bm.blocks[b].token_ids == tuple(seq.token_ids[i * BLOCK : (i + 1) * BLOCK])
        start = len(matched) * BLOCK
        n = data.draw(st.integers(1, len(seq) - start))
        free_before = self.bm.num_free_blocks
        if self.bm.can_admit(matched, start + n):
            self.bm.admit(seq, matched, start + n)
            assert seq.num_computed_tokens == start
            self.waiting.pop(0)
            self.running.append(seq)
            self._compute(seq, n)
        else:
            assert self.bm.num_free_blocks == free_before

    def _compute(self, seq: Sequence, n: int) -> None:
        seq.num_computed_tokens += n
        self.bm.cache_full_blocks(seq)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(1, 2))
    def step(self, data: st.DataObject, token: int) -> None:
        """Compute the rest of a prompt chunk or decode one token, growing the block table."""
        seq = data.draw(st.sampled_from(self.running))
        if seq.num_uncomputed_tokens == 0:
            seq.token_ids.append(token)
        n = data.draw(st.integers(1, seq.num_uncomputed_tokens))
        table_before = list(seq.block_table)
        if self.bm.grow(seq, seq.num_computed_tokens + n):
            assert seq.block_table[: len(table_before)] == table_before
            self._compute(seq, n)
        else:
            assert seq.block_table == table_before

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.running))
        self.running.remove(seq)
        self.bm.free_seq(seq)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.running))
        self.running.remove(seq)
        self.bm.free_seq(seq)
        self.waiting.insert(0, seq)

    @invariant()
    def no_leak_no_double_ownership(self) -> None:
        bm = self.bm
        owners = Counter(b for s in self.running for b in s.block_table)
        for s in self.running:
            assert len(set(s.block_table)) == len(s.block_table), "block twice in one table"
            assert len(s.block_table) == bm.blocks_for(s.num_computed_tokens) or \
                len(s.block_table) >= bm.blocks_for(s.num_computed_tokens)
        for s in self.waiting:
            assert not s.block_table
        for block in bm.blocks:
            assert block.ref_count == owners.get(block.block_id, 0), block
            assert (block.ref_count == 0) == (block.block_id in bm.free), block
        assert bm.num_free_blocks + len(owners) == bm.num_blocks

    @invariant()
    def shared_blocks_are_full_and_consistent(self) -> None:
        bm = self.bm
        for h, b in bm.cached.items():
            assert bm.blocks[b].hash == h
        for block in bm.blocks:
            if block.hash is not None:
                assert bm.cached.get(block.hash) == block.block_id
            if block.ref_count > 1:
                assert block.hash is not None, "only cached (full) blocks may be shared"
        for s in self.running:
            for i, b in enumerate(s.block_table):
                block = bm.blocks[b]
                if block.token_ids is not None:
                    assert block.token_ids == tuple(s.token_ids[i * BLOCK : (i + 1) * BLOCK])
                    assert (i + 1) * BLOCK <= s.num_computed_tokens


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBlockManager = BlockManagerMachine.TestCase


def test_lru_evicts_least_recently_freed_and_keeps_prefix_head() -> None:
    bm = BlockManager(3, 2)
    a = Sequence("a", 0, [1, 2, 3, 4, 5], SamplingParams())
    bm.admit(a, [], 5)
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a)
    bm.free_seq(a)  # blocks freed tail first: the prompt's first block is evicted last
    assert len(bm.cached) == 2
    b = Sequence("b", 0, [9, 9, 9], SamplingParams())
    bm.admit(b, [], 3)  # needs 2 blocks: the uncached tail, then a's second full block
    assert len(bm.cached) == 1
    bm.free_seq(b)
    c = Sequence("c", 0, [1, 2, 7], SamplingParams())
    assert len(bm.match_prefix(c)) == 1  # a's first block survived
    assert bm.prefix_hit_tokens == 0
    bm.admit(c, bm.match_prefix(c), 3)
    assert c.num_computed_tokens == 2 and bm.prefix_hit_tokens == 2
