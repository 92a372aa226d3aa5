"""What the engine hands back: per-step deltas (for streaming) and whole results (offline).

Torch-free: the API process unpickles these, and it never imports torch (see `core_client`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """Log-probability of one chosen token and the top alternatives at that position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class SequenceTimes:
    """When (time.monotonic, shared by the processes of one machine) the sequence was first
    scheduled, got its first output token and finished: its queue, prefill and decode times."""

    scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


@dataclass
class StepEvent:
    """New output of one sequence after one engine step."""

    request_id: str
    index: int  # choice index within the request
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # "stop", "length", "abort", "error" or None while running
    request_finished: bool  # every sequence of the request is finished
    num_prompt_tokens: int
    num_cached_tokens: int
    prompt_logprobs: list[TokenLogprob | None] | None = None  # once, on the sequence's first event
    # Why the request failed (finish_reason "error"): the engine failed it alone and freed its blocks.
    error: Exception | None = None
    times: SequenceTimes | None = None  # when it was scheduled, got its first token, finished (so far)


@dataclass
class EmbeddingResult:
    """The embeddings of one /v1/embeddings request (one vector a prompt), delivered at once."""

    request_id: str
    embeddings: list[list[float]]
    num_tokens: int
    request_finished: bool = True


@dataclass
class LoRAResult:
    """The outcome of loading or unloading a LoRA adapter at run time (`EngineClient.lora`):
    `status` is the HTTP status the server answers with (200, or the refusal's)."""

    request_id: str
    status: int
    message: str
    adapters: tuple[str, ...] = ()  # the adapters loaded afterwards
    request_finished: bool = True


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else sum(lp.logprob for lp in self.logprobs)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TokenLogprob | None] | None = None  # [0] is None: nothing predicts it
    num_cached_tokens: int = 0
    finished: bool = False

    def add(self, ev: StepEvent) -> None:
        out = self.outputs[ev.index]
        out.text += ev.text
        out.token_ids.extend(ev.token_ids)
        if ev.logprobs is not None:
            out.logprobs = (out.logprobs or []) + ev.logprobs
        if ev.finish_reason is not None:
            out.finish_reason = ev.finish_reason
        if ev.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = ev.prompt_logprobs
        self.num_cached_tokens = max(self.num_cached_tokens, ev.num_cached_tokens)
        self.finished = ev.request_finished
