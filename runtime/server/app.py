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

This module builds the app around the request handling of openai_server.py: the routes, the API
key, the error shapes, CORS and the schema.
"""

from __future__ import annotations

import contextlib
import hmac
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmfoundry.runtime.engine.client import EngineClient
from lmfoundry.runtime.server.background import DEFAULT_READ_TIMEOUT
from lmfoundry.runtime.server.lora_routes import register_lora_routes
from lmfoundry.runtime.server.openai_server import DEFAULT_MAX_BODY_BYTES, MAX_N, OpenAIServer
from lmfoundry.runtime.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from lmfoundry.runtime.server.request_body import APIError, ClientGone
from lmfoundry.runtime.server.responses_api import ResponsesRequest


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


def create_app(engine: EngineClient, model_name: str, api_key: str | None = None,
               aliases: tuple[str, ...] = (), max_n: int = MAX_N, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               read_timeout: float = DEFAULT_READ_TIMEOUT, options: ApiOptions = ApiOptions()) -> FastAPI:
    """The FastAPI app. `max_body_bytes` bounds request bodies (413 beyond); `read_timeout` bounds
    the time a body may take to arrive after its headers (408 beyond); `options`: CORS, unknown
    fields, metric names, /openapi.json."""
    server = OpenAIServer(engine, model_name, aliases, max_n, max_body_bytes, read_timeout, options.metrics_names,
                          options.lenient_request_fields)

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
