"""Speculative decoding: cheap guesses of a sequence's next tokens, checked by the target model.

Before a step the engine asks a proposer for up to k draft tokens per decoding sequence:
- `NgramProposer` (prompt lookup): the sequence's last n-gram (n from ngram_max down to
  ngram_min) is looked up earlier in its own prompt and output, and the k tokens that followed its
  latest occurrence are proposed. Free to compute, and right surprisingly often when the output
  quotes or edits its input (code, documents, JSON).
- `DraftModelProposer`: a second, smaller model with the same vocabulary decodes k tokens greedily
  over its own paged KV cache (its own `ModelRunner` and `BlockManager`).

The target then runs each such sequence's last token and its drafts as one chunk (the scheduler
and model runner treat it like a short prefill chunk over the paged cache), which yields logits
for every draft position. `verify` walks the positions in order: at each it samples the target's
token exactly as plain decoding would (the same processing, penalties, grammar and seeded
generator, via the engine's sampler) and continues only while that token equals the draft. The
first mismatch is itself the next token, and when every draft matches the last row gives a bonus
token, so a step yields 1 to k + 1 tokens per sequence.

Why this keeps the target's output: every token is drawn from the target's distribution given the
tokens before it, which are the sequence's own tokens (a draft is only built on once it has been
drawn). Both proposers are deterministic (a point-mass draft distribution), and for such drafts
this is exactly standard speculative sampling: accept draft x with probability p(x), otherwise
draw from p with x removed. So greedy output is token-for-token that of plain decoding, sampled
output has the target's distribution, and a seeded request draws the same tokens (one generator
draw per token, in order) as without speculation. The K/V written for rejected drafts lies past
the sequence's computed tokens: it is never read, and `BlockManager.trim` returns the blocks that
only held rejected drafts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from lmfoundry.errors import UserError
from lmfoundry.runtime.engine.block_manager import BlockManager
from lmfoundry.runtime.engine.engine_config import EngineConfig
from lmfoundry.runtime.engine.outputs import TokenLogprob
from lmfoundry.runtime.engine.sampler import Sampler
from lmfoundry.runtime.engine.sampling_params import SamplingParams
from lmfoundry.runtime.engine.sequence import Sequence

log = logging.getLogger(__name__)


def ngram_lookup(tokens: torch.Tensor, k: int, n_max: int, n_min: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix n-gram
    (n from n_max down to n_min) of `tokens` (1-D int64); [] when no suffix occurs earlier. One
    vectorized comparison of all windows per n, so the cost stays small for long sequences."""
    length = int(tokens.numel())
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n :]
        windows = tokens[: length - 1].unfold(0, n, 1)  # windows starting at 0 .. length - 1 - n
        hits = (windows == suffix).all(dim=1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n  # the latest occurrence; its continuation is never empty
            return tokens[start : start + k].tolist()
    return []


class NgramProposer:
    """Prompt-lookup drafts (see `ngram_lookup`)."""

    def __init__(self, n_max: int, n_min: int) -> None:
        self.n_max, self.n_min = n_max, n_min

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        return [ngram_lookup(seq.token_id_tensor(), k, self.n_max, self.n_min)
                for seq, k in zip(seqs, limits, strict=True)]

    def release(self, live: set[int]) -> None:
        """Nothing is kept per sequence."""


@dataclass
class _DraftState:
    shadow: Sequence  # the draft model's copy: the target's tokens, then the drafts it fed itself
    synced: int  # tokens of the target sequence known to equal shadow's (its length at proposal)


class DraftModelProposer:
    """Greedy drafts from a smaller model over its own paged KV cache.

    Each target sequence has a shadow `Sequence` in the draft's cache. Before proposing, the
    shadow is synced: its tokens become the target's, and its computed count is cut to the prefix
    it shares with them (drafts the target rejected are recomputed; accepted ones are kept). Then
    one forward catches up the tokens it lacks and yields draft 1, and k - 1 decode steps yield the
    rest, for all sequences of the step batched together. A sequence the draft cache has no room
    for gets no drafts (and loses its draft state), never an error."""

    def __init__(self, model: Any, target_config: EngineConfig, target_vocab: int, target_blocks: int,
                 max_model_len: int) -> None:
        from lmfoundry.runtime.engine.model_runner import ModelRunner

        if model.config.vocab_size != target_vocab:
            raise UserError(f"the draft model's vocabulary ({model.config.vocab_size} tokens) differs from the "
                            f"target's ({target_vocab}); a draft model must share the target's tokenizer")
        if model.config.max_position_embeddings < max_model_len:
            raise UserError(f"the draft model's context ({model.config.max_position_embeddings} tokens) is shorter "
                            f"than max model len {max_model_len}; lower --max-model-len")
        k = target_config.num_speculative_tokens
        bs = target_config.block_size
        # As many tokens as the target's cache, plus room for every sequence's drafts.
        blocks = target_blocks + target_config.max_num_seqs * -(-(k + 1) // bs)
        config = EngineConfig(block_size=bs, num_kv_blocks=blocks, kv_cache_dtype="auto",
                              enable_prefix_caching=False, cascade_attention=False,
                              cuda_graphs=False, max_model_len=max_model_len)
        self.runner = ModelRunner(model, config)
        self.block_manager = BlockManager(blocks, bs, enable_prefix_caching=False)
        self.states: dict[int, _DraftState] = {}
        self.params = SamplingParams(max_tokens=1, temperature=0)

    def _sync(self, seq: Sequence) -> Sequence:
        state = self.states.get(seq.seq_id)
        if state is None:
            state = self.states[seq.seq_id] = _DraftState(Sequence(seq.request_id, seq.index, [], self.params), 0)
        shadow, same = state.shadow, state.synced
        fed, now = shadow.token_ids, seq.token_ids
        while same < min(len(fed), len(now)) and fed[same] == now[same]:
            same += 1
        shadow.token_ids = list(now)
        # Keep the K/V of the shared prefix, but always run the last token (its logits are draft 1),
        # even when the target did not move since the last proposal (left out of a full step).
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, same, len(now) - 1)
        self.block_manager.trim(shadow, shadow.num_computed_tokens)
        state.synced = len(now)
        return shadow

    def _drop(self, seq_id: int) -> None:
        state = self.states.pop(seq_id, None)
        if state is not None:
            self.block_manager.free_seq(state.shadow)

    def _step(self, shadows: list[tuple[int, Sequence]]) -> dict[int, int]:
        """One draft forward over `shadows` (target seq id, shadow), each computing all it lacks;
        returns the greedy next token per target seq id. Shadows without room are dropped."""
        batch = []
        for seq_id, shadow in shadows:
            assert shadow.num_computed_tokens < len(shadow), shadow  # its last token must run
            if self.block_manager.grow(shadow, len(shadow)):
                batch.append((shadow, len(shadow) - shadow.num_computed_tokens))
            else:
                self._drop(seq_id)
        if not batch:
            return {}
        result = self.runner.execute(batch)
        for shadow, n in batch:
            shadow.num_computed_tokens += n
        assert result.logits is not None and result.sample_seqs
        best = result.logits.argmax(dim=-1).tolist()
        owner = {id(shadow): seq_id for seq_id, shadow in shadows}
        return {owner[id(shadow)]: token for shadow, token in zip(result.sample_seqs, best, strict=True)}

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        drafts: dict[int, list[int]] = {seq.seq_id: [] for seq in seqs}
        active = [(seq.seq_id, self._sync(seq), k) for seq, k in zip(seqs, limits, strict=True)]
        for round_ in range(max(limits, default=0)):
            step = [(seq_id, shadow) for seq_id, shadow, k in active if k > round_ and seq_id in self.states]
            for seq_id, token in self._step(step).items():
                drafts[seq_id].append(token)
                self.states[seq_id].shadow.token_ids.append(token)
        return [drafts[seq.seq_id] for seq in seqs]

    def release(self, live: set[int]) -> None:
        """Free the draft cache of sequences no longer running (finished, aborted, preempted)."""
        for seq_id in [s for s in self.states if s not in live]:
            self._drop(seq_id)


class Speculator:
    """Proposes drafts for the running decodes before a step and counts what verification accepts."""

    def __init__(self, config: EngineConfig, proposer: NgramProposer | DraftModelProposer) -> None:
        self.k = config.num_speculative_tokens
        self.proposer = proposer
        # Drafts scored by the target, and those accepted. Drafts past the token that finished a
        # sequence (EOS, a stop string) count as not accepted: they cost compute all the same.
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_spec_steps = 0  # sequence-steps that carried drafts

    def propose(self, running: list[Sequence], max_model_len: int) -> None:
        """Set `draft_token_ids` on every running sequence: drafts for decodes, [] for the rest.
        A sequence gets no more drafts than it can still accept: a step's output (drafts plus the
        bonus token) never runs past max_tokens or the context."""
        self.release(running)
        seqs, limits = [], []
        for seq in running:
            seq.draft_token_ids = []
            room = min(seq.params.max_tokens - seq.num_output_tokens, max_model_len - len(seq)) - 1
            if seq.num_uncomputed_tokens == 1 and room > 0:
                seqs.append(seq)
                limits.append(min(self.k, room))
        if not seqs:
            return
        try:
            proposals = self.proposer.propose(seqs, limits)
        except Exception as exc:  # noqa: BLE001 - drafts are optional: decode plainly, fail nobody
            log.warning("speculative proposer failed (%s); this step decodes without drafts", exc)
            self.proposer.release(set())  # its per-sequence state may be half updated
            return
        for seq, drafts in zip(seqs, proposals, strict=True):
            seq.draft_token_ids = drafts

    def release(self, running: list[Sequence]) -> None:
        """Free what the proposer keeps for sequences that left the running batch, at once (an
        idle engine holds no draft KV blocks)."""
        self.proposer.release({seq.seq_id for seq in running})

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


# accept(seq, token, logprob) appends the token and returns whether the sequence finished.
Accept = Callable[[Sequence, int, "TokenLogprob | None"], bool]


def verify(sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence], num_rows: list[int], accept: Accept,
           on_error: Callable[[Sequence, Exception], None], speculator: Speculator | None) -> None:
    """Sample every sequence's tokens from its logits rows, position by position (see the module
    docstring), appending each through `accept`. Round j samples row j of every sequence still
    going, so a row's processing (penalties, min_tokens, grammar) sees the tokens accepted before
    it, as plain decoding would. A sequence is failed through `on_error` (its request's other
    sequences stop too) when sampling or appending fails. Accepted drafts become computed tokens."""
    starts = [0]
    for n in num_rows:
        starts.append(starts[-1] + n)
    failed: set[str] = set()
    accepted = [0] * len(seqs)
    alive = list(range(len(seqs)))
    for j in range(max(num_rows, default=0)):
        if not alive:
            break
        part = [seqs[i] for i in alive]
        if j == 0 and len(alive) == logits.shape[0]:
            rows_logits = logits  # no drafts in this step: every row is a first row
        else:
            rows = torch.tensor([starts[i] + j for i in alive], device=logits.device)
            rows_logits = logits.index_select(0, rows)
        sampled = sampler(rows_logits, part)
        going = []
        for r, (i, seq) in enumerate(zip(alive, part, strict=True)):
            if seq.request_id in failed:
                continue
            exc = sampled.errors.get(r)
            token = sampled.tokens[r]
            if exc is None and token is not None:
                drafts = seq.draft_token_ids
                try:
                    finished = accept(seq, token, sampled.logprobs[r])
                except Exception as append_exc:  # noqa: BLE001 - fails this request only
                    exc = append_exc
                else:
                    if j < len(drafts) and token == drafts[j] and not finished:
                        seq.num_computed_tokens += 1  # the K/V at the draft's position is the token's
                        accepted[i] += 1
                        going.append(i)
            if exc is not None:
                failed.add(seq.request_id)
                on_error(seq, exc)
        alive = going
    if speculator is not None:
        for n, ok in zip(num_rows, accepted, strict=True):
            if n > 1:
                speculator.num_spec_steps += 1
                speculator.num_draft_tokens += n - 1
                speculator.num_accepted_tokens += ok
    for seq in seqs:
        seq.draft_token_ids = []
