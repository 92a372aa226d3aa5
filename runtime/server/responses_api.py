"""POST /v1/responses, OpenAI's Responses API, for text: `input` (a string or a list of messages),
`instructions` (a system message first), `max_output_tokens`, `temperature`, `top_p`, `stream`,
and `text.format` (json_schema / json_object through the grammar path).

A response is a chat completion underneath: the request becomes a `ChatCompletionRequest` and
runs the chat path (template, one validation, engine, detokenization); its deltas become the
Responses object, or its server-sent events (`response.created`, `response.output_item.added`,
`response.content_part.added`, `response.output_text.delta`..., the matching `.done` events and
`response.completed`). Responses are not stored: `previous_response_id` and `store: true`
retrieval are not offered, nor tools (a 400 names them).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ConfigDict, ValidationError

from lmfoundry.runtime.server.protocol import ChatCompletionRequest, _Strict
from lmfoundry.runtime.server.responses import ChatBuilder

UNSUPPORTED = ("previous_response_id", "tools", "tool_choice", "reasoning", "include", "background",
               "conversation", "prompt")


class ResponsesRequest(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")  # other fields are named in `unsupported`
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

    def unsupported(self) -> str | None:
        for name in UNSUPPORTED:
            value = getattr(self, name, None) if name in type(self).model_fields else (self.model_extra or {}).get(name)
            if value not in (None, [], {}):
                return f"{name} is not supported by this server's /v1/responses"
        unknown = sorted(set(self.model_extra or {}) - set(UNSUPPORTED))
        return f"unknown field {unknown[0]!r}" if unknown else None

    def messages(self) -> list[dict[str, Any]]:
        """The chat messages: instructions as a system message, then the input."""
        out = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return out + [{"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            if item.get("type", "message") != "message" or "role" not in item:
                raise ValueError(f"input[{i}]: only messages (role and content) are supported")
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


def _response(rid: str, created: int, model: str, text: str, status: str, usage: dict[str, int] | None,
              msg_id: str, req: ResponsesRequest) -> dict[str, Any]:
    output = [] if status == "in_progress" else [{
        "type": "message", "id": msg_id, "status": "completed" if status == "completed" else "incomplete",
        "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": []}]}]
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "output": output,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "error": None, "parallel_tool_calls": False, "tool_choice": "none", "tools": [],
            "text": req.text or {"format": {"type": "text"}}, "store": False, "metadata": req.metadata or {},
            "usage": usage}


async def create_response(server: Any, request: Request, body: bytes) -> Response:
    """The /v1/responses handler; `server` is the app's OpenAIServer (its chat path and plumbing)."""
    from lmfoundry.runtime.server.app import APIError

    def prepare(raw: bytes) -> tuple[ResponsesRequest, ChatCompletionRequest, list[int], Any]:
        from lmfoundry.runtime.server.app import _parse

        req: ResponsesRequest = _parse(raw, ResponsesRequest)
        if (reason := req.unsupported()) is not None:
            raise APIError(400, reason)
        try:
            chat = ChatCompletionRequest.model_validate(req.chat_body())
        except ValueError as exc:  # also pydantic's ValidationError
            message = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
            raise APIError(400, message, param="input") from None
        chat_req, ids, params = server.prepare_chat_request(chat)
        return req, chat_req, ids, params

    start = time.monotonic()
    req, chat, ids, params = await server._off_loop(prepare, body)
    rid, msg_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
    created = int(time.time())
    events = server._submit([ids], params, rid, start)
    builder = ChatBuilder(server, chat, ids, rid)

    def usage() -> dict[str, int]:
        return {"input_tokens": len(ids), "output_tokens": builder.completion_tokens,
                "total_tokens": len(ids) + builder.completion_tokens}

    if not req.stream:
        async def whole() -> dict[str, Any]:
            text, finish = "", None
            async for choice in builder._choices(events):
                text += choice["delta"].get("content", "")
                finish = choice["finish_reason"] or finish
            status = "incomplete" if finish == "length" else "completed"
            return _response(rid, created, server.model_name, text, status, usage(), msg_id, req)

        return JSONResponse(await server._collect(request, whole()))

    async def sse() -> AsyncIterator[str]:
        seq = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal seq
            seq += 1
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **fields})}\n\n"

        part = {"type": "output_text", "text": "", "annotations": []}
        item = {"type": "message", "id": msg_id, "status": "in_progress", "role": "assistant", "content": []}
        yield event("response.created", response=_response(rid, created, server.model_name, "", "in_progress",
                                                             None, msg_id, req))
        yield event("response.in_progress", response=_response(rid, created, server.model_name, "", "in_progress",
                                                                 None, msg_id, req))
        yield event("response.output_item.added", output_index=0, item=item)
        yield event("response.content_part.added", item_id=msg_id, output_index=0, content_index=0, part=part)
        text, finish = "", None
        try:
            async for choice in builder._choices(events):
                delta = choice["delta"].get("content", "")
                finish = choice["finish_reason"] or finish
                if delta:
                    text += delta
                    yield event("response.output_text.delta", item_id=msg_id, output_index=0, content_index=0,
                                delta=delta, logprobs=[])
        except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band
            yield event("error", code="server_error", message=str(exc), param=None)
            return
        status = "incomplete" if finish == "length" else "completed"
        done_part = {**part, "text": text}
        yield event("response.output_text.done", item_id=msg_id, output_index=0, content_index=0, text=text,
                    logprobs=[])
        yield event("response.content_part.done", item_id=msg_id, output_index=0, content_index=0, part=done_part)
        yield event("response.output_item.done", output_index=0,
                    item={**item, "status": "completed" if status == "completed" else "incomplete",
                          "content": [done_part]})
        final = _response(rid, created, server.model_name, text, status, usage(), msg_id, req)
        yield event("response.completed" if status == "completed" else "response.incomplete", response=final)

    return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache",
                                                                              "X-Request-Id": rid})
