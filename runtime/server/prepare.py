"""Request preparation: a request body becomes the prepared object every later stage reads.

A completion or chat body is parsed once, checked once, templated and tokenized, and its
`SamplingParams`, tool tool_choice and output constraint are worked out once; the result
(`PreparedCompletion`, `PreparedChat`) is all the engine submission and the response builders
need, so none of them goes back to the request schema or to the server. It runs in the server's
preparation threads (a chat template or a multi-megabyte prompt takes a while), so nothing here
touches the event loop; every refusal is an `APIError` naming the field at fault.

`Preparer.adapters` is the set of LoRA adapters a request's `model` may name; lora_routes.py
replaces it (one assignment, so a preparation thread sees the old set or the new one) when the
engine loads or unloads one.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel

from lmfoundry.runtime.engine.sampling_params import SamplingParams
from lmfoundry.runtime.engine.validation import RequestValidator
from lmfoundry.runtime.server.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest, FieldError
from lmfoundry.runtime.server.request_body import APIError, parse_body
from lmfoundry.runtime.server.tools import ToolChoice

M = TypeVar("M", bound=BaseModel)
# /v1/embeddings: OpenAI's limits on one request (more is a 400). The engine schedules the inputs a
# step's token budget at a time, so these bound a request's memory and duration, not its stalls.
MAX_EMBEDDING_INPUTS = 2048
MAX_EMBEDDING_TOKENS = 300_000


@dataclass(frozen=True)
class PreparedCompletion:
    """A /v1/completions request ready to submit: one engine request per prompt."""

    req: CompletionRequest
    prompts: list[list[int]]
    params: SamplingParams
    model: str  # the `model` the response reports
    echo_texts: list[str]  # with `echo`, each prompt's text (token-id prompts decoded); else empty


@dataclass(frozen=True)
class PreparedChat:
    """A chat request (from /v1/chat/completions or /v1/responses) ready to submit."""

    req: ChatCompletionRequest
    prompt: list[int]
    params: SamplingParams
    tools: ToolChoice  # resolved once; the response turns the output into tool calls by it
    model: str  # the `model` the response reports


class Preparer:
    """Parses, checks, templates and tokenizes requests for one served model."""

    def __init__(self, validator: RequestValidator, model_name: str, names: set[str], adapters: set[str],
                 max_n: int, lenient: bool) -> None:
        self.validator = validator
        self.tokenizer = validator.tokenizer
        self.info = validator.info
        self.model_name = model_name
        self.names = names
        self.adapters = adapters
        self.max_n = max_n
        self.lenient = lenient

    def parse(self, body: bytes, schema: type[M]) -> M:
        """A request body as `schema`; unknown fields per `ApiOptions.lenient_request_fields`."""
        return parse_body(body, schema, self.lenient)  # type: ignore[no-any-return]

    def check_model(self, model: str | None, without_adapters: str | None = None) -> None:
        """A 404 for a `model` that is neither served nor a loaded adapter. `without_adapters`: the
        endpoint, when it computes with the base weights only; an adapter's name there is a 400, as
        answering with the base's output under the adapter's name would be a silent wrong answer."""
        if model is not None and model not in self.names and model not in self.adapters:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                                f"{self.model_name!r}", code="model_not_found", param="model")
        if without_adapters is not None and model is not None and model not in self.names:
            raise APIError(400, f"{model!r} is a LoRA adapter, which {without_adapters} cannot apply (it runs the "
                                f"base model); send model {self.model_name!r}", param="model")

    def token_text(self, token_id: int) -> str:
        """One token's text, as logprobs report it."""
        if self.tokenizer is None:
            return f"<{token_id}>"
        return self.tokenizer.decode([token_id])  # type: ignore[no-any-return]

    # ---- /v1/completions --------------------------------------------------------------------
    def completion(self, body: bytes) -> PreparedCompletion:
        req = self.parse(body, CompletionRequest)
        self._check_common(req)
        given = req.prompts()
        prompts = [self._encode(p) for p in given]
        if not prompts:
            raise APIError(400, "prompt is empty", param="prompt")
        if req.max_tokens is None:
            max_tokens = self.info.max_model_len - max(len(p) for p in prompts)
        else:
            max_tokens = req.max_tokens
        if max_tokens == 0:
            # OpenAI's way to score a prompt (echo its logprobs, generate nothing). The engine
            # always produces one token; CompletionBuilder leaves it out of the response.
            if not req.echo:
                raise APIError(400, "max_tokens must be at least 1 (0 only with echo: true, to score the prompt)",
                               param="max_tokens")
            if req.min_tokens:
                raise APIError(400, "min_tokens must be 0 when max_tokens is 0", param="min_tokens")
            max_tokens = 1
        want_prompt_lps = req.echo and req.logprobs is not None
        params = self._params(req, max_tokens, req.logprobs, req.logprobs if want_prompt_lps else None)
        self._check_schema(params.json_schema, "response_format")
        for ids in prompts:
            self._check(ids, params)
        echo_texts = [self._prompt_text(p) for p in given] if req.echo else []
        return PreparedCompletion(req, prompts, params, self._reported(req.model), echo_texts)

    def _prompt_text(self, prompt: str | list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        return self.tokenizer.decode(prompt) if self.tokenizer else ""  # type: ignore[no-any-return]

    # ---- /v1/chat/completions ---------------------------------------------------------------
    def chat(self, body: bytes) -> PreparedChat:
        return self.chat_request(self.parse(body, ChatCompletionRequest))

    def chat_request(self, req: ChatCompletionRequest) -> PreparedChat:
        """Template, tokenize and check a parsed chat request (also /v1/responses' path)."""
        self._check_common(req)
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions")
        try:
            tool_choice = req.resolve_tool_choice(self.lenient)
        except FieldError as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        ids = self._template(req, tool_choice)
        max_tokens = req.wanted_max_tokens
        if max_tokens is None:
            max_tokens = max(1, self.info.max_model_len - len(ids))
        top = req.top_logprobs if req.logprobs else None
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        params = self._params(req, max_tokens, (top or 0) if req.logprobs else None, tools=tool_choice)
        if tool_choice.constrained:
            for i, tool in enumerate(req.tools or []):  # name the function whose schema is refused
                if tool_choice.mode == "required" or tool.function.name == tool_choice.named:
                    self._check_schema(tool_choice.functions[tool.function.name], f"tools[{i}].function.parameters")
            if tool_choice.mode == "required":  # a named call's schema is its function's, checked above
                self._check_schema(params.json_schema, "tools")
        else:
            self._check_schema(params.json_schema, "response_format")
        self._check(ids, params)
        return PreparedChat(req, ids, params, tool_choice, self._reported(req.model))

    @functools.cached_property
    def _template_call_arguments(self) -> frozenset[str]:
        """The named arguments of the tokenizer's `apply_chat_template`: template variables may not
        take these names (read once, not on every request)."""
        call = inspect.signature(self.tokenizer.apply_chat_template).parameters
        return frozenset(n for n, p in call.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))

    def _template(self, req: ChatCompletionRequest, tool_choice: ToolChoice) -> list[int]:
        """The prompt's token ids: the messages (and tools) through the model's chat template."""
        # With tool_choice "none" the tools stay out of the prompt: the request runs as one without tools.
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []] if tool_choice.mode != "none" else None
        variables = req.chat_template_kwargs or {}
        if variables and (taken := sorted(set(variables) & self._template_call_arguments)):
            raise APIError(400, f"chat_template_kwargs.{taken[0]} is an argument of the template call, not a template "
                                "variable", param="chat_template_kwargs")
        try:
            text = self.tokenizer.apply_chat_template(
                [m.as_template_input() for m in req.messages], tools=tools, tokenize=False,
                add_generation_prompt=True, **variables)
        except Exception as exc:  # noqa: BLE001 - template errors are the request's fault
            raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from None
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    # ---- /v1/embeddings ---------------------------------------------------------------------
    def embedding(self, body: bytes) -> tuple[EmbeddingRequest, list[list[int]]]:
        req = self.parse(body, EmbeddingRequest)
        self.check_model(req.model, without_adapters="/v1/embeddings")
        hidden = self.info.hidden_size
        if req.dimensions is not None and req.dimensions != hidden:
            raise APIError(400, f"dimensions must be this model's {hidden} (embeddings are not truncated)",
                           param="dimensions")
        inputs = req.inputs()
        if len(inputs) > MAX_EMBEDDING_INPUTS:
            raise APIError(400, f"input has {len(inputs)} items; at most {MAX_EMBEDDING_INPUTS} a request",
                           param="input")
        prompts = [self._encode(p) for p in inputs]
        if not prompts:
            raise APIError(400, "input must not be empty", param="input")
        if (total := sum(len(ids) for ids in prompts)) > MAX_EMBEDDING_TOKENS:
            raise APIError(400, f"input has {total} tokens in all; at most {MAX_EMBEDDING_TOKENS} a request",
                           param="input")
        max_len = self.info.max_model_len
        for ids in prompts:
            try:
                self.validator.check_ids(ids)
            except ValueError as exc:
                raise APIError(400, str(exc), param="input") from None
            if len(ids) > max_len:
                raise APIError(400, f"an input has {len(ids)} tokens; this model's context is {max_len}",
                               param="input")
        return req, prompts

    # ---- shared checks ----------------------------------------------------------------------
    def _check_common(self, req: CompletionRequest | ChatCompletionRequest) -> None:
        self.check_model(req.model)
        if not 1 <= req.n <= self.max_n:
            raise APIError(400, f"n must be between 1 and {self.max_n}, got {req.n}", param="n")
        if (reason := req.unsupported()) is not None:
            raise APIError(400, reason)

    def _reported(self, requested: str | None) -> str:
        """The `model` a response reports: the adapter a request named, else the served name."""
        return requested if requested is not None and requested in self.adapters else self.model_name

    def _encode(self, prompt: str | list[int]) -> list[int]:
        try:
            return self.validator.encode(prompt)
        except ValueError as exc:
            raise APIError(400, str(exc), param="prompt") from None

    def _params(self, req: CompletionRequest | ChatCompletionRequest, max_tokens: int, logprobs: int | None,
                prompt_logprobs: int | None = None, tools: ToolChoice | None = None) -> SamplingParams:
        """The request's SamplingParams; a malformed field (a logit_bias key that is not a token
        id, a response_format that cannot be honoured) is a 400 naming it."""
        try:
            params = req.sampling_params(max_tokens, logprobs, prompt_logprobs, tools)
        except FieldError as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        params.detokenize = False  # text and stop strings are worked out in the server, not in the engine
        params.lora = req.model if req.model in self.adapters else None  # `model` names an adapter or the base
        return params

    def _check_schema(self, schema: dict[str, Any] | None, param: str) -> None:
        """A 400 naming `param` for a JSON schema that cannot constrain decoding. Compiling here
        caches it for the request's one validation (`_check`)."""
        if schema is None:
            return
        try:
            self.validator.grammars.check(schema)
        except ValueError as exc:
            raise APIError(400, f"{param}: {exc}", param=param) from None

    def _check(self, ids: list[int], params: SamplingParams) -> None:
        """The request's one validation (`RequestValidator`); the engine trusts what passes."""
        try:
            self.validator.check(ids, params)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
