"""The engine: requests in, tokens out, one scheduled forward pass per `step()`.

Offline use (batch generation, scoring; the calls of offline.py, looping over `step()`):

    engine = LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=16))
    outs = engine.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=32, temperature=0))
    scores = engine.loglikelihood([(context_ids, continuation_ids)])  # [(logprob_sum, is_greedy)]

Online use goes through an `EngineClient` (client.py): `serve` runs the engine in a process of
its own (`EngineCoreClient`), tests and notebooks can step it in a thread (`AsyncLLMEngine`).
Online requests arrive validated (`add`) with `SamplingParams.detokenize` off: the API process
turns their tokens into text and watches for stop strings (output_processor.py).

Speculative decoding (`EngineConfig.speculative`, see speculative.py) proposes draft tokens for
the running decodes before each step; the step scores them and keeps those the target's own
sampling agrees with, so outputs are unchanged and a step can yield several tokens per sequence.
LoRA adapters are loaded, unloaded and looked up by the commands of lora_commands.py.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Iterator, Protocol

import torch

from lmfoundry.errors import UserError
from lmfoundry.model.config import ModelConfig
from lmfoundry.runtime.engine.block_manager import BlockManager
from lmfoundry.runtime.engine.client import EngineDead, EngineInfo, EngineRequest
from lmfoundry.runtime.engine.detokenizer import Detokenizer
from lmfoundry.runtime.engine.embedding import EmbeddingJob
from lmfoundry.runtime.engine.engine_config import EngineConfig
from lmfoundry.runtime.engine.grammar import GrammarCompiler
from lmfoundry.runtime.engine.lora_adapters import LoRAManager
from lmfoundry.runtime.engine.lora_commands import LoRACommands
from lmfoundry.runtime.engine.model_runner import ModelRunner
from lmfoundry.runtime.engine.offline import OfflineAPI, Prompt
from lmfoundry.runtime.engine.outputs import EmbeddingResult, StepEvent, TokenLogprob
from lmfoundry.runtime.engine.sampler import Sampler
from lmfoundry.runtime.engine.sampling_params import SamplingParams
from lmfoundry.runtime.engine.scheduler import Scheduler
from lmfoundry.runtime.engine.sequence import Sequence
from lmfoundry.runtime.engine.speculative import DraftModelProposer, NgramProposer, Speculator, verify
from lmfoundry.runtime.engine.validation import RequestValidator
from lmfoundry.runtime.engine.weight_format import runtime_form


class EngineModel(Protocol):
    """What the engine itself reads of the model it runs (its executor reads the rest): a
    reference `CausalLM`, an engine bundle's `KernelModel` or a tensor-parallel `ShardedModel`
    (`make_executor` picks the executor by type)."""

    @property
    def config(self) -> ModelConfig: ...


def _as_set(value: Any) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, (list, tuple)) else {int(value)}


class LLMEngine(OfflineAPI, LoRACommands):
    def __init__(self, model: EngineModel, tokenizer: Any = None, config: EngineConfig | None = None,
                 draft_model: EngineModel | None = None) -> None:
        self.config = config = config or EngineConfig()
        try:
            config.check_speculative()
        except ValueError as exc:
            raise UserError(str(exc)) from None
        if (config.speculative == "draft") != (draft_model is not None):
            raise UserError("speculative='draft' needs a draft model, and a draft model needs speculative='draft'")
        if config.rank_threads:
            torch.set_num_threads(config.rank_threads)
        self.model = model
        self.tokenizer = tokenizer
        self.runner = ModelRunner(model, config)
        capacity = self.runner.num_blocks * config.block_size
        limit = self.runner.executor.context_limit
        windowed = limit < model.config.max_position_embeddings  # kernels that are exact only up to a window
        if windowed and config.max_model_len and config.max_model_len > limit:
            raise UserError(f"max_model_len {config.max_model_len} exceeds the {limit} tokens this engine computes "
                            f"exactly: its compiled attention kernels are plain causal and the model attends "
                            f"through a sliding window of {limit}; serve the checkpoint folder for longer contexts")
        self.max_model_len = config.max_model_len or min(limit, capacity)
        if self.max_model_len > capacity:
            raise UserError(f"the KV cache holds {capacity} tokens, fewer than max_model_len "
                            f"{self.max_model_len}; give it more memory or lower max_model_len")
        self.loras: LoRAManager | None = None
        if config.max_loras or config.lora_modules:
            self.loras = LoRAManager.for_executor(self.runner.executor, model.config, config.max_loras,
                                                  config.max_lora_rank)
            for name, path in config.lora_modules:
                self.loras.load(name, path)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        self.eos_token_ids = _as_set(model.config.eos_token_id) | _as_set(getattr(tokenizer, "eos_token_id", None))
        self.sampler = Sampler(self.eos_token_ids)
        self.grammars = GrammarCompiler(tokenizer, model.config.vocab_size, self.eos_token_ids)  # structured output
        self.info = EngineInfo(vocab_size=model.config.vocab_size, max_model_len=self.max_model_len,
                               max_position_embeddings=model.config.max_position_embeddings,
                               hidden_size=model.config.hidden_size,
                               eos_token_ids=frozenset(self.eos_token_ids),
                               capacity=config.max_num_seqs + config.max_waiting_requests,
                               **runtime_form(model, self.runner.executor.dtype),
                               loras=tuple(self.loras.adapters) if self.loras else (),
                               max_loras=self.loras.max_loras if self.loras else 0)
        self.validator = RequestValidator(self.info, tokenizer, self.grammars)
        self.detokenizer = Detokenizer(tokenizer)
        self._requests: dict[str, list[Sequence]] = {}
        self._embeddings: dict[str, EmbeddingJob] = {}  # embedding requests, in arrival order
        self._pooled: list[EmbeddingResult] = []  # finished embedding requests, until taken
        self._ids: Iterator[int] = itertools.count()
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self.num_requests_total = 0
        self.speculator: Speculator | None = None
        if config.speculative == "ngram":
            self.speculator = Speculator(config, NgramProposer(config.ngram_max, config.ngram_min))
        elif config.speculative == "draft":
            proposer = DraftModelProposer(draft_model, config, model.config.vocab_size, self.runner.num_blocks,
                                          self.max_model_len)
            self.speculator = Speculator(config, proposer)

    @classmethod
    def from_pretrained(cls, path_or_name: str, dtype: torch.dtype | None = None,
                        config: EngineConfig | None = None, device: str | torch.device = "cpu",
                        draft_model: str | None = None) -> "LLMEngine":
        """An engine for a checkpoint (reference executor, CPU) or an engine bundle (its kernels
        on `device`); `draft_model` (same forms) is loaded the same way for speculative='draft'."""
        from lmfoundry.runtime.loader import load_model

        config = config or EngineConfig()
        draft = load_model(draft_model, dtype=dtype, device=device)[0] if draft_model is not None else None
        if config.tensor_parallel_size > 1:
            from lmfoundry.runtime.engine.ranks import ShardSpec, load_sharded

            model, tokenizer = load_sharded(ShardSpec.on(str(path_or_name), dtype, config.tensor_parallel_size,
                                                         config.rank_threads, device, config.tp_backend))
            try:
                return cls(model, tokenizer, config, draft)
            except BaseException:
                model.close()
                raise
        model, tokenizer = load_model(path_or_name, dtype=dtype, device=device)
        return cls(model, tokenizer, config, draft)

    def release_eager_weights(self) -> int:
        """Drop the eager copy of weights a compiled step also holds (`ReferenceModelExecutor.
        release_eager_linears`), for an engine that alone uses its model: `serve` asks, eval (which
        also scores whole windows on the model directly) does not. Kept with speculative
        decoding, whose verify steps are sized by the proposals. Returns the linears released."""
        release = getattr(self.runner.executor, "release_eager_linears", None)
        if release is None or self.speculator is not None:
            return 0
        return release(self.config.max_num_batched_tokens)

    def close(self) -> None:
        """Stop the processes of a tensor-parallel model (nothing to do for one process)."""
        close = getattr(self.model, "close", None)
        if close is not None:
            close()

    # ---- requests ---------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        return self.validator.encode(prompt)

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError for a request that can never run (see `RequestValidator`)."""
        self.validator.check(prompt_ids, params)

    def add_request(self, request_id: str | None, prompt: Prompt, params: SamplingParams,
                    arrival_time: float | None = None) -> str:
        """Encode, validate and add a request (offline callers); returns its id."""
        ids = self.encode(prompt)
        self.check_request(ids, params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        self.add(EngineRequest(request_id, ids, params, time.monotonic() if arrival_time is None else arrival_time))
        return request_id

    def add(self, request: EngineRequest) -> None:
        """Add a request validated by the caller (`RequestValidator`): nothing is checked again."""
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already running")
        params = request.params
        slot, key = self._lora_of(params)
        seqs = [Sequence(request.request_id, i, request.prompt_ids, params, request.arrival_time)
                for i in range(params.n)]
        for seq in seqs:
            seq.lora_slot, seq.lora_key = slot, key
            if params.constraint is not None:
                seq.grammar = self.grammars.matcher(params.constraint)
            self.detokenizer.start(seq)
            self.scheduler.add(seq)
        self._requests[request.request_id] = seqs
        self.num_prompt_tokens_total += len(request.prompt_ids)
        self.num_requests_total += 1

    def add_embedding(self, request_id: str, prompts: list[list[int]], arrival_time: float | None = None) -> None:
        """Add an embedding request of validated prompts (embedding.py): its inputs are scheduled
        like prefills, under the step budget, as earlier ones finish; `take_embeddings` hands out its
        result once every input is pooled."""
        if request_id in self._requests or request_id in self._embeddings:
            raise ValueError(f"request id {request_id!r} is already running")
        if not prompts:
            raise ValueError("an embedding request needs at least one input")
        self._embeddings[request_id] = EmbeddingJob(request_id, prompts,
                                                    time.monotonic() if arrival_time is None else arrival_time)

    def take_embeddings(self) -> list[EmbeddingResult]:
        """The embedding requests finished since the last call."""
        done, self._pooled = self._pooled, []
        return done

    def _feed_embeddings(self) -> None:
        for job in self._embeddings.values():
            for seq in job.feed(self.config.max_num_batched_tokens, self.config.max_num_seqs):
                self.scheduler.add(seq)

    def _pool(self, pooled: list[tuple[Sequence, list[float]]]) -> None:
        for seq, vector in pooled:
            self.scheduler.finish(seq, "stop")
            job = self._embeddings[seq.request_id]
            job.pooled(seq, vector)
            if job.finished:
                del self._embeddings[seq.request_id]
                self._pooled.append(job.result())

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks; False if it was not running."""
        job = self._embeddings.pop(request_id, None)
        seqs = job.active if job is not None else self._requests.pop(request_id, None)
        if seqs is None:
            return False
        for seq in seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        if self.speculator is not None:
            self.speculator.release(self.scheduler.running)
        return True

    def abort_all(self) -> list[str]:
        """Abort every request (after an internal error); returns their ids."""
        ids = [*self._requests, *self._embeddings]
        for request_id in ids:
            self.abort(request_id)
        return ids

    def has_unfinished(self) -> bool:
        return bool(self._requests or self._embeddings)

    @property
    def num_unfinished_seqs(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    # ---- stepping ---------------------------------------------------------------------------
    def step(self) -> list[StepEvent]:
        """Run one forward pass of the scheduled batch; return the sequences' new output.

        A failure is contained to the requests it belongs to: a sampling or detokenizing error fails
        that request alone; a failed forward pass (shared by the batch) fails the requests in the
        batch, and waiting ones still get their turn. A failed request gets one event with
        finish_reason "error" and `error` set, and its blocks are freed. With speculative decoding a
        sequence can get several tokens in a step, still in one event."""
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self.max_model_len)
        self._feed_embeddings()
        batch = self.scheduler.schedule()
        if not batch:
            return []
        try:
            result = self.runner.execute(batch)
        except EngineDead:  # the engine itself is gone (a lost tensor-parallel rank): not one batch's fault
            raise
        except Exception as exc:  # noqa: BLE001 - reported per request below
            for seq, _ in batch:
                seq.draft_token_ids = []
            return [self._fail(rid, exc) for rid in dict.fromkeys(seq.request_id for seq, _ in batch)]
        for seq, n in batch:
            seq.num_computed_tokens += n - len(seq.draft_token_ids)  # drafts count once accepted
            self.block_manager.cache_full_blocks(seq)
            for pos, lp in result.prompt_logprobs.get(seq.seq_id, ()):
                assert seq.prompt_logprobs is not None  # the runner scores prompts only of requests that ask
                seq.prompt_logprobs[pos] = lp
        self._pool(result.pooled)
        if result.logits is None:
            return []
        first = {seq.seq_id: seq.num_output_tokens == 0 for seq in result.sample_seqs}
        reasons: dict[int, str | None] = {}
        errors: dict[str, Exception] = {}

        def accept(seq: Sequence, token: int, logprob: TokenLogprob | None) -> bool:
            reasons[seq.seq_id] = reason = self._accept_token(seq, token, logprob)
            return reason is not None

        def on_error(seq: Sequence, exc: Exception) -> None:
            errors.setdefault(seq.request_id, exc)

        verify(self.sampler, result.logits, result.sample_seqs, result.num_rows, accept, on_error, self.speculator)
        events: list[StepEvent] = []
        for seq, rows in zip(result.sample_seqs, result.num_rows, strict=True):
            if seq.request_id in errors:
                continue
            if rows > 1 and not seq.is_finished:
                assert seq.num_computed_tokens == len(seq) - 1, seq  # the accepted drafts, not the new token
                self.block_manager.trim(seq, len(seq))  # blocks that only held rejected drafts
                self.block_manager.cache_full_blocks(seq)
            events.append(self._event(seq, reasons.get(seq.seq_id), first[seq.seq_id]))
        self._mark_finished_requests(events)
        events.extend(self._fail(rid, exc) for rid, exc in errors.items())
        if self.speculator is not None:
            self.speculator.release(self.scheduler.running)
        return events

    def _fail(self, request_id: str, exc: Exception) -> StepEvent:
        """Finish every sequence of a request with finish_reason "error" and free its blocks. The
        event is returned even if the request already left `_requests` (an `_accept_token` that raised
        after finishing it), since its caller has not been told it ended."""
        job = self._embeddings.pop(request_id, None)
        seqs = list(job.active) if job is not None else self._requests.pop(request_id, [])
        for seq in seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "error")
        return StepEvent(request_id=request_id, index=0, token_ids=[], text="", logprobs=None,
                         finish_reason="error", request_finished=True,
                         num_prompt_tokens=seqs[0].num_prompt_tokens if seqs else 0, num_cached_tokens=0, error=exc)

    def _accept_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> str | None:
        """Append one sampled token; returns the finish reason (the sequence is then finished and
        its blocks freed) or None. Stop strings are checked after every token, so a speculative
        step that accepts several tokens stops exactly where plain decoding would."""
        p = seq.params
        seq.token_ids.append(token)
        if seq.times.first_token is None:
            seq.times.first_token = time.monotonic()
        self.num_generation_tokens_total += 1
        if logprob is not None:
            seq.logprobs.append(logprob)
        reason = None
        if token in p.stop_token_ids or (token in self.eos_token_ids and not p.ignore_eos):
            reason = "stop"
        elif not p.detokenize:  # text and stop strings are the caller's (output_processor.py)
            if seq.grammar is not None and seq.grammar.is_finished:
                reason = "stop"
        else:
            checked = len(seq.output_text)
            self.detokenizer.update(seq)
            if seq.num_output_tokens >= p.min_tokens and self.detokenizer.find_stop(seq, checked):
                reason = "stop"
            elif seq.grammar is not None and seq.grammar.is_finished:
                reason = "stop"  # the structured output is complete: its grammar allows only EOS
                self.detokenizer.flush(seq)
        if reason is None and (seq.num_output_tokens >= p.max_tokens or len(seq) >= self.max_model_len):
            reason = "length"
            if p.detokenize:
                self.detokenizer.flush(seq)
        if reason is not None:
            self.scheduler.finish(seq, reason)
        return reason

    def _event(self, seq: Sequence, reason: str | None, first: bool) -> StepEvent:
        """The step's new output of seq (all tokens appended since its last event)."""
        p = seq.params
        new_ids = seq.output_token_ids[seq.num_emitted_tokens :]
        new_lps = seq.logprobs[seq.num_emitted_tokens :] if p.logprobs is not None else None
        seq.num_emitted_tokens = seq.num_output_tokens
        return StepEvent(
            request_id=seq.request_id,
            index=seq.index,
            token_ids=new_ids,
            text=Detokenizer.take_new_text(seq),
            logprobs=new_lps,
            finish_reason=reason,
            request_finished=False,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            prompt_logprobs=seq.prompt_logprobs if first else None,
            times=seq.times,
        )

    def _mark_finished_requests(self, events: list[StepEvent]) -> None:
        """Set request_finished on the last event of each request whose sequences are all
        finished, and forget the request. Only the last: a stream ends at that flag, so an earlier
        one would drop the step's later events of the same request (n > 1)."""
        for ev in reversed(events):
            seqs = self._requests.get(ev.request_id)
            if seqs is not None and all(s.is_finished for s in seqs):
                ev.request_finished = True
                del self._requests[ev.request_id]

    def stats(self) -> dict[str, float]:
        bm = self.block_manager
        return {
            "requests_running": len(self.scheduler.running),
            "requests_waiting": len(self.scheduler.waiting),
            "kv_blocks_used": bm.num_used_blocks,
            "kv_blocks_total": bm.num_blocks,
            "prefix_cache_hit_rate": bm.prefix_hit_rate,
            "prefix_cache_queries_tokens": bm.prefix_query_tokens,
            "prefix_cache_hits_tokens": bm.prefix_hit_tokens,
            "prompt_tokens": self.num_prompt_tokens_total,
            "generation_tokens": self.num_generation_tokens_total,
            "preemptions": self.scheduler.num_preemptions,
            "spec_draft_tokens": self.speculator.num_draft_tokens if self.speculator else 0,
            "spec_accepted_tokens": self.speculator.num_accepted_tokens if self.speculator else 0,
            "spec_acceptance_rate": self.speculator.acceptance_rate if self.speculator else 0.0,
            **self._lora_stats(),
        }
