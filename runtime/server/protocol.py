"""OpenAI request schemas (strictly typed: a field of the wrong type is a 400) and their mapping
onto `SamplingParams`.

Unknown fields are a 400 naming them, as OpenAI answers (a typo such as `max_token` must not pass
silently): every request schema forbids extra fields, and `request_body.parse_body` is the one
place that turns them into that 400, or, under `serve --lenient-request-fields`, logs and drops
them (vLLM's behaviour); `tool_choice`, checked on its own, goes through the same code
(`parse_field`). Message objects are the exception: clients send back the assistant
messages they received, with keys a chat template never reads (`refusal`, `annotations`,
`reasoning_content`, ...), so their other keys are left out of the template rather than refused.
Fields a client may send that change nothing here are declared and accepted (`user`, `store`,
`metadata`, `service_tier`, ...); fields naming a feature this server does not implement are
declared too, and refused by name when given (`unsupported`).

Sampling fields are OpenAI's (`presence_penalty`, `frequency_penalty`, `logit_bias` with token ids
as string keys) plus vLLM's extensions (`top_k`, `min_p`, `repetition_penalty`, `min_tokens`,
...). Their ranges are checked once, by `SamplingParams.validate`, so the engine and the server
refuse the same values with the same message.

Structured output: `response_format` (`text`, `json_object`, or `json_schema` with a named schema)
on both endpoints, and on chat `tools` / `tool_choice` / `parallel_tool_calls` (see `tools.py`),
become `SamplingParams.json_schema`. The shapes are checked here; whether a schema can be enforced
is checked by the engine, which compiles it.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from lmfoundry.runtime.engine.sampling_params import SamplingParams
from lmfoundry.runtime.server.request_body import parse_field
from lmfoundry.runtime.server.tools import NAME_PATTERN, NO_PARAMETERS, ToolChoice, ToolMode


class FieldError(ValueError):
    """A request field whose value the server refuses: a 400 naming `param`."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class StrictModel(BaseModel):
    """A request body part that refuses unknown fields and loose types (a 400 naming them)."""

    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(StrictModel):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # OpenAI's padding of stream chunks: none is added here


class JsonSchemaFormat(StrictModel):
    """`response_format.json_schema` (OpenAI): a named schema. `strict` is accepted; the schema is
    always enforced (decoding cannot leave it), and keywords that cannot be enforced are a 400."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def output_schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must match; None for text. `json_object` is any JSON object;
        a `json_schema` without `schema` is any JSON value."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "object"}
        if self.json_schema is None:
            raise FieldError("response_format.json_schema is required when response_format.type is 'json_schema'",
                             "response_format.json_schema")
        if not NAME_PATTERN.fullmatch(self.json_schema.name):
            raise FieldError("response_format.json_schema.name must be 1 to 64 letters, digits, '_' or '-', "
                             f"got {self.json_schema.name!r}", "response_format.json_schema.name")
        return self.json_schema.schema_ if self.json_schema.schema_ is not None else {}


# vLLM's request fields this server does not implement, with vLLM's default: any other value is
# refused by name (HTTP 400) rather than ignored, so a client relying on one learns it here instead
# of from unconstrained output; the default (what vLLM's own clients send) passes.
VLLM_UNSUPPORTED: dict[str, Any] = {
    "guided_whitespace_pattern": None, "guided_decoding_backend": None, "use_beam_search": False,
    "length_penalty": 1.0, "allowed_token_ids": None, "bad_words": [], "truncate_prompt_tokens": None,
    "spaces_between_special_tokens": True, "priority": 0, "logits_processors": None, "vllm_xargs": None}
STRUCTURED_OUTPUT_KEYS = ("json", "regex", "choice", "grammar")  # of vLLM's `structured_outputs`, the ones implemented


class _Sampling(StrictModel):
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
    repetition_penalty: float | None = None  # vLLM extension
    min_p: float | None = None  # vLLM extension
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM: the same constraint as a json_schema response_format
    structured_outputs: dict[str, Any] | None = None  # vLLM >= 0.10: {"json" | "regex" | "choice" | "grammar": ...}
    guided_regex: str | None = None  # vLLM: the whole output matches this regular expression
    guided_choice: list[str] | None = None  # vLLM: the output is one of these strings
    guided_grammar: str | None = None  # vLLM: the output follows this Lark grammar (llguidance's dialect)
    # VLLM_UNSUPPORTED, declared so that they are refused by name (`unsupported`), not as unknown
    guided_whitespace_pattern: Any = None
    guided_decoding_backend: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    truncate_prompt_tokens: Any = None
    spaces_between_special_tokens: Any = None
    priority: Any = None
    logits_processors: Any = None
    vllm_xargs: Any = None

    def unsupported(self) -> str | None:
        """Name a requested feature this server does not implement (rather than ignoring it)."""
        for name, default in VLLM_UNSUPPORTED.items():
            if (value := getattr(self, name)) is not None and value != default:
                return (f"{name} (a vLLM extension) is not supported; response_format, guided_json, guided_regex, "
                        f"guided_choice and guided_grammar are")
        for key, value in (self.structured_outputs or {}).items():
            if key not in STRUCTURED_OUTPUT_KEYS and value is not None:
                return f"structured_outputs.{key} is not supported; {', '.join(STRUCTURED_OUTPUT_KEYS)} are"
        return None

    def token_bias(self) -> dict[int, float]:
        """logit_bias with integer token ids. JSON object keys are strings: a key that is not a
        (possibly negative) decimal integer raises FieldError; ranges are `SamplingParams`'s."""
        out = {}
        for key, value in (self.logit_bias or {}).items():
            if not re.fullmatch(r"-?[0-9]{1,12}", key):
                raise FieldError(f"logit_bias keys must be token ids (decimal integers), got {key!r}", "logit_bias")
            out[int(key)] = value
        return out

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
                        tools: ToolChoice | None = None) -> SamplingParams:
        """The engine's settings for this request (FieldError for a malformed logit_bias key or
        response format); `tools`: a chat request's resolved tool choice (`resolve_tool_choice`)."""
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
            presence_penalty=0.0 if self.presence_penalty is None else self.presence_penalty,
            frequency_penalty=0.0 if self.frequency_penalty is None else self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_p=0.0 if self.min_p is None else self.min_p,
            logit_bias=self.token_bias(),
            **self.output_constraint(tools),
        )

    def _guided(self) -> list[tuple[str, Any]]:
        """The non-JSON constraints the request gives, by field name."""
        so = self.structured_outputs or {}
        return [(name, v) for name, v in (
            ("guided_regex", self.guided_regex), ("structured_outputs.regex", so.get("regex")),
            ("guided_choice", self.guided_choice), ("structured_outputs.choice", so.get("choice")),
            ("guided_grammar", self.guided_grammar), ("structured_outputs.grammar", so.get("grammar")))
            if v is not None]

    def output_constraint(self, tools: ToolChoice | None = None) -> dict[str, Any]:
        """The SamplingParams field that constrains the output (none: free text): the call schema of
        a constrained tool choice (`resolve_tool_choice` refused any other constraint beside it), a JSON schema
        (output_schema), a regular expression (guided_regex, structured_outputs.regex), one of
        several strings (guided_choice, structured_outputs.choice: a grammar of literals) or a Lark
        grammar (guided_grammar, structured_outputs.grammar); one at a time."""
        if tools is not None and tools.constrained:
            return {"json_schema": tools.output_schema()}
        given = self._guided()
        schema = self.output_schema()
        if schema is not None:
            given.insert(0, ("response_format", schema))
        if len(given) > 1:
            raise FieldError(f"{given[0][0]} and {given[1][0]} both constrain the output; give one", given[1][0])
        if not given:
            return {}
        name, value = given[0]
        if schema is not None:
            return {"json_schema": schema}
        if name.endswith("choice"):
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise FieldError(f"{name} must be a non-empty list of non-empty strings", name)
            return {"grammar": "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)}
        if not isinstance(value, str) or not value:
            raise FieldError(f"{name} must be a non-empty string", name)
        return {"regex": value} if name.endswith("regex") else {"grammar": value}

    def output_schema(self) -> dict[str, Any] | None:
        """The JSON schema decoding is constrained to (None: free text): response_format, or vLLM's
        guided_json / structured_outputs.json (a schema object, or its JSON text), one at a time."""
        given = [(name, v) for name, v in (("response_format", self.response_format), ("guided_json", self.guided_json),
                 ("structured_outputs.json", (self.structured_outputs or {}).get("json"))) if v is not None]
        if len(given) > 1:
            raise FieldError(f"{given[0][0]} and {given[1][0]} both constrain the output; give one", given[1][0])
        if not given:
            return None
        name, value = given[0]
        if isinstance(value, ResponseFormat):
            return value.output_schema()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise FieldError(f"{name} must be a JSON schema (an object, or its JSON text): {exc}", name) from None
        if not isinstance(value, dict):
            raise FieldError(f"{name} must be a JSON schema object, got {type(value).__name__}", name)
        return value


def prompt_list(value: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """OpenAI's prompt/input forms as a list of prompts: one text, one list of token ids, or a
    list of either."""
    if isinstance(value, str):
        return [value]
    if value and all(isinstance(x, int) for x in value):
        return [value]  # type: ignore[list-item]
    return list(value)  # type: ignore[arg-type]


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
        return prompt_list(self.prompt)


class TextPart(StrictModel):
    model_config = ConfigDict(strict=True, extra="ignore")  # part of a message (see the module doc)
    type: Literal["text"]
    text: str


def _template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's tool call as chat templates read it: OpenAI sends `arguments` as a
    JSON string, while templates (Llama 3.1, Qwen 2.5, Hermes) render `arguments | tojson` and
    expect an object, so a string holding a JSON object is parsed."""
    function = call.get("function")
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            args = json.loads(function["arguments"])
        except ValueError:
            return call
        if isinstance(args, dict):
            return {**call, "function": {**function, "arguments": args}}
    return call


class ChatMessage(StrictModel):
    model_config = ConfigDict(strict=True, extra="ignore")  # see the module doc
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a "tool" turn: the call it answers

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [_template_tool_call(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class FunctionDefinition(StrictModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; absent: no arguments
    strict: bool | None = None  # accepted; constrained calls always follow the schema


class ToolDefinition(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    # "none", "auto", "required" or a NamedToolChoice; parsed by `resolve_tool_choice` so that a bad value is
    # one clear 400 rather than an error per member of a union.
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM: variables for the chat template (enable_thinking)
    # OpenAI fields that change nothing here: nothing is stored, there is one service tier, the
    # prefix cache needs no key, and a prediction only ever changes latency
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    prediction: dict[str, Any] | None = None
    # OpenAI fields this server cannot honour: refused by name when given (`unsupported`)
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    verbosity: Any = None

    def unsupported(self) -> str | None:
        if self.functions is not None or self.function_call is not None:
            return "functions and function_call (deprecated by OpenAI) are not supported; use tools and tool_choice"
        if self.modalities not in (None, ["text"]):
            return "modalities other than [\"text\"] are not supported"
        for name in ("audio", "reasoning_effort", "web_search_options", "verbosity"):
            if getattr(self, name) is not None:
                return f"{name} is not supported by this server"
        return super().unsupported()

    def resolve_tool_choice(self, lenient: bool = False) -> ToolChoice:
        """The resolved tool choice (FieldError for tools or a tool_choice that cannot be honoured;
        APIError, from `parse_field`, for a named tool_choice's unknown or mistyped keys): "auto"
        when tools are given without a tool_choice, "none" without tools. `lenient`: unknown keys of
        a named tool_choice are dropped, as the body's are (`--lenient-request-fields`)."""
        tools = self.tools or []
        choice = self._tool_choice(lenient)
        if not tools:
            if choice is not None and choice != "none":
                raise FieldError("tool_choice needs tools", "tool_choice")
            return ToolChoice("none")
        functions: dict[str, dict[str, Any]] = {}
        for i, tool in enumerate(tools):
            name = tool.function.name
            if not NAME_PATTERN.fullmatch(name):
                raise FieldError(f"tools[{i}].function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}",
                                 f"tools[{i}].function.name")
            if name in functions:
                raise FieldError(f"tools[{i}].function.name {name!r} is given twice", f"tools[{i}].function.name")
            functions[name] = tool.function.parameters if tool.function.parameters is not None else NO_PARAMETERS
        parallel = self.parallel_tool_calls is not False
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in functions:
                raise FieldError(f"tool_choice names the function {choice.function.name!r}, which is not in tools",
                                 "tool_choice")
            resolved = ToolChoice("named", functions, choice.function.name, parallel)
        else:
            mode: ToolMode = "none" if choice == "none" else "required" if choice == "required" else "auto"
            resolved = ToolChoice(mode, functions, None, parallel)
        if resolved.constrained and (self.output_schema() is not None or self._guided()):
            raise FieldError("response_format (or a guided_* constraint) cannot be combined with tool_choice "
                             "'required' or a named function (the output is the tool call)", "response_format")
        return resolved

    def _tool_choice(self, lenient: bool) -> str | NamedToolChoice | None:
        choice = self.tool_choice
        if choice is None or choice in ("none", "auto", "required"):
            return choice
        if isinstance(choice, dict):  # unknown keys as anywhere in the body (an APIError naming them)
            return parse_field(choice, NamedToolChoice, lenient, "tool_choice")  # type: ignore[no-any-return]
        raise FieldError("tool_choice must be 'none', 'auto', 'required' or "
                         f'{{"type": "function", "function": {{"name": ...}}}}, got {choice!r}', "tool_choice")

    @property
    def wanted_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class EmbeddingRequest(StrictModel):
    """POST /v1/embeddings (OpenAI's shape)."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        return prompt_list(self.input)


class TokenizeRequest(StrictModel):
    """POST /tokenize (vLLM's endpoint; lm-eval's remote tokenizer backend uses it)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(StrictModel):
    """POST /detokenize (vLLM's endpoint)."""

    model: str | None = None
    tokens: list[int]
