"""Per-request decoding settings, validated once when the request enters the engine.

The fields follow vLLM / the OpenAI API so that the server maps requests onto them one to one.
`temperature == 0` means greedy (argmax, first index on ties, as transformers' greedy `generate`).

Logits processing (applied by the sampler to greedy and sampled rows alike, so penalties change
greedy choices too): `logit_bias` (OpenAI: token id -> value added to the logit, -100..100),
`repetition_penalty` (HF/vLLM: a logit of a token seen in the prompt or the output is divided by
it when positive, multiplied by it otherwise), `frequency_penalty` and `presence_penalty` (OpenAI:
subtract count * frequency + (count > 0) * presence, counts over the generated tokens only), and
`min_p` (drop tokens whose probability is below min_p times the most likely token's).

Structured output: `json_schema` (a JSON schema as a dict) constrains the output to JSON matching
it (OpenAI's `response_format` `json_object` is `{"type": "object"}`); the sampler masks every
token the grammar forbids, on greedy and sampled rows alike (see `grammar.py`); `regex` and
`grammar` (Lark) constrain it the same way, one constraint a request. Whether it can be enforced is
checked by the request's validation (`RequestValidator`), which compiles it.

`validate` is the only gate between a request and the engine thread, where a bad value would fail
inside a batched step; so it checks types as well as ranges (a bool is not accepted as a number,
NaN and infinities are refused). Checks that need the model (stop token ids and logprobs against the
vocabulary) are in `LLMEngine.check_request`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Real
from typing import Any

MAX_LOGPROBS = 20
SEED_LIMIT = 2**64  # seeds are unsigned 64-bit, as torch.Generator takes them
PENALTY_LIMIT = 2.0  # OpenAI's range for presence_penalty and frequency_penalty: [-2, 2]
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
# repetition_penalty divides positive logits and multiplies negative ones by it: within [1/100, 100]
# every finite logit stays finite in float32 (1e-300 passed a "> 0" check and made the row inf)
REPETITION_PENALTY_RANGE = (0.01, 100.0)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: Any, lo: int, hi: int | None = None) -> None:
    if not _is_int(value) or value < lo or (hi is not None and value > hi):
        bounds = f"in [{lo}, {hi}]" if hi is not None else f"an integer >= {lo}"
        raise ValueError(f"{name} must be {bounds}, got {value!r}")


def _is_finite(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


def _check_range(name: str, value: Any, lo: float, hi: float) -> None:
    if not _is_finite(value) or not lo <= value <= hi:
        raise ValueError(f"{name} must be a number in [{lo:g}, {hi:g}], got {value!r}")


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
    presence_penalty: float = 0.0  # OpenAI, over generated tokens
    frequency_penalty: float = 0.0  # OpenAI, over generated tokens
    repetition_penalty: float = 1.0  # HF/vLLM, over prompt and generated tokens (1: off)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    min_p: float = 0.0  # 0: off
    json_schema: dict[str, Any] | None = None  # output constrained to JSON matching this schema
    regex: str | None = None  # output constrained to match this regular expression (whole output)
    grammar: str | None = None  # output constrained to this Lark grammar (llguidance's dialect)
    # Whether the engine turns tokens into text and ends the output at stop strings. A server sets
    # it off: its API process does both (output_processor.py), off the engine's cores.
    detokenize: bool = True
    # The LoRA adapter (its served name) this request runs with; None: the base model.
    lora: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s] if isinstance(self.stop, (list, tuple)) else self.stop
        if isinstance(self.stop_token_ids, (list, tuple)) or self.stop_token_ids is None:
            self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is None:
            self.logit_bias = {}

    def validate(self) -> None:
        """Raise ValueError naming the first bad field (the server turns it into a 400)."""
        _check_int("max_tokens", self.max_tokens, 1)
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if not isinstance(value, Real) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off), 0 (off) or positive, got {self.top_k!r}")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < SEED_LIMIT):
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        _check_int("n", self.n, 1)
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        _check_int("prompt_logprobs_start", self.prompt_logprobs_start, 1)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, 0, MAX_LOGPROBS)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        for token_id in self.stop_token_ids:
            if not _is_int(token_id) or token_id < 0:
                raise ValueError(f"stop_token_ids must be token ids (integers >= 0), got {token_id!r}")
        _check_range("presence_penalty", self.presence_penalty, -PENALTY_LIMIT, PENALTY_LIMIT)
        _check_range("frequency_penalty", self.frequency_penalty, -PENALTY_LIMIT, PENALTY_LIMIT)
        low, high = REPETITION_PENALTY_RANGE
        if not _is_finite(self.repetition_penalty) or not low <= self.repetition_penalty <= high:
            raise ValueError(f"repetition_penalty must be a number in [{low:g}, {high:g}] (1: off), "
                             f"got {self.repetition_penalty!r}")
        _check_range("min_p", self.min_p, 0.0, 1.0)
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
        for token_id, bias in self.logit_bias.items():
            if not _is_int(token_id) or token_id < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token_id!r}")
            _check_range(f"logit_bias[{token_id}]", bias, -LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT)
        given = [n for n in ("json_schema", "regex", "grammar") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(f"{given[0]} and {given[1]} both constrain the output; give one")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {type(getattr(self, name)).__name__}")
        if self.lora is not None and (not isinstance(self.lora, str) or not self.lora):
            raise ValueError(f"lora must be an adapter name, got {self.lora!r}")
        if self.json_schema is not None and not isinstance(self.json_schema, dict):
            raise ValueError(f"json_schema must be a JSON schema object (a dict), got {type(self.json_schema).__name__}")

    def check_token_ids(self, vocab_size: int) -> None:
        """Raise ValueError for a logit_bias id outside the model's vocabulary. Separate from
        `validate` because it needs the model; the server calls it with the model's vocabulary
        size, and the sampler fails only the offending request if one still gets through."""
        bad = [t for t in self.logit_bias if t >= vocab_size]
        if bad:
            raise ValueError(f"logit_bias token ids must be in [0, {vocab_size}), got {min(bad)}")

    @property
    def constraint(self) -> tuple[str, Any] | None:
        """What the output is constrained to, for the grammar compiler: ("json", schema),
        ("regex", pattern), ("lark", grammar) or None (free text)."""
        if self.json_schema is not None:
            return ("json", self.json_schema)
        if self.regex is not None:
            return ("regex", self.regex)
        if self.grammar is not None:
            return ("lark", self.grammar)
        return None

    @property
    def penalized(self) -> bool:
        """Whether any penalty applies (the sampler reads this row's token counts only then)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
