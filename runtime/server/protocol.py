"""OpenAI request schemas (strictly typed: a field of the wrong type is a 400, unknown fields are
ignored) and their mapping onto `SamplingParams`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from lmfoundry.runtime.engine.sampling_params import SamplingParams


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    ignore_eos: bool = False  # vLLM extension (benchmarks fix the output length with it)
    min_tokens: int = 0  # vLLM extension
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def unsupported(self) -> str | None:
        """Name a requested feature this server does not implement (rather than ignoring it)."""
        if self.presence_penalty or self.frequency_penalty:
            return "presence_penalty and frequency_penalty are not supported"
        if self.logit_bias:
            return "logit_bias is not supported"
        return None

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
                        ) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            seed=self.seed,
            n=self.n,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
        )


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> str | None:
        if self.suffix:
            return "suffix is not supported"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of other than n is not supported"
        return super().unsupported()

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name:
            out["name"] = self.name
        return out


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> str | None:
        if self.tools:
            return "tools are not supported"
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            return "response_format other than text is not supported"
        return super().unsupported()

    @property
    def wanted_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
