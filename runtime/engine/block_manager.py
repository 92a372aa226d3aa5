"""Fixed-size KV blocks with reference counts and a hash-chained prefix cache.

Each full block of computed tokens is named by a hash chained over all tokens before it, so two
requests that share a prompt prefix map the same leading blocks; a request run with a LoRA
adapter chains from that adapter's load (`chain_root`), so it shares blocks only with requests of
the same adapter. A block whose last owner leaves
returns to the free list but keeps its contents and its hash entry: it is reused as-is if the same
prefix comes back, and only overwritten when the free list hands it out for new tokens. The free
list is ordered least-recently-freed first, which makes that overwrite an LRU eviction.

Only full blocks are ever shared, and full blocks are never written again (new tokens always go to
a sequence's private last block), so sharing needs no copy-on-write.
"""

from __future__ import annotations

from collections import OrderedDict

from lmfoundry.runtime.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "lora_key")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.lora_key = 0  # the adapter load whose K/V the block holds (0: the base)

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, cached={self.hash is not None})"


def chain_hash(prev: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((prev, token_ids))


def chain_root(lora_key: int) -> int | None:
    """What a sequence's first block hash chains from: nothing for the base, the adapter load's
    key otherwise (the same tokens under another adapter have other K/V)."""
    return hash(("lora", lora_key)) if lora_key else None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token ({num_blocks=}, {block_size=})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # chain hash -> block id
        # Prefix-cache statistics, in tokens.
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    # ---- capacity ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out, including free blocks still holding cached prefixes."""
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -----------------------------------------------------------------------
    def _block_hash(self, seq: Sequence, i: int) -> int:
        """Chain hash of seq's i-th full block (memoized on the sequence; its tokens never change)."""
        while len(seq.block_hashes) <= i:
            j = len(seq.block_hashes)
            prev = seq.block_hashes[j - 1] if j else chain_root(seq.lora_key)
            ids = tuple(seq.token_ids[j * self.block_size : (j + 1) * self.block_size])
            seq.block_hashes.append(chain_hash(prev, ids))
        return seq.block_hashes[i]

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding seq's leading tokens. The last token is never matched: the model
        must run at least one token to produce the logits of the next one."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        limit = len(seq) - 1
        if seq.params.prompt_logprobs is not None:
            limit = min(limit, seq.params.prompt_logprobs_start - 1)  # rows that must produce logits
        matched: list[int] = []
        for i in range(limit // bs):
            block_id = self.cached.get(self._block_hash(seq, i))
            if block_id is None or self.blocks[block_id].token_ids != tuple(seq.token_ids[i * bs : (i + 1) * bs]) \
                    or self.blocks[block_id].lora_key != seq.lora_key:
                break
            matched.append(block_id)
        return matched

    # ---- allocation -------------------------------------------------------------------------
    def can_admit(self, matched: list[int], num_tokens: int) -> bool:
        """Whether a waiting sequence can take `matched` and blocks for `num_tokens` tokens."""
        revived = sum(1 for b in matched if self.blocks[b].ref_count == 0)
        return self.blocks_for(num_tokens) - len(matched) + revived <= len(self.free)

    def admit(self, seq: Sequence, matched: list[int], num_tokens: int) -> None:
        """Give a sequence with no blocks its cached prefix plus fresh blocks up to `num_tokens`."""
        assert not seq.block_table, seq
        assert self.can_admit(matched, num_tokens)
        for block_id in matched:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
        seq.block_table = list(matched)
        seq.num_computed_tokens = len(matched) * self.block_size
        seq.num_cached_tokens = seq.num_computed_tokens
        self.prefix_query_tokens += len(seq)
        self.prefix_hit_tokens += seq.num_computed_tokens
        self._extend(seq, num_tokens)

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make seq's block table cover `num_tokens` tokens; False (and no change) if out of blocks."""
        if self.blocks_for(num_tokens) - len(seq.block_table) > len(self.free):
            return False
        self._extend(seq, num_tokens)
        return True

    def _extend(self, seq: Sequence, num_tokens: int) -> None:
        for _ in range(self.blocks_for(num_tokens) - len(seq.block_table)):
            seq.block_table.append(self._take_free_block())

    def _take_free_block(self) -> int:
        block_id, _ = self.free.popitem(last=False)  # least recently freed: LRU eviction
        block = self.blocks[block_id]
        if block.hash is not None:
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash = block.token_ids = None
            block.lora_key = 0
        block.ref_count = 1
        return block_id

    def trim(self, seq: Sequence, num_tokens: int) -> int:
        """Release seq's blocks past the first `num_tokens` tokens; returns how many. Speculative
        decoding grows a table for the draft tokens it scores, and the blocks that only held
        rejected drafts come back here. They hold no computed token (never published in the prefix
        cache), so they go to the front of the free list: reused before any block still holding a
        cached prefix."""
        keep = self.blocks_for(num_tokens)
        assert keep >= self.blocks_for(seq.num_computed_tokens), (seq, num_tokens)  # computed K/V stays
        released = seq.block_table[keep:]
        for block_id in reversed(released):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count == 0 and block.hash is None, block  # private, never published
            self.free[block_id] = None
            self.free.move_to_end(block_id, last=False)
        del seq.block_table[keep:]
        return len(released)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish seq's full, computed blocks in the prefix cache (after their K/V are written)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(seq.num_computed_tokens // bs):
            block = self.blocks[seq.block_table[i]]
            h = self._block_hash(seq, i)
            if block.hash is not None:
                continue  # already published (or matched from the cache)
            if h in self.cached:
                continue  # same content computed concurrently elsewhere; keep the first copy
            block.hash = h
            block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            block.lora_key = seq.lora_key
            self.cached[h] = block.block_id

    def free_seq(self, seq: Sequence) -> None:
        """Drop seq's references. Blocks are released tail first, so a prompt's first blocks (the
        ones most likely shared by later requests) are the last to be evicted."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, block
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
