"""Embedding requests as scheduled work: each input is a prompt-only `Sequence` that the
scheduler runs like any prefill (chunked under the step's token budget, through the paged KV cache
and the prefix cache), and whose last token's final-norm hidden state, L2-normalized, is its
embedding (vLLM's default pooling for decoder models).

A request's inputs do not all enter the waiting queue at once: `EmbeddingJob.feed` keeps about
one step's token budget of them in the scheduler and hands over the next ones as those finish.
A 600-input request then neither holds a step longer than a chunked prefill would (the streams
running beside it keep getting a token every step) nor puts 600 sequences ahead of a request
that arrives after it (that one waits for at most one step's worth of the job). Aborting the
request (its client gone) drops what is left of it.
"""

from __future__ import annotations

from lmfoundry.runtime.engine.outputs import EmbeddingResult
from lmfoundry.runtime.engine.sampling_params import SamplingParams
from lmfoundry.runtime.engine.sequence import Sequence

# What an input's sequence carries: it is never sampled (the runner pools it once its prompt is in),
# and max_tokens 1 leaves no room for speculative drafts.
POOLING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)


class EmbeddingJob:
    """The engine's state of one embedding request."""

    def __init__(self, request_id: str, prompts: list[list[int]], arrival_time: float) -> None:
        self.request_id = request_id
        self.prompts = prompts
        self.arrival_time = arrival_time
        self.vectors: list[list[float] | None] = [None] * len(prompts)
        self.active: list[Sequence] = []  # handed to the scheduler, not pooled yet
        self.num_fed = 0
        self.num_tokens = sum(len(p) for p in prompts)

    @property
    def finished(self) -> bool:
        return self.num_fed == len(self.prompts) and not self.active

    def feed(self, token_budget: int, max_seqs: int) -> list[Sequence]:
        """The next inputs to schedule: while the job's unfinished inputs hold fewer tokens still to
        compute than one step's budget, and fewer sequences than a step's slots (one at least)."""
        pending = sum(s.num_uncomputed_tokens for s in self.active)
        new: list[Sequence] = []
        while self.num_fed < len(self.prompts) and (
                not self.active or (pending < token_budget and len(self.active) < max_seqs)):
            seq = Sequence(self.request_id, self.num_fed, self.prompts[self.num_fed], POOLING_PARAMS,
                           self.arrival_time)
            seq.pooling = True
            self.num_fed += 1
            self.active.append(seq)
            new.append(seq)
            pending += len(seq)
        return new

    def pooled(self, seq: Sequence, vector: list[float]) -> None:
        self.vectors[seq.index] = vector
        self.active.remove(seq)

    def result(self) -> EmbeddingResult:
        assert self.finished and all(v is not None for v in self.vectors)
        return EmbeddingResult(self.request_id, [v for v in self.vectors if v is not None], self.num_tokens)
