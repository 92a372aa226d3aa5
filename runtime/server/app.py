"""The OpenAI-compatible HTTP API over an `EngineClient` (FastAPI, served by uvicorn): the engine
in its own process (`EngineCoreClient`, what `serve` runs) or in a thread (`AsyncLLMEngine`).

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with SSE streaming),
GET /v1/models, GET /health (and /ping, its SageMaker name, as vLLM answers it), GET /metrics, and
vLLM's tokenizer endpoints (GET /tokenizer_info, POST /tokenize, POST /detokenize), with which
`lm_eval --model local-completions` tokenizes through the server and needs no local copy of the
tokenizer; GET /openapi.json when `ApiOptions.openapi`. With an API key, every route but the
probes (/health, /ping, /version, /metrics) needs it, the schema included (it maps the API for
whoever reads it; /docs and /redoc are not served). Unknown request fields are a 400 naming
them (`request_body.parse_body`; `ApiOptions.lenient_request_fields` drops them instead).
Errors use OpenAI's body {"error": {"message", "type", "param", "code"}}: 400 for invalid
requests, 401 for a missing or wrong API key, 404 for an unknown model, 408 for a body that does
not arrive in time, 413 for a body over the size limit, 415 for a POST that is not
application/json, 429 when the waiting queue is full, 500 when the engine fails the request (the
others keep running), 503 once the engine process has died or while the server stops.
A client that disconnects (mid-stream or while waiting for a whole response) has its request
aborted, which frees its KV blocks.

Stopping (`drain`, called by background.GracefulServer on SIGINT/SIGTERM): new requests get 503
and /health 503 at once; the requests in the engine may finish for up to the drain time, then
every one left fails with 503 (or, in a stream already under way, a final error event before
`data: [DONE]`) and is aborted in the engine.

The event loop only moves bytes: the body is read with a size limit and a deadline
(request_body.py, which also holds the error type), then parsing,
the chat template, tokenization (seconds for a multi-megabyte prompt) and the request's one
validation run in a small thread pool, so the other streams keep flowing (prepare.py: a body
becomes one prepared request that the submission and the response builders read, responses.py).
The engine streams token ids; their text and stop strings are worked out here (output_processor.py). Requiring application/json on POST keeps browsers from
reaching a keyless server on 127.0.0.1 with cross-site "simple" requests (text/plain or form
bodies are sent without a CORS preflight; application/json is not). CORS is off unless origins
are allowed (`ApiOptions.allowed_origins`, vLLM's flags): then Starlette's middleware answers the
preflights and marks the responses, errors included, for those origins ("*" with credentials is
refused: the middleware would reflect any origin as allowed to send them).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import json
import struct
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, AsyncIterator, Callable, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmfoundry.runtime.engine.client import (
    EngineClient,
    EngineDead,
    EngineRequest,
    QueueFull,
    RequestStream,
    ShuttingDown,
    merge_events,
)
from lmfoundry.runtime.engine.output_processor import detokenize
from lmfoundry.runtime.engine.outputs import StepEvent
from lmfoundry.runtime.engine.sampling_params import SamplingParams
from lmfoundry.runtime.engine.validation import RequestValidator
from lmfoundry.runtime.server.background import DEFAULT_READ_TIMEOUT
from lmfoundry.runtime.server.lora_routes import model_entries, register_lora_routes
from lmfoundry.runtime.server.metrics import ServerMetrics
from lmfoundry.runtime.server.prepare import Preparer
from lmfoundry.runtime.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from lmfoundry.runtime.server.request_body import (
    APIError,
    ClientGone,
    engine_dead,
    read_body,
    require_json,
)
from lmfoundry.runtime.server.responses import ChatBuilder, CompletionBuilder
from lmfoundry.runtime.server.responses_api import ResponseBuilder, ResponsesRequest, prepare_response

MAX_N = 8
# Enough for any prompt that fits a long context as text or token ids; larger bodies get 413.
DEFAULT_MAX_BODY_BYTES = 8 * 2**20
PREP_THREADS = 4  # parse + chat template + tokenize, off the event loop

T = TypeVar("T")
# Characters str.splitlines() ends a line at that JSON leaves raw: a client that reads the event
# stream with it (httpx's iter_lines does) would cut a chunk whose text holds one of them in two.
# SSE itself ends lines at CR and LF only, which JSON always escapes.
_LINE_BREAKS = {ord(c): f"\\u{ord(c):04x}" for c in "\x85\u2028\u2029"}


def sse_event(payload: Any) -> str:
    """One server-sent event of a JSON payload; non-ASCII text stays UTF-8, except the characters
    some line readers split at, which are escaped (the payload decodes to the same value)."""
    return f"data: {json.dumps(payload, ensure_ascii=False).translate(_LINE_BREAKS)}\n\n"


@dataclass(frozen=True)
class ApiOptions:
    """What `serve`'s HTTP flags choose beyond the engine; the defaults are a closed, strict server."""

    allowed_origins: tuple[str, ...] = ()  # CORS: () none (no CORS headers, preflights 405), "*" any
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    lenient_request_fields: bool = False  # log and drop unknown request fields instead of a 400
    metrics_names: str = "both"  # ours | vllm | both (metrics.METRICS_NAMES)
    openapi: bool = False  # serve GET /openapi.json (behind the API key, as every route but the probes)

    def __post_init__(self) -> None:
        """Starlette's CORS middleware, given "*" with credentials, answers every origin with that
        origin and Allow-Credentials: true, so any web page could act with the user's cookies or
        browser-held credentials: the combination is refused rather than built."""
        if self.allow_credentials and "*" in self.allowed_origins:
            raise ValueError("allow_credentials with allowed_origins '*' would let every web page send "
                             "credentialed requests; list the origins explicitly")


class OpenAIServer:
    """Request handling, separated from route registration so that it reads top to bottom."""

    def __init__(self, engine: EngineClient, model_name: str, aliases: tuple[str, ...] = (),
                 max_n: int = MAX_N, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 read_timeout: float = DEFAULT_READ_TIMEOUT, options: ApiOptions = ApiOptions()) -> None:
        self.engine = engine
        self.options = options
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        self.names = {model_name, *aliases}
        self.max_n = max_n
        self.max_body_bytes = max_body_bytes
        self.read_timeout = read_timeout
        self.vocab_size = engine.info.vocab_size
        self.max_model_len = engine.info.max_model_len
        self.metrics = ServerMetrics(engine.stats, model_name, self.max_model_len, options.metrics_names,
                                     {k: "" if v is None else str(v) for k, v in self.runtime().items()})
        self.created = int(time.time())
        self.prep = ThreadPoolExecutor(PREP_THREADS, thread_name_prefix="lmfoundry-prep")
        self.draining = False
        self.lora_enabled = engine.info.max_loras > 0
        # every request body is parsed and checked here, into what the engine and the response need
        self.preparer = Preparer(RequestValidator(engine.info, self.tokenizer), model_name, self.names,
                                 set(engine.info.loras), max_n, options.lenient_request_fields)

    def runtime(self) -> dict[str, Any]:
        """What the engine runs (`EngineInfo`, read from the loaded model): the `lmfoundry` object of
        /v1/models and the labels of `lmfoundry_model_info`."""
        info = self.engine.info
        return {"dtype": info.dtype, "device": info.device, "cpu_isa": info.cpu_isa,
                "weight_format": info.weight_format}

    async def _body(self, request: Request) -> bytes:
        require_json(request)
        return await read_body(request, self.max_body_bytes, self.read_timeout)

    async def _off_loop(self, fn: Callable[[bytes], T], body: bytes) -> T:
        """Run request preparation (parse, template, tokenize) in the prep pool."""
        return await asyncio.get_running_loop().run_in_executor(self.prep, fn, body)

    def _admit(self) -> None:
        """Refuse new work while the server stops (see `drain`)."""
        if self.draining:
            raise APIError(503, "the server is shutting down; send the request to another instance",
                           type_="server_error", code="server_shutting_down")

    async def drain(self, timeout: float, forced: Callable[[], bool] = lambda: False) -> int:
        """Stop admitting requests (503 from now on), let those in the engine finish for up to
        `timeout` seconds (or until `forced()`), then fail the rest with an error their clients see
        and abort them in the engine; returns how many were failed."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.engine.num_unfinished_seqs and time.monotonic() < deadline and not forced():
            await asyncio.sleep(0.05)
        return self.engine.stop_all(ShuttingDown(
            f"the server is shutting down and the request did not finish within its {timeout:g} s drain"))

    def _submit(self, prompts: list[list[int]], params: SamplingParams, base_id: str,
                start: float) -> AsyncIterator[tuple[int, StepEvent]]:
        """Enqueue every prompt as its own engine request (all or none); return their events as
        (prompt index, event), interleaved."""
        self._admit()
        streams: list[RequestStream] = []
        try:
            for i, ids in enumerate(prompts):
                streams.append(self.engine.submit(EngineRequest(f"{base_id}-{i}", ids, params, start)))
        except (QueueFull, EngineDead, ValueError) as exc:
            for st in streams:
                st.abort()
            if isinstance(exc, QueueFull):
                raise APIError(429, str(exc), type_="rate_limit_error", code="rate_limit_exceeded") from None
            if isinstance(exc, EngineDead):
                raise engine_dead(exc) from None
            raise APIError(400, str(exc)) from None
        eos = self.engine.info.eos_token_ids
        return merge_events([self.metrics.observe(detokenize(st.__aiter__(), ids, params, self.tokenizer, eos), start, params)
                       for st, ids in zip(streams, prompts, strict=True)], streams)

    # ---- /v1/completions --------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        start = time.monotonic()
        job = await self._off_loop(self.preparer.completion, await self._body(request))
        rid = f"cmpl-{uuid.uuid4().hex}"
        events = self._submit(job.prompts, job.params, rid, start)
        builder = CompletionBuilder(job, rid, self.preparer.token_text)
        if job.req.stream:
            return self._stream(request, builder.chunks(events), rid)
        result = await self._collect(request, builder.collect(events))
        return JSONResponse(result)

    # ---- /v1/chat/completions ---------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        start = time.monotonic()
        chat = await self._off_loop(self.preparer.chat, await self._body(request))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        events = self._submit([chat.prompt], chat.params, rid, start)
        builder = ChatBuilder(chat, rid, self.preparer.token_text)
        if chat.req.stream:
            return self._stream(request, builder.chunks(events), rid)
        result = await self._collect(request, builder.collect(events))
        return JSONResponse(result)

    # ---- /v1/responses ----------------------------------------------------------------------
    async def responses(self, request: Request) -> Response:
        """A chat request underneath (responses_api.py): the chat preparation, its own body."""
        start = time.monotonic()
        req, chat = await self._off_loop(partial(prepare_response, self.preparer), await self._body(request))
        rid = f"resp_{uuid.uuid4().hex}"
        events = self._submit([chat.prompt], chat.params, rid, start)
        builder = ResponseBuilder(req, chat, rid, self.preparer.token_text)
        if req.stream:
            return StreamingResponse(builder.events(events), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": rid})
        return JSONResponse(await self._collect(request, builder.collect(events)))

    # ---- /v1/embeddings ---------------------------------------------------------------------
    async def embeddings(self, request: Request) -> Response:
        req, prompts = await self._off_loop(self.preparer.embedding, await self._body(request))
        rid = f"embd-{uuid.uuid4().hex}"
        self._admit()
        try:
            stream = self.engine.embed(rid, prompts)
        except QueueFull as exc:
            raise APIError(429, str(exc), type_="rate_limit_error", code="rate_limit_exceeded") from None
        except EngineDead as exc:
            raise engine_dead(exc) from None

        async def result() -> Any:
            async for item in stream:
                return item
            raise RuntimeError("the engine ended the request without a result")

        out = await self._collect(request, result())
        data = []
        for i, vector in enumerate(out.embeddings):
            value: Any = vector
            if req.encoding_format == "base64":  # little-endian float32, as OpenAI sends it
                value = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append({"object": "embedding", "index": i, "embedding": value})
        return JSONResponse({"object": "list", "data": data, "model": self.model_name,
                             "usage": {"prompt_tokens": out.num_tokens, "total_tokens": out.num_tokens}})

    # ---- plumbing ---------------------------------------------------------------------------
    def _stream(self, request: Request, chunks: AsyncIterator[dict], rid: str) -> StreamingResponse:
        async def sse() -> AsyncIterator[str]:
            try:
                async for chunk in chunks:
                    yield sse_event(chunk)
            except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band
                code = "server_shutting_down" if isinstance(exc, ShuttingDown) else None
                err = {"error": {"message": str(exc), "type": "server_error", "param": None, "code": code}}
                yield sse_event(err)
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Request-Id": rid})

    async def _collect(self, request: Request, work: Any) -> Any:
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
            except EngineDead as exc:
                raise engine_dead(exc) from None
            except Exception as exc:  # noqa: BLE001 - the engine failed this request (logged by its thread)
                raise APIError(500, str(exc), type_="server_error") from None
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):  # noqa: BLE001
            pass
        raise ClientGone()

    def models(self) -> dict:
        base = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "lmfoundry",
                "max_model_len": self.max_model_len, "lmfoundry": self.runtime()}
        return {"object": "list", "data": [base, *model_entries(self, base)]}

    # ---- tokenizer endpoints (vLLM's) -----------------------------------------------------
    def _tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        return self.tokenizer

    def tokenizer_info(self) -> dict:
        tok = self._tokenizer()
        return {"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token, "bos_token": tok.bos_token,
                "pad_token": tok.pad_token, "chat_template": getattr(tok, "chat_template", None),
                "model_max_length": self.max_model_len}

    def _tokenize(self, body: bytes) -> dict:
        req = self.preparer.parse(body, TokenizeRequest)
        self.preparer.check_model(req.model)
        ids = list(self._tokenizer()(req.prompt, add_special_tokens=req.add_special_tokens).input_ids)
        return {"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len}

    def _detokenize(self, body: bytes) -> dict:
        req = self.preparer.parse(body, DetokenizeRequest)
        self.preparer.check_model(req.model)
        if req.tokens and (min(req.tokens) < 0 or max(req.tokens) >= self.vocab_size):
            raise APIError(400, f"tokens must be token ids in [0, {self.vocab_size})", param="tokens")
        return {"prompt": self._tokenizer().decode(req.tokens)}

    async def tokenize(self, request: Request) -> dict:
        return await self._off_loop(self._tokenize, await self._body(request))

    async def detokenize(self, request: Request) -> dict:
        return await self._off_loop(self._detokenize, await self._body(request))


def create_app(engine: EngineClient, model_name: str, api_key: str | None = None,
               aliases: tuple[str, ...] = (), max_n: int = MAX_N, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               read_timeout: float = DEFAULT_READ_TIMEOUT, options: ApiOptions = ApiOptions()) -> FastAPI:
    """The FastAPI app. `max_body_bytes` bounds request bodies (413 beyond); `read_timeout` bounds
    the time a body may take to arrive after its headers (408 beyond); `options`: CORS, unknown
    fields, metric names, /openapi.json."""
    server = OpenAIServer(engine, model_name, aliases, max_n, max_body_bytes, read_timeout, options)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        server.prep.shutdown(wait=False, cancel_futures=True)

    # FastAPI's own /openapi.json, /docs and /redoc are routes outside any router's dependencies, so
    # the API key would not cover them: the docs pages stay off and the schema is served by `api` below.
    app = FastAPI(title="lmfoundry", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.server = server
    if options.allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins),
                           allow_methods=list(options.allowed_methods), allow_headers=list(options.allowed_headers),
                           allow_credentials=options.allow_credentials)
    if options.openapi:
        app.openapi = lambda: openapi_schema(app)  # type: ignore[method-assign]

    async def authorize(request: Request) -> None:
        """--api-key: every route of `api` (all but the probes /health, /ping, /version and
        /metrics, /openapi.json included) asks for it before its handler runs; async, so the check
        stays on the event loop."""
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "missing or invalid API key (send Authorization: Bearer KEY)",
                           type_="authentication_error", code="invalid_api_key")

    api = APIRouter(dependencies=[Depends(authorize)])

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        server.metrics.count_rejected(exc.status)
        return exc.response()

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody is listening; the request was aborted

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        """Unknown routes (404) and methods (405) in OpenAI's error shape, not FastAPI's {"detail"}."""
        message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        error = APIError(exc.status_code, message.get(exc.status_code, str(exc.detail)),
                         code={404: "not_found", 405: "method_not_allowed"}.get(exc.status_code))
        response = await api_error(request, error)
        if exc.headers:  # 405's Allow
            response.headers.update(exc.headers)
        return response

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        # A bug: uvicorn still logs the traceback; the client gets the OpenAI error shape.
        return await api_error(request, APIError(500, f"internal error: {exc}", type_="server_error"))

    @api.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.completions(request)

    @api.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await server.chat(request)

    @api.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await server.responses(request)

    @api.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await server.embeddings(request)

    @api.get("/v1/models")
    async def models(request: Request) -> dict:
        return server.models()

    @api.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> dict:
        """openai's `models.retrieve`: the served model under its name or an alias, else 404."""
        server.preparer.check_model(model_id)
        entries = server.models()["data"]
        return next((e for e in entries if e["id"] == model_id), {**entries[0], "id": model_id})

    @app.get("/version")
    async def version() -> dict:
        from lmfoundry import __version__

        return {"version": __version__}

    @api.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> dict:
        return server.tokenizer_info()

    @api.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        return await server.tokenize(request)

    @api.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        return await server.detokenize(request)

    if options.openapi:
        @api.get("/openapi.json", include_in_schema=False)
        async def openapi(request: Request) -> Response:
            return JSONResponse(openapi_schema(app))

    register_lora_routes(api, server)
    app.include_router(api)

    @app.get("/health")
    @app.get("/ping")
    @app.post("/ping")
    async def health() -> Response:
        status = "engine stopped" if not engine.is_alive else "shutting down" if server.draining else "ok"
        return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """OpenAPI 3 for /openapi.json: FastAPI's description of the routes, with each POST route's
    request body the pydantic schema it is parsed with (the handlers read raw bodies, so FastAPI
    alone would describe none)."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi
        from pydantic.json_schema import models_json_schema

        from lmfoundry import __version__

        bodies: dict[str, type[BaseModel]] = {
            "/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
            "/v1/responses": ResponsesRequest, "/v1/embeddings": EmbeddingRequest, "/tokenize": TokenizeRequest,
            "/detokenize": DetokenizeRequest}
        schema = get_openapi(title="lmfoundry", version=__version__, routes=app.routes,
                             description="OpenAI-compatible API of `lmfoundry serve`")
        _, defs = models_json_schema([(model, "validation") for model in bodies.values()],
                                     ref_template="#/components/schemas/{model}")
        schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
        for path, model in bodies.items():
            schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        app.openapi_schema = schema
    return app.openapi_schema
