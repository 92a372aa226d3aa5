"""The engine's offline API: whole batches in, finished outputs back (generation, scoring, prompt
logits, embeddings), each a loop over `LLMEngine.step` until its requests finish.

Kept apart from the step loop (llm_engine.py) so that file reads as the engine itself; `LLMEngine`
takes these calls as a mixin, so `engine.generate(...)` and `engine.loglikelihood(...)` are its own.
"""

from __future__ import annotations

import time
from typing import Any, Iterator, Protocol, cast
from typing import Sequence as Seq

import torch

from lmfoundry.runtime.engine.client import EngineRequest
from lmfoundry.runtime.engine.model_runner import ModelRunner
from lmfoundry.runtime.engine.outputs import (
    CompletionOutput,
    EmbeddingResult,
    RequestOutput,
    StepEvent,
    TokenLogprob,
)
from lmfoundry.runtime.engine.sampling_params import SamplingParams
from lmfoundry.runtime.engine.scheduler import Scheduler
from lmfoundry.runtime.engine.sequence import Sequence

Prompt = str | list[int]


class _Engine(Protocol):
    """What the offline calls use of the engine they are mixed into (`LLMEngine`)."""

    model: Any
    runner: ModelRunner
    scheduler: Scheduler
    _ids: Iterator[int]

    def encode(self, prompt: Prompt) -> list[int]: ...
    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None: ...
    def add(self, request: EngineRequest) -> None: ...
    def add_embedding(self, request_id: str, prompts: list[list[int]], arrival_time: float | None = None) -> None: ...
    def take_embeddings(self) -> list[EmbeddingResult]: ...
    def abort(self, request_id: str) -> bool: ...
    def step(self) -> list[StepEvent]: ...
    def generate(self, prompts: Prompt | Seq[Prompt],
                 params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]: ...


class OfflineAPI:
    """Batch calls over the step loop, for offline callers (evals, benchmarks, notebooks)."""

    def generate(self: _Engine, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Generate for a batch of prompts (strings or token-id lists); one output per prompt, in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [cast(Prompt, prompts)]  # one prompt: a string or a list of token ids
        prompts = cast("Seq[Prompt]", prompts)
        params = params or SamplingParams()
        plist: list[SamplingParams] = (list(params) if isinstance(params, (list, tuple))
                                       else [cast(SamplingParams, params)] * len(prompts))
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        encoded = [self.encode(p) for p in prompts]
        for ids, p in zip(encoded, plist, strict=True):
            self.check_request(ids, p)
        results: dict[str, RequestOutput] = {}
        for ids, p in zip(encoded, plist, strict=True):
            rid = f"req-{next(self._ids)}"
            self.add(EngineRequest(rid, ids, p, time.monotonic()))
            results[rid] = RequestOutput(rid, ids, [CompletionOutput(i) for i in range(p.n)])
        pending = set(results)
        while pending:
            events = self.step()
            if not events and not self.scheduler.has_work():
                raise RuntimeError("engine stopped with unfinished requests")  # a bug, not a user error
            for ev in events:
                if ev.error is not None:
                    for rid in pending:
                        self.abort(rid)  # leave the engine clean for the caller's next call
                    raise RuntimeError(f"request {ev.request_id} failed: {ev.error}") from ev.error
                if ev.request_id in results:
                    results[ev.request_id].add(ev)
                    if ev.request_finished:
                        pending.discard(ev.request_id)
        return list(results.values())

    def loglikelihood(self: _Engine, requests: Seq[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Sum of log P(continuation | context) and whether greedy decoding would produce the
        continuation, per (context_ids, continuation_ids) pair (lm-eval's loglikelihood)."""
        prompts, params = [], []
        for ctx, cont in requests:
            if not ctx or not cont:
                raise ValueError("loglikelihood needs a non-empty context and continuation")
            prompts.append(list(ctx) + list(cont))
            params.append(SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1,
                                         prompt_logprobs_start=len(ctx)))
        # Requests sharing a context (multiple choice) run after the first of them has put the
        # context's blocks in the prefix cache; run together, each would recompute it.
        first: dict[tuple[int, ...], int] = {}
        for i, (ctx, _) in enumerate(requests):
            first.setdefault(tuple(ctx), i)
        leaders = set(first.values())
        waves = [sorted(leaders), [i for i in range(len(requests)) if i not in leaders]]
        outs: list[RequestOutput | None] = [None] * len(requests)
        for wave in waves:
            if wave:
                done = self.generate([prompts[i] for i in wave], [params[i] for i in wave])
                for i, out in zip(wave, done, strict=True):
                    outs[i] = out
        scores: list[tuple[float, bool]] = []
        for (ctx, _cont), scored in zip(requests, outs, strict=True):
            assert scored is not None and scored.prompt_logprobs is not None  # every request ran and asked
            # the positions from len(ctx) >= 1 on are all scored: only position 0 is None
            lps = cast("list[TokenLogprob]", scored.prompt_logprobs[len(ctx) :])
            scores.append((sum(lp.logprob for lp in lps), all(lp.top[0][0] == lp.token_id for lp in lps)))
        return scores

    def prompt_logits(self: _Engine, prompts: Seq[list[int]]) -> list[torch.Tensor]:
        """Raw float32 logits [len(p) - 1, vocab] of every prompt position, row j predicting token
        j + 1: the next-token distributions the engine serves (the prompt logprobs of an echo
        request come from these rows), for evaluations that need all of them (perplexity and
        divergence statistics against a baseline). A row computed twice (a preempted sequence's
        recompute) is written twice, with the same values."""
        rows: dict[str, torch.Tensor] = {}

        def keep(seq: Sequence, position: int, logits: torch.Tensor) -> None:
            if seq.request_id not in rows:
                rows[seq.request_id] = torch.full((seq.num_prompt_tokens - 1, logits.shape[-1]), float("nan"))
            rows[seq.request_id][position - 1 : position - 1 + logits.shape[0]] = logits

        self.runner.logits_hook = keep
        try:
            outs = self.generate(list(prompts), SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
        finally:
            self.runner.logits_hook = None
        return [rows.pop(out.request_id, torch.empty(0, self.model.config.vocab_size)) for out in outs]

    def embed(self: _Engine, prompts: list[list[int]]) -> list[list[float]]:
        """Each prompt's embedding (offline): the final-norm hidden state of its last token,
        L2-normalized (vLLM's default pooling for decoder models), computed by the scheduled path
        the server's /v1/embeddings takes (`add_embedding`)."""
        request_id = f"embed-{next(self._ids)}"
        self.add_embedding(request_id, prompts)
        results: dict[str, EmbeddingResult] = {}
        while request_id not in results:
            for ev in self.step():
                if ev.request_id == request_id and ev.error is not None:
                    raise RuntimeError(f"request {request_id} failed: {ev.error}") from ev.error
            results.update((r.request_id, r) for r in self.take_embeddings())
        return results[request_id].embeddings
