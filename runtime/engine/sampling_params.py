"""Per-request decoding settings, validated once when the request enters the engine.

The fields follow vLLM / the OpenAI API so that the server maps requests onto them one to one.
`temperature == 0` means greedy (argmax, first index on ties, as transformers' greedy `generate`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # top-N log-probabilities per generated token (0: sampled token only)
    prompt_logprobs: int | None = None  # same for every prompt token (None: not computed)
    # First prompt position whose logprob is wanted: earlier tokens may then come from the prefix
    # cache (scoring continuations of a shared context recomputes only the continuations).
    prompt_logprobs_start: int = 1
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        self.stop_token_ids = list(self.stop_token_ids or [])

    def validate(self) -> None:
        """Raise ValueError naming the first bad field (the server turns it into a 400)."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off), 0 (off) or positive, got {self.top_k}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.prompt_logprobs_start < 1:
            raise ValueError(f"prompt_logprobs_start must be at least 1, got {self.prompt_logprobs_start}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
