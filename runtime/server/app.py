"""The OpenAI-compatible HTTP API over an `AsyncLLMEngine` (FastAPI, served by uvicorn).

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with SSE streaming),
GET /v1/models, GET /health, GET /metrics. Errors use OpenAI's body
{"error": {"message", "type", "param", "code"}}: 400 for invalid requests, 401 for a missing or
wrong API key, 404 for an unknown model, 429 when the waiting queue is full.
A client that disconnects (mid-stream or while waiting for a whole response) has its request
aborted, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from lmfoundry.runtime.engine.async_engine import AsyncLLMEngine, QueueFull, RequestStream
from lmfoundry.runtime.engine.outputs import StepEvent
from lmfoundry.runtime.engine.sampling_params import SamplingParams
from lmfoundry.runtime.server.metrics import ServerMetrics
from lmfoundry.runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from lmfoundry.runtime.server.responses import ChatBuilder, CompletionBuilder

MAX_N = 8


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


class ClientGone(Exception):
    pass


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0]
    loc = ".".join(str(x) for x in err.get("loc", ()))
    return (f"{loc}: {err.get('msg')}" if loc else str(err.get("msg"))), loc or None


async def _parse(request: Request, schema: type[BaseModel]) -> Any:
    body = await request.body()
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return schema.model_validate_json(body)
    except ValidationError as exc:
        message, param = _validation_message(exc)
        raise APIError(400, message, param=param) from None


class OpenAIServer:
    """Request handling, separated from route registration so that it reads top to bottom."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str, aliases: tuple[str, ...] = (),
                 max_n: int = MAX_N) -> None:
        self.engine = engine
        self.tokenizer = engine.engine.tokenizer
        self.model_name = model_name
        self.names = {model_name, *aliases}
        self.max_n = max_n
        self.metrics = ServerMetrics(engine.engine)
        self.created = int(time.time())

    # ---- shared checks ----------------------------------------------------------------------
    def _check_common(self, req: Any) -> None:
        if req.model is not None and req.model not in self.names:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves "
                                f"{self.model_name!r}", code="model_not_found", param="model")
        if not 1 <= req.n <= self.max_n:
            raise APIError(400, f"n must be between 1 and {self.max_n}, got {req.n}", param="n")
        if (reason := req.unsupported()) is not None:
            raise APIError(400, reason)

    def _encode(self, prompt: str | list[int]) -> list[int]:
        try:
            return self.engine.engine.encode(prompt)
        except ValueError as exc:
            raise APIError(400, str(exc), param="prompt") from None

    def _check(self, ids: list[int], params: SamplingParams) -> None:
        try:
            self.engine.check(ids, params)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None

    def _submit(self, prompts: list[list[int]], params: SamplingParams, base_id: str,
                start: float) -> AsyncIterator[tuple[int, StepEvent]]:
        """Enqueue every prompt as its own engine request (all or none); return their events as
        (prompt index, event), interleaved."""
        streams: list[RequestStream] = []
        try:
            for i, ids in enumerate(prompts):
                streams.append(self.engine.submit(ids, params, f"{base_id}-{i}"))
        except QueueFull as exc:
            for st in streams:
                st.abort()
            raise APIError(429, str(exc), type_="rate_limit_error", code="rate_limit_exceeded") from None
        except ValueError as exc:
            for st in streams:
                st.abort()
            raise APIError(400, str(exc)) from None
        return _merge([self.metrics.observe(st.__aiter__(), start) for st in streams], streams)

    # ---- /v1/completions --------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        start = time.monotonic()
        req: CompletionRequest = await _parse(request, CompletionRequest)
        self._check_common(req)
        prompts = [self._encode(p) for p in req.prompts()]
        if not prompts:
            raise APIError(400, "prompt is empty", param="prompt")
        if req.max_tokens is None:
            max_tokens = self.engine.engine.max_model_len - max(len(p) for p in prompts)
        else:
            max_tokens = req.max_tokens
        want_prompt_lps = req.echo and req.logprobs is not None
        params = req.sampling_params(max_tokens, req.logprobs, req.logprobs if want_prompt_lps else None)
        for ids in prompts:
            self._check(ids, params)
        rid = f"cmpl-{uuid.uuid4().hex}"
        events = self._submit(prompts, params, rid, start)
        builder = CompletionBuilder(self, req, prompts, rid)
        if req.stream:
            return self._stream(request, builder.chunks(events), rid)
        result = await self._collect(request, builder.collect(events))
        return JSONResponse(result)

    # ---- /v1/chat/completions ---------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        start = time.monotonic()
        req: ChatCompletionRequest = await _parse(request, ChatCompletionRequest)
        self._check_common(req)
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions")
        try:
            text = self.tokenizer.apply_chat_template(
                [m.as_template_input() for m in req.messages], tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - template errors are the request's fault
            raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from None
        ids = list(self.tokenizer(text, add_special_tokens=False).input_ids)
        max_tokens = req.wanted_max_tokens
        if max_tokens is None:
            max_tokens = max(1, self.engine.engine.max_model_len - len(ids))
        top = req.top_logprobs if req.logprobs else None
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        params = req.sampling_params(max_tokens, (top or 0) if req.logprobs else None)
        self._check(ids, params)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        events = self._submit([ids], params, rid, start)
        builder = ChatBuilder(self, req, ids, rid)
        if req.stream:
            return self._stream(request, builder.chunks(events), rid)
        result = await self._collect(request, builder.collect(events))
        return JSONResponse(result)

    # ---- plumbing ---------------------------------------------------------------------------
    def _stream(self, request: Request, chunks: AsyncIterator[dict], rid: str) -> StreamingResponse:
        async def sse() -> AsyncIterator[str]:
            try:
                async for chunk in chunks:
                    yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
            except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band
                err = {"error": {"message": str(exc), "type": "server_error", "param": None, "code": None}}
                yield f"data: {json.dumps(err)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Request-Id": rid})

    async def _collect(self, request: Request, work: Any) -> dict:
        """Await a whole response, aborting it if the client goes away first."""
        task = asyncio.ensure_future(work)

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        watcher = asyncio.ensure_future(disconnected())
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            watcher.cancel()
            try:
                return task.result()
            except RuntimeError as exc:  # the engine failed this request (logged by the engine thread)
                raise APIError(500, str(exc), type_="server_error") from None
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):  # noqa: BLE001
            pass
        raise ClientGone()

    def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "lmfoundry",
            "max_model_len": self.engine.engine.max_model_len}]}

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"<{token_id}>"
        return self.tokenizer.decode([token_id])


async def _merge(gens: list[AsyncIterator[StepEvent]], streams: list[RequestStream]
                 ) -> AsyncIterator[tuple[int, StepEvent]]:
    """Interleave several requests' events; closing this iterator early aborts all of them."""
    try:
        if len(gens) == 1:
            async for ev in gens[0]:
                yield 0, ev
            return
        queue: asyncio.Queue = asyncio.Queue()
        done_marker = object()

        async def pump(i: int) -> None:
            try:
                async for ev in gens[i]:
                    queue.put_nowait((i, ev))
            except Exception as exc:  # noqa: BLE001 - forwarded to the consumer
                queue.put_nowait((i, exc))
            finally:
                queue.put_nowait((i, done_marker))

        tasks = [asyncio.ensure_future(pump(i)) for i in range(len(gens))]
        try:
            remaining = len(gens)
            while remaining:
                i, item = await queue.get()
                if item is done_marker:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
    finally:
        for st in streams:
            st.abort()  # no-op for finished requests; frees the blocks of abandoned ones


def create_app(engine: AsyncLLMEngine, model_name: str, api_key: str | None = None,
               aliases: tuple[str, ...] = (), max_n: int = MAX_N) -> FastAPI:
    server = OpenAIServer(engine, model_name, aliases, max_n)
    app = FastAPI(title="lmfoundry", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "missing or invalid API key (send Authorization: Bearer KEY)",
                           type_="authentication_error", code="invalid_api_key")

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        server.metrics.rejected.labels(status=str(exc.status)).inc()
        return exc.response()

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody is listening; the request was aborted

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        authorize(request)
        return await server.completions(request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        authorize(request)
        return await server.chat(request)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        authorize(request)
        return server.models()

    @app.get("/health")
    async def health() -> Response:
        alive = engine.is_alive
        return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
