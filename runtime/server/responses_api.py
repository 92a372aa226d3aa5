"""POST /v1/responses, OpenAI's Responses API, for text and function calls: `input` (a string, or
messages, `function_call` and `function_call_output` items), `instructions` (a system message
first), `max_output_tokens`, `temperature`, `top_p`, `stream`, `text.format` (json_schema /
json_object) and function `tools` with `tool_choice`, both through the grammar path.

A response is a chat completion underneath: the request becomes a `ChatCompletionRequest` and
runs the chat path (template, one validation, engine, detokenization); its deltas become the
Responses object, or its server-sent events (`response.created`, `response.output_item.added`,
`response.content_part.added`, `response.output_text.delta`..., the matching `.done` events and
`response.completed`; a function call is a `function_call` output item with its
`response.function_call_arguments.delta` events). Responses are not stored:
`previous_response_id` is a 400, as are hosted tools (web search, files, ...).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator

from pydantic import ValidationError

from lmfoundry.runtime.engine.outputs import StepEvent
from lmfoundry.runtime.server.prepare import PreparedChat, Preparer
from lmfoundry.runtime.server.protocol import ChatCompletionRequest, StrictModel
from lmfoundry.runtime.server.request_body import APIError
from lmfoundry.runtime.server.responses import ChatBuilder, TokenText

UNSUPPORTED = ("previous_response_id", "reasoning", "include", "background", "conversation", "prompt")


class ResponsesRequest(StrictModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    parallel_tool_calls: bool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    # accepted, changing nothing here (as on /v1/chat/completions)
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # UNSUPPORTED: refused by name when given
    previous_response_id: Any = None
    reasoning: Any = None
    include: Any = None
    background: Any = None
    conversation: Any = None
    prompt: Any = None

    def unsupported(self) -> str | None:
        for name in UNSUPPORTED:
            if getattr(self, name) not in (None, [], {}, False):
                return f"{name} is not supported by this server's /v1/responses"
        return None

    def messages(self) -> list[dict[str, Any]]:
        """The chat messages: instructions as a system message, then the input."""
        out: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return out + [{"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            if kind == "function_call":  # a call the model made earlier: an assistant turn's tool_calls
                call = {"id": item.get("call_id"), "type": "function",
                        "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
                if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") and not out[-1]["content"]:
                    out[-1]["tool_calls"].append(call)
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
                continue
            if kind == "function_call_output":
                out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": str(item.get("output", ""))})
                continue
            if kind != "message" or "role" not in item:
                raise ValueError(f"input[{i}]: only messages, function_call and function_call_output items "
                                 f"are supported, got {kind!r}")
            content = item.get("content")
            if isinstance(content, list):  # parts: input_text / output_text
                texts = []
                for part in content:
                    if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
                        raise ValueError(f"input[{i}].content: only text parts are supported")
                    texts.append(str(part.get("text", "")))
                content = "".join(texts)
            if not isinstance(content, str):
                raise ValueError(f"input[{i}].content must be a string or a list of text parts")
            out.append({"role": item["role"], "content": content})
        return out

    def chat_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"messages": self.messages(), "model": self.model}
        if self.tools:
            body["tools"] = []
            for i, tool in enumerate(self.tools):
                if tool.get("type") != "function":
                    raise ValueError(f"tools[{i}].type {tool.get('type')!r} is not supported; function tools are")
                body["tools"].append({"type": "function", "function": {
                    k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}})
        if isinstance(self.tool_choice, dict):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.get("name")}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        if self.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = self.parallel_tool_calls
        for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"),
                             ("top_p", "top_p")):
            if getattr(self, ours) is not None:
                body[theirs] = getattr(self, ours)
        fmt = (self.text or {}).get("format")
        if fmt is not None:
            if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
                raise ValueError("text.format.type must be text, json_object or json_schema")
            if fmt["type"] == "json_schema":
                body["response_format"] = {"type": "json_schema", "json_schema": {
                    "name": fmt.get("name", "output"), "schema": fmt.get("schema") or {}, "strict": fmt.get("strict")}}
            elif fmt["type"] == "json_object":
                body["response_format"] = {"type": "json_object"}
        return body


def _response(rid: str, created: int, model: str, output: list[dict[str, Any]], status: str,
              usage: dict[str, int] | None, req: ResponsesRequest) -> dict[str, Any]:
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "output": output,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "error": None, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
            "text": req.text or {"format": {"type": "text"}}, "store": False, "metadata": req.metadata or {},
            "usage": usage}


class _Output:
    """The response's output items, built from the chat path's deltas in the order they appear:
    one message (its text) and one function_call item per tool call. `feed` returns the streaming
    events a delta causes, `finish` those that close the items."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.message: dict[str, Any] | None = None
        self.calls: dict[int, dict[str, Any]] = {}  # the chat delta's call index -> its item

    def feed(self, delta: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        events: list[tuple[str, dict[str, Any]]] = []
        if text := delta.get("content"):
            if self.message is None:
                self.message = {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "in_progress",
                                "role": "assistant", "content": [], "_text": ""}
                self.items.append(self.message)
                events.append(("response.output_item.added", {"output_index": len(self.items) - 1,
                                                               "item": _public(self.message)}))
                events.append(("response.content_part.added", {
                    "item_id": self.message["id"], "output_index": len(self.items) - 1, "content_index": 0,
                    "part": {"type": "output_text", "text": "", "annotations": []}}))
            self.message["_text"] += text
            events.append(("response.output_text.delta", {"item_id": self.message["id"],
                                                          "output_index": self.items.index(self.message),
                                                          "content_index": 0, "delta": text, "logprobs": []}))
        for call in delta.get("tool_calls", []):
            item = self.calls.get(call["index"])
            if item is None:
                item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                        "name": call["function"]["name"], "arguments": "", "status": "in_progress"}
                self.calls[call["index"]] = item
                self.items.append(item)
                events.append(("response.output_item.added", {"output_index": len(self.items) - 1,
                                                               "item": dict(item)}))
            if args := call["function"].get("arguments"):
                item["arguments"] += args
                events.append(("response.function_call_arguments.delta", {
                    "item_id": item["id"], "output_index": self.items.index(item), "delta": args}))
        return events

    def finish(self, status: str) -> list[tuple[str, dict[str, Any]]]:
        events: list[tuple[str, dict[str, Any]]] = []
        done = "completed" if status == "completed" else "incomplete"
        for index, item in enumerate(self.items):
            item["status"] = done
            if item is self.message:
                part = {"type": "output_text", "text": item["_text"], "annotations": []}
                item["content"] = [part]
                events.append(("response.output_text.done", {"item_id": item["id"], "output_index": index,
                                                             "content_index": 0, "text": item["_text"],
                                                             "logprobs": []}))
                events.append(("response.content_part.done", {"item_id": item["id"], "output_index": index,
                                                              "content_index": 0, "part": part}))
            else:
                events.append(("response.function_call_arguments.done", {
                    "item_id": item["id"], "output_index": index, "arguments": item["arguments"]}))
            events.append(("response.output_item.done", {"output_index": index, "item": _public(item)}))
        return events

    def public(self) -> list[dict[str, Any]]:
        return [_public(item) for item in self.items]


def _public(item: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in item.items() if not k.startswith("_")}


def prepare_response(preparer: Preparer, body: bytes) -> tuple[ResponsesRequest, PreparedChat]:
    """Parse a /v1/responses body and prepare it as the chat request it amounts to (the chat path's
    one preparation: template, tool choice, sampling parameters, validation)."""
    req = preparer.parse(body, ResponsesRequest)
    if (reason := req.unsupported()) is not None:
        raise APIError(400, reason)
    try:
        chat = ChatCompletionRequest.model_validate(req.chat_body())
    except ValueError as exc:  # also pydantic's ValidationError
        message = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
        raise APIError(400, message, param="input") from None
    return req, preparer.chat_request(chat)


class ResponseBuilder:
    """The Responses object (whole) or its server-sent events (stream), from the chat path's
    deltas (`ChatBuilder.choices`)."""

    def __init__(self, req: ResponsesRequest, chat: PreparedChat, rid: str, token_text: TokenText) -> None:
        self.req, self.rid = req, rid
        self.created = int(time.time())
        self.chat = ChatBuilder(chat, rid, token_text)
        self.output = _Output()

    def _usage(self) -> dict[str, int]:
        prompt, completion = len(self.chat.prompt), self.chat.completion_tokens
        return {"input_tokens": prompt, "output_tokens": completion, "total_tokens": prompt + completion}

    def _response(self, output: list[dict[str, Any]], status: str, usage: dict[str, int] | None) -> dict[str, Any]:
        return _response(self.rid, self.created, self.chat.model, output, status, usage, self.req)

    async def collect(self, events: AsyncIterator[tuple[int, StepEvent]]) -> dict[str, Any]:
        finish = None
        async for choice in self.chat.choices(events):
            self.output.feed(choice["delta"])
            finish = choice["finish_reason"] or finish
        self.output.finish(_status(finish))
        return self._response(self.output.public(), _status(finish), self._usage())

    async def events(self, events: AsyncIterator[tuple[int, StepEvent]]) -> AsyncIterator[str]:
        seq = 0

        def event(kind: str, fields: dict[str, Any]) -> str:
            nonlocal seq
            seq += 1
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **fields})}\n\n"

        started = self._response([], "in_progress", None)
        yield event("response.created", {"response": started})
        yield event("response.in_progress", {"response": started})
        finish = None
        try:
            async for choice in self.chat.choices(events):
                finish = choice["finish_reason"] or finish
                for kind, fields in self.output.feed(choice["delta"]):
                    yield event(kind, fields)
        except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band
            yield event("error", {"code": "server_error", "message": str(exc), "param": None})
            return
        status = _status(finish)
        for kind, fields in self.output.finish(status):
            yield event(kind, fields)
        final = self._response(self.output.public(), status, self._usage())
        yield event("response.completed" if status == "completed" else "response.incomplete", {"response": final})


def _status(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"
